"""A run over a checkpoint's dataset as ``splitz certify`` / ``predict`` / ``certify-margin`` / ``attack`` make it:
the checkpoint's model and the dataset split checked against each other, the selected indices, and the choice
between the whole run, one ``--shard K/N`` and this torchrun rank's shard (rank 0 merges).

From Python, the same run as ``splitz certify mnist best.pt 0.5 out.tsv --N 10000 --shard 2/4``::

    import splitz_fast as sz

    run = sz.DatasetRun.open("mnist", "best.pt", "out.tsv", shard="2/4")   # loads the model, selects the images
    smoother = sz.Smoother(run.model, 0.5)
    run.run(sz.CertifyRun(smoother, 100, 10_000, 0.001), {"bound": smoother.bound,
            "bound_method": smoother.bound_method, "gamma_search": smoother.gamma_search})
    # -> out.tsv.shard-2-of-4; once every shard is done: sz.merge_shards("out.tsv", ...) or `splitz merge out.tsv`

Started under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set), :meth:`DatasetRun.open` takes no ``shard``: each rank
runs its own shard on its own device and rank 0 merges them into the OUTFILE (:mod:`splitz_fast.runs.torchrun`).
Messages name the ``splitz`` options (``--shard``, ``--resume``, ``OUTFILE``) that the arguments of the same names
stand for.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._checks import check_count, check_device, check_output_file
from ..checkpoints.splitz import load_model
from ..data.datasets import DatasetInfo
from ..model.modules import SplitModel
from .loop import finished_output, run_over_dataset, run_settings, select_indices
from .shards import ShardSpec
from .tasks import RunTask
from .torchrun import TorchrunEnv, run_sharded

#: The ``--split`` that selects the validation images a checkpoint's training run held out.
HELD_OUT_SPLIT = "heldout"


def _held_out_dataset(dataset: str, ckpt: dict, root: str | None):
    """The held-out validation part of the training split of the checkpoint's run (no augmentation)."""
    from ..data.datasets import evaluation_options, get_dataset
    from ..training.batches import held_out_part

    spec = ckpt.get("model_spec") or {}
    if spec.get("dataset") != dataset:
        raise ValueError(f"--split {HELD_OUT_SPLIT} reads the validation images held out when the checkpoint was "
                         f"trained, on {spec.get('dataset')!r}, not {dataset!r}")
    info = get_dataset(dataset, spec.get("split", "train"), root=root, **evaluation_options(dataset))
    return replace(info, dataset=held_out_part(info.dataset, ckpt),
                   description=f"{info.description}, the part held out for validation by the checkpoint's run")


def load_model_and_dataset(checkpoint: str | os.PathLike, dataset: str, split: str, *, device: str = "cpu",
                           root: str | None = None, checkpoint_format: str = "splitz",
                           sigma: float | None = None,
                           input_normalization: str | None = None) -> tuple[SplitModel, dict, DatasetInfo]:
    """The checkpoint's model and the dataset split, refused with a clear message when they do not fit together.

    ``(model, checkpoint dict, dataset info)``; ``split`` may be :data:`HELD_OUT_SPLIT`, the validation images the
    checkpoint's training run held out. ``sigma``, when given, is the σ the run smooths at: a note on stderr says so
    where the checkpoint was trained at another σ."""
    # Looked up at the call, as the commands always did (a test puts its own dataset in data.datasets.get_dataset).
    from ..data.datasets import class_names_of, get_dataset

    model, ckpt = load_model(checkpoint, device, format=checkpoint_format, input_normalization=input_normalization)
    if checkpoint_format in ("cohen", "macer"):
        from ..checkpoints.cohen import check_cohen_dataset

        check_cohen_dataset(ckpt, dataset)
        if split == HELD_OUT_SPLIT:
            raise ValueError(f"--split {HELD_OUT_SPLIT} reads the images a `splitz train` run held out; Cohen et al.'s "
                             "and MACER's checkpoints do not record theirs: choose a split of the dataset")
    if split == HELD_OUT_SPLIT:
        info = _held_out_dataset(dataset, ckpt, root)
    else:
        info = get_dataset(dataset, split, root=root)
    if model.input_shape != tuple(info.input_shape) or model.num_classes != info.num_classes:
        raise ValueError(f"checkpoint model takes {model.input_shape} with {model.num_classes} classes, but "
                         f"{dataset} has {tuple(info.input_shape)} with {info.num_classes} classes")
    trained_classes, classes = ckpt.get("class_names"), class_names_of(info.dataset)
    if trained_classes is not None and classes is not None and list(trained_classes) != classes:
        k = next((k for k, (a, b) in enumerate(zip(trained_classes, classes)) if a != b), None)
        which = (f"class {k} is {classes[k]!r}, but the checkpoint was trained with {trained_classes[k]!r} as class "
                 f"{k}" if k is not None else f"has {len(classes)} classes, the checkpoint's training set "
                 f"{len(trained_classes)}")
        raise ValueError(f"the {split} split's {which}: its labels would name other classes; give a folder with "
                         "the training run's class folders (the same names)")
    trained_sigma = (ckpt.get("config") or {}).get("sigma")
    if sigma is not None and trained_sigma is not None and trained_sigma != sigma:
        # Valid (the certificate is about the classifier smoothed at SIGMA), but usually a slip: say it once.
        print(f"note: SIGMA = {sigma:g}, but the checkpoint was trained with sigma = {trained_sigma:g}; the "
              f"results are for the model smoothed at {sigma:g}", file=sys.stderr)
    return model, ckpt, info


