"""Certify or predict over a dataset into a Cohen-format TSV, resumable without losing or duplicating rows.

Each row is flushed as soon as it is computed. Image ``i`` is certified with seed ``seed + i``, so a row depends only
on the image, the model and the seed: a resumed run writes exactly the rows an uninterrupted one would. The run's
settings go to a sidecar ``OUTFILE.json``; ``resume`` refuses a file written with other settings (or another
checkpoint, compared by :func:`~splitz_fast.checkpoints.splitz.checkpoint_digest`: weights and training settings, not file
bytes, so a bit-identical retrained checkpoint is accepted) or rows of inputs it does not select (or one input's
twice), drops a torn last line, skips the indices already present, and leaves the rows in the selection's order.
While a run writes its TSV it holds an exclusive lock on the sidecar (``flock``): a second process started on the
same file (a resume while an orphaned worker still writes) is refused instead of interleaving its rows.

What a run computes and writes: :mod:`splitz_fast.runs.tasks`; its files (sidecar, resume, lock):
:mod:`splitz_fast.runs.files`; sharding and merging: :mod:`splitz_fast.runs.shards`.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from .._checks import check_count, check_output_file, dataset_pair
from ..certify.inputs import model_device
from ..data.images import check_images as decode_images
from ..checkpoints.splitz import CHECKPOINT_DIGEST_COVERS, checkpoint_digest, load_checkpoint_file
from ..sampling.engine import NoiseStream
from .files import _lock_sidecar, _prepare_output, _put_in_selection_order, _sidecar
from .schema import SIDECAR_SCHEMA
from .shards import ShardSpec
from .tasks import RunTask

def select_indices(n_items: int, skip: int, max_count: int) -> list[int]:
    """``--skip``/``--max``: every ``skip``-th index, at most ``max_count`` of them (``-1`` = all). Cohen's scripts stop
    at dataset index ``max`` instead (their help text says "this many examples"); docs/cli.md gives the translation."""
    if skip < 1:
        raise ValueError(f"--skip must be >= 1, got {skip}")
    if max_count == 0 or max_count < -1:
        raise ValueError(f"--max must be -1 (all) or >= 1, got {max_count}")
    indices = list(range(0, n_items, skip))
    return indices if max_count == -1 else indices[:max_count]



def run_settings(task: RunTask, settings: dict[str, Any], *, seed: int, indices: Sequence[int],
                 checkpoint: str | os.PathLike | None = None, checkpoint_format: str = "splitz",
                 input_normalization: str | None = None) -> dict[str, Any]:
    """What :func:`run_over_dataset` records in the sidecar of a whole run's TSV (a shard's adds its ``shard``):
    ``settings``, the task's own settings, the seed, the indices and the checkpoint's digest, under the sidecar
    schema (:mod:`splitz_fast.runs.schema`); a MACER checkpoint's ``input_normalization`` too (canonical, as
    :func:`~splitz_fast.checkpoints.macer.input_normalization` writes it), so that a resume behind another one is
    refused by name."""
    check_count("seed", seed, 0)
    settings = dict(settings, **task.settings(), seed=seed,
                    indices=[indices[0], indices[-1], len(indices)] if indices else [], schema=SIDECAR_SCHEMA)
    if task.draws_noise and task.model is not None:
        # The fallback generator draws other noise than the Philox kernels (a machine without a C++ compiler,
        # SPLITZ_BACKEND=reference): recorded, so that a resume or a merge never mixes rows of the two streams.
        settings["noise_stream"] = NoiseStream(0, model_device(task.model)).source
    if checkpoint is None and task.model is not None:
        # No checkpoint names the model (a run from Python): its weights do, so a resume with another model (or
        # another split of it) is refused rather than mixed into the file.
        settings["model_digest"] = checkpoint_digest({"model": task.model.state_dict()})
    if checkpoint is not None:
        ckpt = load_checkpoint_file(checkpoint, format=checkpoint_format, input_normalization=input_normalization)
        settings["checkpoint_digest"] = checkpoint_digest(ckpt)
        settings["checkpoint_digest_covers"] = CHECKPOINT_DIGEST_COVERS
        settings["checkpoint_format"] = checkpoint_format
        if checkpoint_format == "macer":
            settings["input_normalization"] = ckpt["model_spec"]["input_normalization"]
    return settings


def finished_output(task: RunTask, out_path: str | os.PathLike, settings: dict[str, Any],
                    indices: Sequence[int], resume: bool) -> bool:
    """Whether ``out_path`` (a whole run's TSV, ``settings`` from :func:`run_settings`) already holds every row, so
    that a resumed job has nothing to do; ``False`` where it does not exist. Without ``resume`` an existing file is
    an error, and with it a file of other settings or foreign rows is refused, before any shard starts."""
    out_path = Path(out_path)
    if not out_path.exists():
        return False
    if not resume:
        raise FileExistsError(f"{out_path} exists; pass --resume to continue it, or choose another OUTFILE")
    return set(indices) <= _prepare_output(out_path, task, settings, True, indices)


def run_over_dataset(
    task: RunTask,
    dataset: Dataset,
    out_path: str | os.PathLike,
    *,
    settings: dict[str, Any],
    indices: list[int],
    seed: int,
    resume: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_format: str = "splitz",
    input_normalization: str | None = None,
    progress: bool = True,
    check_images: bool = True,
    stop_after: int | None = None,
    on_row: Callable[[int, Any], None] | None = None,
    shard: ShardSpec | None = None,
) -> Path:
    """Run ``task`` (:class:`~splitz_fast.runs.tasks.CertifyRun`, :class:`~splitz_fast.runs.tasks.PredictRun`,
    :class:`~splitz_fast.runs.tasks.MarginRun`, :class:`~splitz_fast.runs.tasks.AttackRun`) over every selected dataset
    index into ``out_path``.

    ``settings`` (what else determines the rows: dataset, split, model, bound options…) is stored in the sidecar
    together with the task's own settings, the seed, the indices and the checkpoint's digest (``checkpoint_digest``,
    described by ``checkpoint_digest_covers``; ``checkpoint_format`` says how ``checkpoint`` is read, see
    :func:`~splitz_fast.checkpoints.splitz.load_checkpoint`, ``input_normalization`` that of a MACER checkpoint,
    recorded too; without a checkpoint, the digest
    of the task's model's weights, ``model_digest``); ``stop_after`` stops after that
    many new rows (as an interruption would). ``check_images``: before the first row, decode every image file this
    call will read (a folder dataset's, :func:`~splitz_fast.data.images.check_images`), so that a damaged one is
    refused at once, not when the run reaches it. The inputs stream through the task (shared ``f_R`` batches, one host
    sync per group of inputs); each row is written as soon as its input is done. The ``f_R`` batch size does not
    change the rows — the noise of an input depends only on its seed — so it is not part of the settings a resume
    must match.

    ``shard`` (a :class:`~splitz_fast.runs.shards.ShardSpec`) runs only that shard of ``indices`` into
    ``shard.path(out_path)`` (returned), whose sidecar holds these settings plus the ``shard`` record;
    :func:`~splitz_fast.runs.shards.merge_shards` makes ``out_path`` from them.
    """
    if not isinstance(task, RunTask):
        raise TypeError(f"task must be a RunTask (CertifyRun, PredictRun, MarginRun, AttackRun), got "
                        f"{type(task).__name__}")
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise TypeError("run_over_dataset takes the dataset itself (dataset[i] = (input, label)), not a DataLoader: "
                        "pass loader.dataset (the run reads the inputs it selects one by one)")
    # Check every argument before the output file is created, so a typo leaves nothing behind.
    if any(not 0 <= i < len(dataset) for i in indices):
        raise ValueError(f"indices must lie in [0, {len(dataset)})")
    repeated = [i for i, times in Counter(indices).items() if times > 1]
    if repeated:
        raise ValueError(f"indices must be distinct (one row per input): {repeated[0]} is given "
                         f"{indices.count(repeated[0])} times")
    out_path = check_output_file("output file", out_path)
    settings = run_settings(task, settings, seed=seed, indices=indices, checkpoint=checkpoint,
                            checkpoint_format=checkpoint_format, input_normalization=input_normalization)
    if shard is not None:
        settings["shard"] = shard.record(indices)
        out_path, indices = shard.path(out_path), shard.select(indices)
    lock = _lock_sidecar(out_path)
    created, written = False, 0  # created: this call wrote the files and holds their lock
    try:
        done = _prepare_output(out_path, task, settings, resume, indices)
        if lock is None:  # a fresh run: its sidecar exists now
            lock = _lock_sidecar(out_path)
            created = True
        todo = [i for i in indices if i not in done]
        if stop_after is not None:
            todo = todo[:stop_after]
        if check_images:
            decode_images(dataset, todo, progress=progress)
        labels: dict[int, int] = {}
        classes = None if task.model is None else task.model.num_classes

        def pairs():
            for idx in todo:
                try:
                    item = dataset[idx]
                except OSError as err:  # e.g. a corrupt image file in a folder dataset
                    raise ValueError(f"dataset item {idx} cannot be read ({err}); repair or replace that file (removing "
                                     "it would renumber the items after it), then rerun with --resume: the rows before "
                                     "it are kept") from err
                x, label = dataset_pair(item, idx)
                x = torch.as_tensor(x)  # an array input (a NumPy dataset) as the tensor it holds
                labels[idx] = int(label) if classes is None else _checked_label(label, idx, classes)
                yield x, labels[idx]

        results = task.results(pairs(), [seed + idx for idx in todo])
        # Unbuffered: each row goes to the file in its own writes, and nothing is left in a buffer for close() to
        # fail on after a failed row (which would replace the message below with a bare errno).
        with out_path.open("ab", buffering=0) as fh, tqdm(total=len(todo), desc=task.kind, unit="img",
                                                          file=sys.stderr, disable=not progress) as bar:
            for idx, result in zip(todo, results):
                line = (task.row(idx, labels.pop(idx), result) + "\n").encode()
                try:
                    while line:  # a raw write may take part of it
                        line = line[fh.write(line):]
                except OSError as err:  # a full disk, a quota: name the file, and what is kept
                    raise OSError(err.errno, f"{out_path}: cannot write the row of input {idx} "
                                             f"({err.strerror or err}); the rows before it are kept: make room, then "
                                             "rerun with --resume") from err
                written += 1
                bar.update()
                if on_row is not None:
                    on_row(idx, result)
        if done:
            _put_in_selection_order(out_path, task.header, indices)
    except Exception:  # an error, not an interruption (whose message says how to --resume the file it leaves)
        if created and not written:  # nothing computed: no files left behind, so the corrected rerun starts afresh
            out_path.unlink(missing_ok=True)
            _sidecar(out_path).unlink(missing_ok=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)
    return out_path


def _checked_label(label: Any, idx: int, classes: int) -> int:
    """A dataset label as an int in ``[0, classes)``: a label outside would make every "correct" entry of the file
    silently wrong (e.g. an ImageFolder holding some of ImageNet's classes numbers them from 0)."""
    value = int(label)
    if not 0 <= value < classes:
        raise ValueError(f"dataset item {idx} has label {value}, outside the model's {classes} classes [0, {classes}); "
                         "use a dataset labelled as the model was trained (an ImageFolder numbers its own class "
                         "folders from 0 in sorted order: give it every class of the model, or remap its targets)")
    return value


__all__ = ["run_over_dataset", "run_settings", "finished_output", "select_indices"]
