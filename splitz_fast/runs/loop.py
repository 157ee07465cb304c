"""Certify or predict over a dataset into a Cohen-format TSV, resumable without losing or duplicating rows.

Each row is flushed as soon as it is computed. Image ``i`` is certified with seed ``seed + i``, so a row depends only
on the image, the model and the seed: a resumed run writes exactly the rows an uninterrupted one would. The run's
settings go to a sidecar ``OUTFILE.json``; ``resume`` refuses a file written with other settings (or another
checkpoint, compared by :func:`~splitz_fast.checkpoints.splitz.checkpoint_digest`: weights and training settings, not file
bytes, so a bit-identical retrained checkpoint is accepted) or rows of inputs it does not select (or one input's
twice), drops a torn last line, skips the indices already present, and leaves the rows in the selection's order.
While a run writes its TSV it holds an exclusive lock on the sidecar (``flock``): a second process started on the
same file (a resume while an orphaned worker still writes) is refused instead of interleaving its rows.

Sharding (:class:`ShardSpec`): shard ``K`` of ``N`` takes the strided slice ``indices[K::N]`` and writes
``OUTFILE.shard-K-of-N`` with its own sidecar, through the same writer, so each shard resumes like a whole run.
:func:`merge_shards` joins complete shards of one run into ``OUTFILE`` sorted by ``idx``: with per-input seeds
``seed + idx`` the result equals a single-process run row for row (all columns but ``time``), and its sidecar is the
one that run would have written. ``splitz certify --shard K/N`` / ``splitz merge`` and torchrun ranks
(:mod:`splitz_fast.runs.torchrun`) both go through these two functions.
"""
from __future__ import annotations

import abc
import fcntl
import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from .._checks import check_certify_counts, check_count, check_output_file, dataset_pair, read_settings_file
from ..certify.protocols import certificate_status
from ..certify.attacks import ATTACK_HEADER, Attacker
from ..checkpoints.splitz import CHECKPOINT_DIGEST_COVERS, checkpoint_digest, load_checkpoint_file
from ..certify.margin import MarginCertifier
from ..model.modules import SplitModel
from .rows import HEADER as CERTIFY_HEADER
from .rows import format_row
from ..certify.inputs import model_device
from ..sampling.engine import PHILOX_STREAM, NoiseStream
from ..certify.sequential import SequentialCertifier
from ..certify.smoothing import PredictResult, Smoother

PREDICT_HEADER = "\t".join(("idx", "label", "predict", "correct", "time", "count_top", "count_second", "p_value"))


# ------------------------------------------------------------------------------------------------------ run tasks
class RunTask(abc.ABC):
    """One kind of run over a dataset: its TSV header, the settings its sidecar records, how it computes results for
    labelled inputs and their seeds, and how a result becomes a row. :func:`run_over_dataset` (resume, sharding,
    progress, interruption) and :func:`merge_shards` know nothing else about it. Constructing a task validates its
    arguments (once)."""

    kind: str  # recorded in the sidecar; names the header when shards are merged (HEADERS)
    header: str
    #: Whether the task's radii are certificates; False for an estimate protocol's (``certificate: false`` in the
    #: sidecar). A file never mixes the two: resume and merge refuse it (:func:`~splitz_fast.certify.protocols.certificate_status`).
    certificate: bool = True

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """What determines the rows besides the model, the data, the indices and the seed (the sidecar's entries)."""

    @abc.abstractmethod
    def results(self, pairs: Iterable[tuple[torch.Tensor, int]], seeds: list[int]) -> Iterator[Any]:
        """One result per ``(input, label)`` pair, in order, input ``i`` drawing its noise from ``seeds[i]``."""

    @abc.abstractmethod
    def row(self, idx: int, label: int, result: Any) -> str:
        """The TSV line of one result (no newline)."""

    #: Whether the rows depend on noise drawn from the inputs' seeds (:class:`~splitz_fast.sampling.engine.NoiseStream`).
    draws_noise = True

    @property
    def model(self) -> SplitModel | None:
        """The model the task runs: its ``num_classes`` bounds the labels a dataset may give (``None``: labels
        unchecked)."""
        return None

    def earlier_settings(self, previous: dict[str, Any]) -> dict[str, Any]:
        """A sidecar found on resume, read as this version of the task records it (a task whose recorded settings
        changed names or placeholders maps them here, so its earlier runs stay resumable); unchanged by default."""
        return previous


