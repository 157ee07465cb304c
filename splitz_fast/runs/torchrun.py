"""``splitz certify`` / ``predict`` under ``torchrun``: one shard per rank, merged by rank 0; and the process group
that ``splitz train`` under torchrun trains in (:func:`process_group`; the training itself:
:class:`~splitz_fast.training.parallel.DataParallelGroup`: the ranks' rows of each global batch and the collectives the
training loop needs).

``torchrun --nproc_per_node=K [--nnodes ...] -m splitz_fast certify ...`` starts K processes per node with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` set. Rank ``r`` of ``W`` runs shard ``r/W`` of the selected indices
(:class:`~splitz_fast.runs.shards.ShardSpec`: the strided slice ``indices[r::W]``) on its own device — ``cuda:LOCAL_RANK``
when CUDA is there, else the CPU — into its own resumable ``OUTFILE.shard-r-of-W`` with a sidecar, exactly as
``--shard r/W`` would. When every rank has finished, the shards' rows and sidecars are gathered to rank 0 over the
process group (so nodes need no shared file system for the merge) and rank 0 writes ``OUTFILE`` with
:func:`~splitz_fast.runs.shards.merge_shards`, the same merge as ``splitz merge``.

A rank that dies loses nothing already written: every row is flushed as it is computed, and torchrun stops the other
ranks, whose files keep their rows too. Running the same command again with ``--resume`` continues every shard.

For certification the process group (gloo on the CPU, NCCL with CUDA) carries only that final gather; its timeout,
:data:`WAIT_TIMEOUT`, bounds how long a rank that finished early waits for the slowest one.
"""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from .shards import ShardData, ShardSpec, merge_shards

#: How long the final gather waits for the slowest rank (a crashed rank is noticed by torchrun long before).
WAIT_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a ``torchrun`` job, read from the environment torchrun sets."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "TorchrunEnv | None":
        """The job's ranks when ``RANK`` and ``WORLD_SIZE`` are set (torchrun, or a launcher that sets the same
        variables), else ``None`` (a plain process)."""
        environ = os.environ if environ is None else environ
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local = int(environ.get("LOCAL_RANK", rank))
        except ValueError:
            raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them), got "
                             f"{environ.get('RANK')!r}, {environ.get('WORLD_SIZE')!r}, "
                             f"{environ.get('LOCAL_RANK')!r}") from None
        if not (world >= 1 and 0 <= rank < world and local >= 0):
            raise ValueError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local} do not describe a rank of a job")
        return cls(rank, world, local)

    @property
    def shard(self) -> ShardSpec:
        return ShardSpec(self.rank, self.world_size)

    def device(self, requested: str | None) -> str:
        """The rank's device: ``cuda:LOCAL_RANK`` for ``--device cuda`` or no ``--device`` when CUDA is available;
        ``cpu`` for ``--device cpu`` or without CUDA. A numbered ``cuda:N`` is refused: ranks pick their own GPU."""
        if requested == "cpu" or (requested is None and not torch.cuda.is_available()):
            return "cpu"
        if requested in (None, "cuda"):
            if not torch.cuda.is_available():
                raise ValueError("--device 'cuda' is unavailable on this machine; valid here: cpu")
            if self.local_rank >= torch.cuda.device_count():
                raise ValueError(f"LOCAL_RANK {self.local_rank} has no GPU: this node has "
                                 f"{torch.cuda.device_count()}; start at most that many processes per node "
                                 "(--nproc_per_node)")
            return f"cuda:{self.local_rank}"
        raise ValueError(f"--device {requested!r} under torchrun: each rank uses its local rank's GPU; pass "
                         "--device cuda (or cpu), or nothing")


def _import_group_capturing_modules() -> None:
    """Import, while no process group exists, the torch modules that bind ``group.WORLD`` as a default argument when
    they are first imported. ``torch.distributed.nn.functional`` does, and the optimizer's first step pulls it in
    (its lazy import of ``torch._dynamo`` imports FSDP, which imports it): imported *after* ``init_process_group``,
    those defaults keep the group alive past ``destroy_process_group``, its gloo worker threads outlive ``main``, and
    one that frees a finished collective's tensors during interpreter shutdown aborts the process (SIGABRT, "terminate
    called without an active exception") after a run that succeeded. Imported before, the defaults are ``None``."""
    for module in ("torch._dynamo", "torch.distributed.nn"):
        importlib.import_module(module)


@contextmanager
def process_group(env: TorchrunEnv, device: str) -> Iterator[None]:
    """The job's default process group while the ``with`` block runs: gloo when ``device`` is the CPU, NCCL with
    ``device`` (``cuda:LOCAL_RANK``) made the current CUDA device, so that collectives run on it; rendezvous from
    torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``); every collective waits at most :data:`WAIT_TIMEOUT`.
    Destroyed on the way out, also when the block raises."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    _import_group_capturing_modules()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=WAIT_TIMEOUT)
    try:
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) does not match "
                             f"RANK={env.rank}, WORLD_SIZE={env.world_size}")
        yield
    finally:
        dist.destroy_process_group()


def run_sharded(env: TorchrunEnv, device: str, out_path: str | os.PathLike,
                run_shard: Callable[[ShardSpec], Path]) -> Path | None:
    """Run this rank's shard with ``run_shard(shard)`` (which returns the shard file), then gather all shards to rank
    0 and merge them into ``out_path``; returns ``out_path`` on rank 0, ``None`` elsewhere.

    A rank whose ``run_shard`` raises leaves the others waiting in the gather until torchrun, seeing it exit, stops
    them (or :data:`WAIT_TIMEOUT` passes)."""
    with process_group(env, device):
        shard_path = run_shard(env.shard)
        mine = ShardData.read(shard_path, where=f"rank {env.rank} ({shard_path})")
        gathered: list[ShardData] | None = [None] * env.world_size if env.rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(mine, gathered, dst=0)
        if env.rank != 0:
            return None
        return merge_shards(out_path, gathered)  # type: ignore[arg-type]


__all__ = ["TorchrunEnv", "process_group", "run_sharded", "WAIT_TIMEOUT"]