def _sharding(shard: str | ShardSpec | None, device: str | None, outfile: str | os.PathLike, resume: bool):
    """``(torchrun ranks or None, ShardSpec or None, device)`` of a run: the device is the one this process uses
    (under torchrun: its local rank's GPU, see :meth:`TorchrunEnv.device`)."""
    env = TorchrunEnv.from_environ()
    shard = None if shard is None else shard if isinstance(shard, ShardSpec) else ShardSpec.parse(shard)
    if env is None:
        return None, shard, check_device("--device", device or "cpu")
    if shard is not None:
        raise ValueError(f"--shard splits a run into separate jobs; under torchrun (WORLD_SIZE={env.world_size}) the "
                         "ranks already are the shards: drop --shard, or run each shard without torchrun")
    device = check_device("--device", env.device(device))
    if Path(outfile).exists() and not resume:
        raise FileExistsError(f"{outfile} exists; pass --resume to continue it, or choose another OUTFILE")
    return env, None, device


@dataclass
class DatasetRun:
    """What every dataset command (certify, predict, certify-margin, attack) shares once its arguments are checked:
    the model and data, the selected indices, torchrun ranks or a ``--shard``, and the settings every sidecar
    records (dataset, split, selection, model). Made by :meth:`open`; :meth:`run` runs a task over it."""

    model: SplitModel
    info: DatasetInfo
    indices: list[int]
    outfile: str | os.PathLike
    checkpoint: str | os.PathLike
    #: The device this process runs on (under torchrun: its local rank's, :meth:`TorchrunEnv.device`).
    device: str
    seed: int = 0
    resume: bool = False
    checkpoint_format: str = "splitz"
    env: TorchrunEnv | None = None
    shard: ShardSpec | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: Decode each image file the run reads before the first row (:func:`~splitz_fast.data.images.check_images`).
    check_images: bool = True

    @classmethod
    def open(cls, dataset: str, checkpoint: str | os.PathLike, outfile: str | os.PathLike, *, split: str = "test",
             root: str | None = None, skip: int = 1, max_count: int = -1, seed: int = 0, resume: bool = False,
             device: str | None = None, shard: str | ShardSpec | None = None, checkpoint_format: str = "splitz",
             sigma: float | None = None, input_normalization: str | None = None) -> "DatasetRun":
        """The run of ``checkpoint``'s model over every ``skip``-th input of ``dataset``'s ``split`` (at most
        ``max_count``, -1 = all) into ``outfile``: input ``i`` draws its noise from seed ``seed + i``; ``resume``
        continues an interrupted ``outfile``. ``shard`` (``"K/N"`` or a :class:`~splitz_fast.runs.shards.ShardSpec`)
        runs only that shard into ``outfile.shard-K-of-N``; under torchrun the ranks are the shards and ``shard``
        is refused. ``device``: unset, the CPU (under torchrun: each rank's ``cuda:LOCAL_RANK`` where CUDA is
        available). ``sigma``: the σ the run smooths at, for the note of :func:`load_model_and_dataset`.
        ``input_normalization``: a MACER checkpoint's (``checkpoint_format="macer"``), recorded in the sidecar."""
        check_count("--seed", seed, 0)
        check_output_file("OUTFILE", outfile)
        env, shard, device = _sharding(shard, device, outfile, resume)
        model, ckpt, info = load_model_and_dataset(checkpoint, dataset, split, device=device, root=root,
                                                   checkpoint_format=checkpoint_format, sigma=sigma,
                                                   input_normalization=input_normalization)
        indices = select_indices(len(info.dataset), skip, max_count)
        settings = {"dataset": dataset, "split": split, "skip": skip, "max": max_count,
                    "model_spec": ckpt.get("model_spec")}
        if checkpoint_format == "macer":
            settings["input_normalization"] = ckpt["model_spec"]["input_normalization"]
        return cls(model, info, indices, outfile, checkpoint, device, seed, resume, checkpoint_format, env, shard,
                   settings)

    def run(self, task: RunTask, settings: dict[str, Any] | None = None) -> Path | None:
        """``task`` (:mod:`splitz_fast.runs.tasks`) over the selection: whole, one ``--shard K/N``, or this torchrun
        rank's shard followed by rank 0's merge; ``settings`` (what else determines the rows: the bound options,
        ...) join the run's in the sidecar. Prints one line of what was written; returns the file: ``outfile``, the
        shard's file, or under torchrun ``outfile`` on rank 0 and ``None`` on the other ranks."""
        indices, outfile = self.indices, self.outfile
        settings = {**self.settings, **(settings or {})}
        computed = []  # the rows this call writes (a resume writes only those the file lacks)

        def run(shard_spec, progress):
            return run_over_dataset(task, self.info.dataset, outfile, settings=settings, indices=indices,
                                    seed=self.seed, resume=self.resume, checkpoint=self.checkpoint, shard=shard_spec,
                                    progress=progress, checkpoint_format=self.checkpoint_format,
                                    check_images=self.check_images,
                                    input_normalization=self.settings.get("input_normalization"),
                                    on_row=lambda idx, _: computed.append(idx))

        what = "inputs" if task.kind == "certify-margin" else "images"

        def counted(total: int) -> str:
            """``total`` rows of the file, and how many of them this call computed where that is fewer."""
            return (f"{total} {what}" if len(computed) == total else
                    f"{len(computed)} {what} computed now, {total} in the file")

        if self.env is not None:
            env = self.env
            # Every rank reads the merged OUTFILE first: without --resume it is refused before any shard starts, and
            # with --resume a finished one (same settings, every row) leaves nothing to do.
            whole = run_settings(task, settings, seed=self.seed, indices=indices, checkpoint=self.checkpoint,
                                 checkpoint_format=self.checkpoint_format,
                                 input_normalization=self.settings.get("input_normalization"))
            if finished_output(task, outfile, whole, indices, self.resume):
                if env.rank == 0:
                    print(f"{task.kind}: {outfile} already holds all {len(indices)} {what}; nothing to do")
                return Path(outfile) if env.rank == 0 else None
            merged = run_sharded(env, self.device, outfile, lambda spec: run(spec, env.rank == 0))
            if merged is not None:
                ranks = f"{env.world_size} rank{'s' * (env.world_size > 1)}"
                print(f"{task.kind}: {len(indices)} {what} on {ranks} → {merged} (merged from "
                      f"{Path(outfile).name}.shard-*-of-{env.world_size})")
            return merged
        if self.shard is not None:
            path = run(self.shard, True)
            mine = len(self.shard.select(indices))
            rows = (f"{mine} of {len(indices)} {what}" if len(computed) == mine else
                    f"{counted(mine)} (of {len(indices)})")
            print(f"{task.kind}: shard {self.shard}, {rows} → "
                  f"{path}; when all {self.shard.count} shards are done: splitz merge {shlex.quote(str(outfile))}")
            return path
        path = run(None, True)
        print(f"{task.kind}: {counted(len(indices))} → {outfile}")
        return path


__all__ = ["DatasetRun", "load_model_and_dataset", "HELD_OUT_SPLIT"]