def _precision_setting(smoother: Smoother) -> dict[str, Any]:
    """``{"precision": ...}`` where ``f_R`` samples in another precision than float32 (another base classifier); empty
    for float32, so files written before this entry still resume."""
    precision = getattr(smoother, "precision", "float32")
    return {} if precision == "float32" else {"precision": precision}


def _inputs(pairs: Iterable[tuple[torch.Tensor, int]]) -> Iterator[torch.Tensor]:
    return (x for x, _ in pairs)


class CertifyRun(RunTask):
    """Cohen's CERTIFY with the SPLITZ radius (``splitz certify``): a :class:`~splitz_fast.certify.smoothing.Smoother` or a
    :class:`~splitz_fast.certify.sequential.SequentialCertifier` (``n`` is then its budget)."""

    kind, header = "certify", CERTIFY_HEADER

    def __init__(self, certifier: Smoother | SequentialCertifier, n0: int, n: int, alpha: float,
                 batch_size: int | None = None):
        n0, n, alpha, batch_size = check_certify_counts(n0, n, alpha, batch_size)
        self.certifier, self.n0, self.n, self.alpha, self.batch_size = certifier, n0, n, alpha, batch_size
        self.certificate = certifier.protocol.certificate

    @property
    def model(self) -> SplitModel:
        return self.certifier.model

    def settings(self) -> dict[str, Any]:
        settings = {"kind": self.kind, "n0": self.n0, "n": self.n, "alpha": self.alpha, "sigma": self.certifier.sigma}
        protocol = self.certifier.protocol
        if protocol.name != "sound":  # recorded only when set, so sound files written before still resume
            settings["protocol"] = protocol.name
        factor = getattr(protocol, "lipschitz_factor", 1.0)
        if factor != 1.0:  # published-code's normalisation constant; recorded only when set (older files resume)
            settings["lipschitz_factor"] = factor
        if not protocol.certificate:
            settings["certificate"] = False
        return {**settings, **_precision_setting(getattr(self.certifier, "smoother", self.certifier))}

    def results(self, pairs, seeds):
        return self.certifier.certify_many(_inputs(pairs), self.n0, self.n, self.alpha, batch_size=self.batch_size,
                                           seeds=seeds)

    def row(self, idx, label, result):
        return format_row(idx, label, result)


class PredictRun(RunTask):
    """Cohen's PREDICT (``splitz predict``)."""

    kind, header = "predict", PREDICT_HEADER

    def __init__(self, smoother: Smoother, n: int, alpha: float, batch_size: int | None = None):
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        self.smoother, self.n, self.alpha, self.batch_size = smoother, n, alpha, batch_size

    @property
    def model(self) -> SplitModel:
        return self.smoother.model

    def settings(self) -> dict[str, Any]:
        # n0 = 0: PREDICT draws no selection samples (recorded so that sidecars written before stay resumable).
        return {"kind": self.kind, "n0": 0, "n": self.n, "alpha": self.alpha, "sigma": self.smoother.sigma,
                **_precision_setting(self.smoother)}

    def results(self, pairs, seeds):
        return self.smoother.predict_many(_inputs(pairs), self.n, self.alpha, batch_size=self.batch_size,
                                          seeds=seeds)

    def row(self, idx, label, result: PredictResult):
        return "\t".join([str(idx), str(label), str(result.prediction), str(int(result.prediction == label)),
                          f"{result.seconds:.4f}", str(result.count_top), str(result.count_second),
                          f"{result.p_value:.6g}"])


class MarginRun(RunTask):
    """Deterministic logit-margin certificates (``splitz certify-margin``): nothing is sampled, so there are no
    sampling settings; the rows are CERTIFY's."""

    kind, header = "certify-margin", CERTIFY_HEADER
    draws_noise = False

    def __init__(self, certifier: MarginCertifier):
        self.certifier = certifier

    @property
    def model(self) -> SplitModel:
        return self.certifier.model

    def settings(self) -> dict[str, Any]:
        return {"kind": self.kind}

    #: How margin runs were recorded before the run tasks (up to a9ddd72): as CERTIFY runs with placeholder sampling
    #: settings. Their rows are those of today's margin runs.
    _EARLIER_PLACEHOLDERS = {"kind": "certify", "n0": 1, "n": 1, "alpha": 0.5, "sigma": None}

    def earlier_settings(self, previous):
        missing = object()
        if previous.get("certifier") == "margin" and all(
                previous.get(key, missing) == value for key, value in self._EARLIER_PLACEHOLDERS.items()):
            kept = {key: value for key, value in previous.items() if key not in self._EARLIER_PLACEHOLDERS}
            return {**kept, "kind": self.kind}
        return previous

    def results(self, pairs, seeds):
        return self.certifier.certify_many(_inputs(pairs), seeds=seeds)

    def row(self, idx, label, result):
        return format_row(idx, label, result)


