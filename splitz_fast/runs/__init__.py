"""Runs over a dataset: resumable certify/predict/attack runs into Cohen-format TSVs (the loop: :mod:`.loop`; the
kinds of run: :mod:`.tasks`; their files: :mod:`.files`; shards and merging: :mod:`.shards`; rows: :mod:`.rows`) and
torchrun sharding (:mod:`.torchrun`).

``splitz_fast.runs`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .files import RunInProgressError
from .loop import finished_output, run_over_dataset, run_settings, select_indices
from .shards import ShardData, ShardSpec, merge_shards, shard_files
from .tasks import HEADERS, PREDICT_HEADER, AttackRun, CertifyRun, MarginRun, PredictRun, RunTask

__all__ = [
    "run_over_dataset", "run_settings", "finished_output", "RunInProgressError", "select_indices", "PREDICT_HEADER",
    "HEADERS", "RunTask", "CertifyRun", "PredictRun", "MarginRun", "AttackRun", "ShardSpec", "ShardData",
    "merge_shards", "shard_files",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.runs``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
