"""Certify or predict over a dataset into a Cohen-format TSV, resumable without losing or duplicating rows.

Each row is flushed as soon as it is computed. Image ``i`` is certified with seed ``seed + i``, so a row depends only
on the image, the model and the seed: a resumed run writes exactly the rows an uninterrupted one would. The run's
settings go to a sidecar ``OUTFILE.json``; ``resume`` refuses a file written with other settings (or another
checkpoint, compared by :func:`~splitz_fast.training.checkpoint_digest`: weights and training settings, not file
bytes, so a bit-identical retrained checkpoint is accepted), drops a torn last line, and skips the indices already
present.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset
from tqdm import tqdm

from ._checks import check_certify_counts, check_count, check_output_file
from .results import HEADER as CERTIFY_HEADER
from .results import format_row
from .smoothing import Smoother
from .training import CHECKPOINT_DIGEST_COVERS, checkpoint_digest, load_checkpoint_file

PREDICT_HEADER = "\t".join(("idx", "label", "predict", "correct", "time", "count_top", "count_second", "p_value"))


def select_indices(n_items: int, skip: int, max_count: int) -> list[int]:
    """Cohen's ``--skip``/``--max``: every ``skip``-th index, at most ``max_count`` of them (``-1`` = all)."""
    if skip < 1:
        raise ValueError(f"--skip must be >= 1, got {skip}")
    if max_count == 0 or max_count < -1:
        raise ValueError(f"--max must be -1 (all) or >= 1, got {max_count}")
    indices = list(range(0, n_items, skip))
    return indices if max_count == -1 else indices[:max_count]


def _prepare_output(out_path: Path, header: str, settings: dict[str, Any], resume: bool) -> set[int]:
    """Create the TSV and sidecar, or validate them for a resume; returns the indices already written."""
    sidecar = out_path.with_name(out_path.name + ".json")
    if out_path.exists() and not resume:
        raise FileExistsError(f"{out_path} exists; pass --resume to continue it, or choose another OUTFILE")
    if not (resume and out_path.exists()):
        out_path.parent.mkdir(parents=True, exist_ok=True)
        sidecar.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        out_path.write_text(header + "\n")
        return set()
    if not sidecar.exists():
        raise ValueError(f"cannot resume {out_path}: its settings file {sidecar} is missing")
    previous = json.loads(sidecar.read_text())
    if previous != settings:
        changed = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
        raise ValueError(f"cannot resume {out_path}: it was written with different settings ({', '.join(changed)}); "
                         "use the same arguments or a new OUTFILE")
    text = out_path.read_text()
    lines = text.split("\n")
    if not lines or lines[0] != header:
        raise ValueError(f"cannot resume {out_path}: its header is not the expected one")
    complete = lines[1:-1] if not text.endswith("\n") else lines[1:]
    complete = [line for line in complete if line]
    n_fields = len(header.split("\t"))
    done = set()
    for line in complete:
        fields = line.split("\t")
        if len(fields) != n_fields:
            raise ValueError(f"cannot resume {out_path}: malformed row {line!r}")
        done.add(int(fields[0]))
    if not text.endswith("\n"):  # a torn last row: drop it, it is recomputed
        with out_path.open("w") as fh:
            fh.write("\n".join([header] + complete) + "\n")
    return done


def run_over_dataset(
    kind: str,
    smoother: Smoother,
    dataset: Dataset,
    out_path: str | os.PathLike,
    *,
    settings: dict[str, Any],
    indices: list[int],
    n0: int,
    n: int,
    alpha: float,
    batch_size: int | None,
    seed: int,
    resume: bool = False,
    checkpoint: str | os.PathLike | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    on_row: Callable[[int, Any], None] | None = None,
) -> Path:
    """CERTIFY (``kind="certify"``) or PREDICT (``kind="predict"``) every selected dataset index into ``out_path``.

    ``settings`` (everything that determines the rows) is stored in the sidecar together with the checkpoint's
    digest (``checkpoint_digest``, described by ``checkpoint_digest_covers``); ``stop_after`` stops after that many
    new rows (as an interruption would). The inputs stream through ``smoother.certify_many`` / ``predict_many``
    (shared ``f_R`` batches, one host sync per group of inputs); each row is written as soon as its input is done.
    ``batch_size`` (``None``: measured) does not change the rows — the noise of an input depends only on its seed —
    so it is not part of the settings a resume must match.
    """
    if kind not in ("certify", "predict"):
        raise ValueError(f"kind must be 'certify' or 'predict', got {kind!r}")
    # Check every argument before the output file is created, so a typo leaves nothing behind.
    check_certify_counts(n0 if kind == "certify" else None, n, alpha, batch_size)
    check_count("seed", seed, 0)
    if any(not 0 <= i < len(dataset) for i in indices):
        raise ValueError(f"indices must lie in [0, {len(dataset)})")
    out_path = check_output_file("output file", out_path)
    settings = dict(settings, kind=kind, n0=n0, n=n, alpha=alpha, seed=seed,
                    sigma=getattr(smoother, "sigma", None), indices=[indices[0], indices[-1], len(indices)] if indices else [])
    if checkpoint is not None:
        settings["checkpoint_digest"] = checkpoint_digest(load_checkpoint_file(checkpoint))
        settings["checkpoint_digest_covers"] = CHECKPOINT_DIGEST_COVERS
    header = CERTIFY_HEADER if kind == "certify" else PREDICT_HEADER
    done = _prepare_output(out_path, header, settings, resume)
    todo = [i for i in indices if i not in done]
    if stop_after is not None:
        todo = todo[:stop_after]
    labels: dict[int, int] = {}

    def inputs():
        for idx in todo:
            x, label = dataset[idx]
            labels[idx] = int(label)
            yield x

    seeds = [seed + idx for idx in todo]
    if kind == "certify":
        results = smoother.certify_many(inputs(), n0, n, alpha, batch_size=batch_size, seeds=seeds)
    else:
        results = smoother.predict_many(inputs(), n, alpha, batch_size=batch_size, seeds=seeds)
    with out_path.open("a") as fh, tqdm(total=len(todo), desc=kind, unit="img", file=sys.stderr,
                                        disable=not progress) as bar:
        for idx, result in zip(todo, results):
            label = labels.pop(idx)
            if kind == "certify":
                line = format_row(idx, label, result)
            else:
                line = "\t".join([str(idx), str(label), str(result.prediction), str(int(result.prediction == label)),
                                  f"{result.seconds:.4f}", str(result.count_top), str(result.count_second),
                                  f"{result.p_value:.6g}"])
            fh.write(line + "\n")
            fh.flush()
            bar.update()
            if on_row is not None:
                on_row(idx, result)
    return out_path


__all__ = ["run_over_dataset", "select_indices", "PREDICT_HEADER"]