class AttackRun(RunTask):
    """l2 attacks with PREDICT at the clean and the attacked point (``splitz attack``)."""

    kind, header = "attack", ATTACK_HEADER

    def __init__(self, attacker: Attacker, n: int, alpha: float, batch_size: int | None = None):
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        self.attacker, self.n, self.alpha, self.batch_size = attacker, n, alpha, batch_size

    @property
    def model(self) -> SplitModel:
        return self.attacker.model

    def settings(self) -> dict[str, Any]:
        # n0 = 0 as for PREDICT (sidecars written before stay resumable); the attack's own settings come from the caller.
        return {"kind": self.kind, "n0": 0, "n": self.n, "alpha": self.alpha, "sigma": self.attacker.sigma,
                **_precision_setting(self.attacker.smoother)}

    def results(self, pairs, seeds):
        return self.attacker.attack_many(pairs, self.n, self.alpha, batch_size=self.batch_size, seeds=seeds)

    def row(self, idx, label, result):
        return result.row(idx)


#: The header of each task kind, by the ``kind`` its sidecars record (what merge_shards reads).
HEADERS = {task.kind: task.header for task in (CertifyRun, PredictRun, MarginRun, AttackRun)}


def select_indices(n_items: int, skip: int, max_count: int) -> list[int]:
    """``--skip``/``--max``: every ``skip``-th index, at most ``max_count`` of them (``-1`` = all). Cohen's scripts stop
    at dataset index ``max`` instead (their help text says "this many examples"); docs/cli.md gives the translation."""
    if skip < 1:
        raise ValueError(f"--skip must be >= 1, got {skip}")
    if max_count == 0 or max_count < -1:
        raise ValueError(f"--max must be -1 (all) or >= 1, got {max_count}")
    indices = list(range(0, n_items, skip))
    return indices if max_count == -1 else indices[:max_count]


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
    complete = [line for line in (lines[1:-1] if torn else lines[1:]) if line]
    n_fields = len(header.split("\t"))
    for line in complete:
        if len(line.split("\t")) != n_fields:
            raise ValueError(f"{where}: malformed row {line!r}")
    return complete, torn


def _rows_certificate(header: str, rows: Iterable[str], where: str) -> bool | None:
    """:func:`~splitz_fast.certify.protocols.certificate_status` of TSV rows with a ``bound`` column (``None`` without one)."""
    columns = header.split("\t")
    if "bound" not in columns:
        return None
    column = columns.index("bound")
    return certificate_status((row.split("\t")[column] for row in rows), where)


def _results_are(certificate: bool) -> str:
    return "certificates" if certificate else "estimates (not certificates)"


def _changed_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _settings_difference(previous: dict[str, Any], now: dict[str, Any], recorded_in: str) -> str:
    """Why a resume is refused: the settings both runs record with different values, else those only one of them
    records (optional settings are recorded only when not at their default; otherwise another command or version
    wrote the file), with both values where they are short."""
    differ = sorted(k for k in set(previous) & set(now) if previous[k] != now[k])
    only = sorted(set(previous) ^ set(now))

    def shown(key: str) -> str:
        before = json.dumps(previous[key]) if key in previous else "not recorded"
        after = json.dumps(now[key]) if key in now else "not recorded"
        return f"{key} ({before} in {recorded_in}, {after} now)" if max(len(before), len(after)) <= 30 else key

    keys = differ or only  # values that differ first: settings one file lacks are often just at their default
    why = []
    if "checkpoint_digest" in differ:
        why.append("the checkpoint's contents are not those the run began with")
    if "noise_stream" in keys:
        why.append("the noise comes from another generator (the Philox kernels record no noise_stream; "
                   "SPLITZ_BACKEND=reference or missing C++ kernels give torch's)")
    if not differ:
        why.append("a setting that is not recorded was at its default, or another command or version wrote the file")
    return "; ".join([f"it was written with different settings: {'; '.join(map(shown, keys))}", *why,
                      "use the same arguments or a new OUTFILE"])


