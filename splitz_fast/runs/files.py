"""The files of a run: its TSV and the sidecar ``OUTFILE.json`` beside it — created, or checked and trimmed for a
resume (settings, rows, certificates or estimates), put back in the selection's order, and locked while a run writes
them (:func:`~splitz_fast.runs.loop.run_over_dataset` describes the whole). The lock is ``flock`` on the sidecar: it
goes with the process that holds it.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Sequence

from .._checks import read_settings_file
from ..kinds import certificate_status, results_are
from .schema import current_settings
from .tasks import RunTask

#: How the warning of a ``resume`` with nothing to resume begins; the command line says ``--resume: `` instead.
RESUME_NOTICE = "resume=True: "


def _sidecar(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".json")


def _split_rows(text: str, header: str, where: str) -> tuple[list[str], bool]:
    """The complete data rows of a TSV's text (header checked, each row's field count checked) and whether its last
    line is torn (no final newline: a row cut by an interruption)."""
    lines = text.split("\n")
    if lines[0] != header:
        found = "it is empty" if not text else f"its first line is {lines[0][:40]!r}"
        raise ValueError(f"{where}: {found}, not the header this run writes ({header[:40]!r}…); restore the file or "
                         "start a new OUTFILE")
    torn = not text.endswith("\n")
    n_fields = len(header.split("\t"))
    complete = []
    for number, line in enumerate(lines[1:-1] if torn else lines[1:], start=2):
        if line and len(line.split("\t")) != n_fields:
            shown = line if len(line) <= 40 else line[:40] + "…"
            raise ValueError(f"{where}: line {number} is not a row of {n_fields} fields ({shown!r}); restore the "
                             "file, or delete that line and rerun with --resume to recompute it")
        if line:
            complete.append(line)
    return complete, torn


def _rows_certificate(header: str, rows: Iterable[str], where: str) -> bool | None:
    """:func:`~splitz_fast.kinds.certificate_status` of TSV rows with a ``bound`` column (``None`` without
    one)."""
    columns = header.split("\t")
    if "bound" not in columns:
        return None
    column = columns.index("bound")
    return certificate_status((row.split("\t")[column] for row in rows), where)



def _settings_difference(previous: dict[str, Any], now: dict[str, Any], recorded_in: str) -> str:
    """Why a resume is refused: the settings both runs record with different values, else those only one of them
    records (another command or version wrote the file), with both values where they are short."""
    differ = sorted(k for k in set(previous) & set(now) if previous[k] != now[k])
    only = sorted(set(previous) ^ set(now))

    def shown(key: str) -> str:
        before = json.dumps(previous[key]) if key in previous else "not recorded"
        after = json.dumps(now[key]) if key in now else "not recorded"
        return f"{key} ({before} in {recorded_in}, {after} now)" if max(len(before), len(after)) <= 30 else key

    keys = differ or only  # values that differ first: they say most about what changed
    why = []
    if "checkpoint_digest" in differ:
        why.append("the checkpoint's contents are not those the run began with")
    if "noise_stream" in keys:
        why.append("the noise comes from another generator (SPLITZ_BACKEND=reference or missing C++ kernels give "
                   "torch's instead of the Philox kernels')")
    if not differ:
        why.append("another command or version wrote the file")
    return "; ".join([f"it was written with different settings: {'; '.join(map(shown, keys))}", *why,
                      "use the same arguments or a new OUTFILE"])


def _prepare_output(out_path: Path, task: RunTask, settings: dict[str, Any], resume: bool,
                    indices: Sequence[int]) -> set[int]:
    """Create the TSV and sidecar, or validate them for a resume (the sidecar read as the current schema,
    :func:`~splitz_fast.runs.schema.current_settings`; every row one of ``indices``, each once); returns the indices
    already written. ``resume`` on a file that does not exist starts it, with a :class:`UserWarning` that says so (job
    scripts pass ``--resume`` whether or not there is something to continue, but a mistyped OUTFILE should not go
    unnoticed)."""
    header = task.header
    sidecar = _sidecar(out_path)
    if out_path.exists() and not resume:
        raise FileExistsError(f"{out_path} exists; pass --resume to continue it, or choose another OUTFILE")
    if resume and not out_path.exists():
        warnings.warn(f"{RESUME_NOTICE}{out_path} does not exist yet; starting a new run", stacklevel=3)
    if not (resume and out_path.exists()):
        out_path.parent.mkdir(parents=True, exist_ok=True)
        sidecar.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        out_path.write_text(header + "\n")
        return set()
    try:
        recorded = read_settings_file(sidecar)
    except ValueError as err:
        raise ValueError(f"cannot resume {out_path}: its settings file {err}; restore it or start a new "
                         "OUTFILE") from None
    try:
        previous = current_settings(recorded, sidecar.name)
    except ValueError as err:
        raise ValueError(f"cannot resume {out_path}: {err}") from None
    complete, torn = _split_rows(out_path.read_text(), header, f"cannot resume {out_path}")
    written = _rows_certificate(header, complete, f"cannot resume {out_path}: it")
    if written is None:
        written = previous.get("certificate", True)
    if written != task.certificate:
        raise ValueError(f"cannot resume {out_path}: its rows are {results_are(written)} and this run computes "
                         f"{results_are(task.certificate)}; one file holds one protocol's rows, use a new OUTFILE")
    if previous != settings:
        raise ValueError(f"cannot resume {out_path}: {_settings_difference(previous, settings, sidecar.name)}")
    done = _written_indices(complete, set(indices), f"cannot resume {out_path}")
    if torn:  # a torn last row: cut it off (it is recomputed), in place: a kill or a full disk leaves every row
        data = out_path.read_bytes()
        if b"\n" in data:
            print(f"resume: the last line of {out_path} was cut by an interruption and is recomputed", file=sys.stderr)
            os.truncate(out_path, data.rfind(b"\n") + 1)
        else:  # the header itself, cut before its newline
            with out_path.open("ab") as fh:
                fh.write(b"\n")
    return done


def _written_indices(rows: Sequence[str], expected: set[int], where: str) -> set[int]:
    """The ``idx`` of each row, refusing a row this run does not select or one written twice: a file edited, or
    written by another run or by two runs at once, would otherwise resume into more rows than inputs."""
    done: set[int] = set()
    for line in rows:
        field = line.split("\t", 1)[0]
        idx = int(field) if field.isdigit() else None
        if idx not in expected:
            raise ValueError(f"{where}: it has a row for input {field}, which this run does not select (another run's "
                             "rows?); restore the file or start a new OUTFILE")
        if idx in done:
            raise ValueError(f"{where}: input {idx} has two rows (the file was edited or written by two runs at "
                             "once); restore the file or start a new OUTFILE")
        done.add(idx)
    return done



def _put_in_selection_order(out_path: Path, header: str, indices: Sequence[int]) -> None:
    """Rewrite a resumed TSV whose rows are not in the order of ``indices`` (a row removed from the middle was
    recomputed at the end), so that it equals an uninterrupted run's file; through a temporary file and a rename, so
    an interruption leaves the old file whole."""
    rows, _ = _split_rows(out_path.read_text(), header, str(out_path))
    position = {idx: k for k, idx in enumerate(indices)}
    ordered = sorted(rows, key=lambda line: position[int(line.split("\t", 1)[0])])
    if ordered == rows:
        return
    tmp = out_path.with_name(out_path.name + ".ordering")
    tmp.write_text("\n".join([header] + ordered) + "\n")
    os.replace(tmp, out_path)


class RunInProgressError(OSError):
    """Another process holds the run's output (see :func:`~splitz_fast.runs.loop.run_over_dataset`)."""


def _lock_sidecar(out_path: Path) -> int | None:
    """An exclusive lock on ``out_path``'s sidecar, as an open descriptor (``None`` where there is no sidecar yet),
    or :class:`RunInProgressError` at once if another process holds it. The lock goes with the process: a killed run
    leaves nothing to clean up."""
    try:
        fd = os.open(_sidecar(out_path), os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunInProgressError(f"another process is writing {out_path} (it holds {_sidecar(out_path).name}'s lock); "
                                 "wait for it to finish or stop it, then --resume") from None
    return fd



__all__ = ["RunInProgressError", "RESUME_NOTICE"]
