"""Sharding a run (:class:`ShardSpec`): shard ``K`` of ``N`` takes the strided slice ``indices[K::N]`` and writes
``OUTFILE.shard-K-of-N`` with its own sidecar, through the same writer
(:func:`~splitz_fast.runs.loop.run_over_dataset`), so each shard resumes like a whole run.
:func:`merge_shards` joins complete shards of one run into ``OUTFILE`` sorted by ``idx``: with per-input seeds
``seed + idx`` the result equals a single-process run row for row (all columns but ``time``), and its sidecar is the
one that run would have written. ``splitz certify --shard K/N`` / ``splitz merge`` and torchrun ranks
(:mod:`splitz_fast.runs.torchrun`) both go through these two functions.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .._checks import read_settings_file
from .files import _rows_certificate, _sidecar, _split_rows
from .schema import current_settings
from .tasks import HEADERS


def _changed_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))



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


def _in_current_schema(shard: ShardData) -> ShardData:
    """``shard`` with its settings as the current sidecar schema records them
    (:func:`~splitz_fast.runs.schema.current_settings`), so shards written by different versions compare alike."""
    try:
        return ShardData(shard.where, current_settings(shard.settings, f"the sidecar of {shard.where}"), shard.text)
    except ValueError as err:
        raise ValueError(f"cannot merge: {err}") from None


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
    shards = [_in_current_schema(shard) for shard in shards]
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
            why = "settings differ" if current_settings(read_settings_file(sidecar), sidecar.name) != settings else None
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



__all__ = ["ShardSpec", "ShardData", "merge_shards", "shard_files"]