def _prepare_output(out_path: Path, task: RunTask, settings: dict[str, Any], resume: bool,
                    indices: Sequence[int]) -> set[int]:
    """Create the TSV and sidecar, or validate them for a resume (the sidecar read through
    :meth:`RunTask.earlier_settings`; every row one of ``indices``, each once); returns the indices already written."""
    header = task.header
    sidecar = _sidecar(out_path)
    if out_path.exists() and not resume:
        raise FileExistsError(f"{out_path} exists; pass --resume to continue it, or choose another OUTFILE")
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
    previous = task.earlier_settings(recorded)
    complete, torn = _split_rows(out_path.read_text(), header, f"cannot resume {out_path}")
    written = _rows_certificate(header, complete, f"cannot resume {out_path}: it")
    if written is None:
        written = previous.get("certificate", True)
    if written != task.certificate:
        raise ValueError(f"cannot resume {out_path}: its rows are {_results_are(written)} and this run computes "
                         f"{_results_are(task.certificate)}; one file holds one protocol's rows, use a new OUTFILE")
    if previous != settings:
        raise ValueError(f"cannot resume {out_path}: {_settings_difference(previous, settings, sidecar.name)}")
    done = _written_indices(complete, set(indices), f"cannot resume {out_path}")
    if torn:  # a torn last row: cut it off (it is recomputed), in place: a kill or a full disk leaves every row
        data = out_path.read_bytes()
        if b"\n" in data:
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


def _indices_digest(indices: Sequence[int]) -> str:
    """SHA-256 of a set of dataset indices (order-free), so a sidecar can say exactly which rows complete a shard."""
    return hashlib.sha256(",".join(map(str, sorted(indices))).encode()).hexdigest()


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` of ``count`` (0-based, ``0 <= index < count``) of a run's selected indices: the strided slice
    ``indices[index::count]`` (balanced to one row, and an ``idx``-sorted selection spreads cheap and expensive
    inputs evenly). Written to ``OUTFILE.shard-K-of-N`` with a sidecar that records the whole run's settings plus
    ``shard``: ``index``, ``count``, the shard's ``rows`` and ``indices_sha256`` (what :func:`merge_shards` checks)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or isinstance(self.count, bool) or not (
                isinstance(self.index, int) and isinstance(self.count, int)) or not 0 <= self.index < self.count:
            raise ValueError(f"a shard is K/N with integers 0 <= K < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> "ShardSpec":
        """``"K/N"`` (``--shard``), e.g. ``"$SLURM_ARRAY_TASK_ID/8"`` for an array ``--array=0-7``."""
        k, sep, n = str(text).partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(k), int(n))
        except ValueError:
            raise ValueError(f"--shard must be K/N with integers 0 <= K < N (e.g. 0/4 .. 3/4), got {text!r}") from None

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def select(self, indices: Sequence[int]) -> list[int]:
        return list(indices[self.index::self.count])

    def path(self, out_path: str | os.PathLike) -> Path:
        out_path = Path(out_path)
        return out_path.with_name(f"{out_path.name}.shard-{self.index}-of-{self.count}")

    def record(self, indices: Sequence[int]) -> dict[str, Any]:
        """The sidecar's ``shard`` entry for this shard of the run's ``indices``."""
        mine = self.select(indices)
        return {"index": self.index, "count": self.count, "rows": len(mine), "indices_sha256": _indices_digest(mine)}


@dataclass(frozen=True)
class ShardData:
    """One shard as :func:`merge_shards` reads it: its sidecar's settings and its TSV text (from a file, or sent by a
    torchrun rank); ``where`` names it in messages."""

    where: str
    settings: dict[str, Any]
    text: str

    @classmethod
    def read(cls, path: str | os.PathLike, where: str | None = None) -> "ShardData":
        path = Path(path)
        where = where or str(path)
        sidecar = _sidecar(path)
        if not path.is_file():
            raise ValueError(f"cannot merge: shard file {where} does not exist")
        if not sidecar.is_file():
            raise ValueError(f"cannot merge: {where} has no settings file {sidecar}")
        try:
            settings = read_settings_file(sidecar)
        except ValueError as err:
            raise ValueError(f"cannot merge: {err}") from None
        return cls(where, settings, path.read_text())


def shard_files(out_path: str | os.PathLike) -> list[Path]:
    """The shard files ``OUTFILE.shard-K-of-N`` beside ``out_path`` (their sidecars excluded), sorted by name."""
    out_path = Path(out_path)
    return sorted(p for p in out_path.parent.glob(f"{out_path.name}.shard-*-of-*") if p.suffix != ".json")


def merge_shards(out_path: str | os.PathLike, shards: Sequence[ShardData]) -> Path:
    """Join the shards of one run into ``out_path`` (rows sorted by ``idx``) and its sidecar (the run's settings,
    as a single-process run writes them), written to temporary names first and then renamed into place.

    Refused, with what to do: no shards; a file that is no shard; shards with different settings or checkpoints
    (``checkpoint_digest``, SHA-256 of weights and training settings); different shard counts; a shard given twice or
    missing; a shard that is incomplete (fewer rows than its sidecar records, a torn last row) or holds other indices;
    an existing ``out_path`` written with other settings (one with the same settings, e.g. a previous merge, is
    replaced)."""
    out_path = Path(out_path)
    if not shards:
        raise ValueError(f"cannot merge into {out_path}: no shard files given or found ({out_path.name}.shard-K-of-N)")
    for shard in shards:
        record = shard.settings.get("shard")
        if not isinstance(record, dict) or not {"index", "count", "rows", "indices_sha256"} <= set(record):
            raise ValueError(f"cannot merge: {shard.where} is not a shard (its sidecar records no shard; it was not "
                             "written with --shard or under torchrun)")
    settings = {k: v for k, v in shards[0].settings.items() if k != "shard"}
    for shard in shards[1:]:
        changed = _changed_keys({k: v for k, v in shard.settings.items() if k != "shard"}, settings)
        if changed:
            what = "another checkpoint" if "checkpoint_digest" in changed else "different settings"
            raise ValueError(f"cannot merge: {shard.where} was written with {what} than {shards[0].where} "
                             f"({', '.join(changed)}); only shards of one run can be merged")
    counts = sorted({shard.settings["shard"]["count"] for shard in shards})
    if len(counts) > 1:
        raise ValueError(f"cannot merge: the shards split the run differently (into {' and '.join(map(str, counts))} "
                         "shards); give the shard files of one split explicitly")
    count = counts[0]
    by_index: dict[int, ShardData] = {}
    for shard in shards:
        k = shard.settings["shard"]["index"]
        if k in by_index:
            raise ValueError(f"cannot merge: shard {k}/{count} given twice ({by_index[k].where}, {shard.where})")
        by_index[k] = shard
    missing = [f"{k}/{count}" for k in range(count) if k not in by_index]
    if missing:
        raise ValueError(f"cannot merge: shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing; run "
                         f"{'them' if len(missing) > 1 else 'it'} (--shard K/N), then merge all {count}")
    kind = settings.get("kind")
    if kind not in HEADERS:
        raise ValueError(f"cannot merge: {shards[0].where} records no run kind ({', '.join(HEADERS)})")
    header = HEADERS[kind]
    rows: list[tuple[int, str]] = []
    for k in range(count):
        shard, record = by_index[k], by_index[k].settings["shard"]
        complete, torn = _split_rows(shard.text, header, f"cannot merge {shard.where}")
        indices = [int(line.split("\t", 1)[0]) for line in complete]
        if torn or len(indices) < record["rows"]:
            raise ValueError(f"cannot merge: shard {k}/{count} ({shard.where}) is incomplete, {len(indices)} of "
                             f"{record['rows']} rows; finish it (the same command with --resume), then merge")
        if len(set(indices)) != len(indices) or _indices_digest(indices) != record["indices_sha256"]:
            raise ValueError(f"cannot merge: shard {k}/{count} ({shard.where}) holds rows of other indices than its "
                             "sidecar records (duplicated or foreign rows); recompute that shard")
        rows.extend(zip(indices, complete))
    rows.sort(key=lambda row: row[0])
    if _rows_certificate(header, (line for _, line in rows), "cannot merge: the shards' rows") is False:
        settings["certificate"] = False  # estimate rows are labelled so whatever wrote the shards
    sidecar = _sidecar(out_path)
    if out_path.exists() or sidecar.exists():
        try:
            why = "settings differ" if read_settings_file(sidecar) != settings else None
        except ValueError as err:
            why = f"its settings file {err}"
        if why is not None:
            raise FileExistsError(f"{out_path} exists and was not written by this run ({why}); remove it or choose "
                                  "another OUTFILE")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((sidecar, json.dumps(settings, indent=2, sort_keys=True) + "\n"),
                       (out_path, "\n".join([header] + [line for _, line in rows]) + "\n")):
        tmp = path.with_name(path.name + ".merging")
        tmp.write_text(text)
        os.replace(tmp, path)
    return out_path


def run_settings(task: RunTask, settings: dict[str, Any], *, seed: int, indices: Sequence[int],
                 checkpoint: str | os.PathLike | None = None, checkpoint_format: str = "splitz") -> dict[str, Any]:
    """What :func:`run_over_dataset` records in the sidecar of a whole run's TSV (a shard's adds its ``shard``):
    ``settings``, the task's own settings, the seed, the indices and the checkpoint's digest."""
    check_count("seed", seed, 0)
    settings = dict(settings, **task.settings(), seed=seed,
                    indices=[indices[0], indices[-1], len(indices)] if indices else [])
    if task.draws_noise and task.model is not None:
        # The fallback generator draws other noise than the Philox kernels (a machine without a C++ compiler,
        # SPLITZ_BACKEND=reference): recorded, so that a resume or a merge never mixes rows of the two streams.
        # Only then, so the files of the Philox stream written before this entry still resume.
        source = NoiseStream(0, model_device(task.model)).source
        if source != PHILOX_STREAM:
            settings["noise_stream"] = source
    if checkpoint is None and task.model is not None:
        # No checkpoint names the model (a run from Python): its weights do, so a resume with another model (or
        # another split of it) is refused rather than mixed into the file.
        settings["model_digest"] = checkpoint_digest({"model": task.model.state_dict()})
    if checkpoint is not None:
        settings["checkpoint_digest"] = checkpoint_digest(load_checkpoint_file(checkpoint, format=checkpoint_format))
        settings["checkpoint_digest_covers"] = CHECKPOINT_DIGEST_COVERS
        if checkpoint_format != "splitz":  # recorded only when set, so files written before the option still resume
            settings["checkpoint_format"] = checkpoint_format
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
    progress: bool = True,
    stop_after: int | None = None,
    on_row: Callable[[int, Any], None] | None = None,
    shard: ShardSpec | None = None,
) -> Path:
    """Run ``task`` (:class:`CertifyRun`, :class:`PredictRun`, :class:`MarginRun`, :class:`AttackRun`) over every
    selected dataset index into ``out_path``.

    ``settings`` (what else determines the rows: dataset, split, model, bound options…) is stored in the sidecar
    together with the task's own settings, the seed, the indices and the checkpoint's digest (``checkpoint_digest``,
    described by ``checkpoint_digest_covers``; ``checkpoint_format`` says how ``checkpoint`` is read, see
    :func:`~splitz_fast.checkpoints.splitz.load_checkpoint`, recorded unless ``"splitz"``; without a checkpoint, the digest
    of the task's model's weights, ``model_digest``); ``stop_after`` stops after that
    many new rows (as an interruption would). The inputs stream through the task (shared ``f_R`` batches, one host
    sync per group of inputs); each row is written as soon as its input is done. The ``f_R`` batch size does not
    change the rows — the noise of an input depends only on its seed — so it is not part of the settings a resume
    must match.

    ``shard`` (a :class:`ShardSpec`) runs only that shard of ``indices`` into ``shard.path(out_path)`` (returned),
    whose sidecar holds these settings plus the ``shard`` record; :func:`merge_shards` makes ``out_path`` from them.
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
                            checkpoint_format=checkpoint_format)
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
    """Another process holds the run's output (see :func:`run_over_dataset`)."""


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


__all__ = ["run_over_dataset", "run_settings", "finished_output", "RunInProgressError", "select_indices",
           "PREDICT_HEADER", "HEADERS", "RunTask", "CertifyRun", "PredictRun", "MarginRun", "AttackRun", "ShardSpec",
           "ShardData", "merge_shards", "shard_files"]
