"""``splitz certify`` / ``predict`` under ``torchrun``: one shard per rank, merged by rank 0; and the process group
that ``splitz train`` under torchrun trains in (:func:`process_group`; the training itself:
:class:`DataParallelGroup`, here: the ranks' rows of each global batch and the collectives the training loop needs).

``torchrun --nproc_per_node=K [--nnodes ...] -m splitz_fast certify ...`` starts K processes per node with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` set. Rank ``r`` of ``W`` runs shard ``r/W`` of the selected indices
(:class:`~splitz_fast.runs.loop.ShardSpec`: the strided slice ``indices[r::W]``) on its own device — ``cuda:LOCAL_RANK``
when CUDA is there, else the CPU — into its own resumable ``OUTFILE.shard-r-of-W`` with a sidecar, exactly as
``--shard r/W`` would. When every rank has finished, the shards' rows and sidecars are gathered to rank 0 over the
process group (so nodes need no shared file system for the merge) and rank 0 writes ``OUTFILE`` with
:func:`~splitz_fast.runs.loop.merge_shards`, the same merge as ``splitz merge``.

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
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..bounds.lipschitz import PowerIterationState
from .loop import ShardData, ShardSpec, merge_shards

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


# --------------------------------------------------------------------------------------------- data-parallel training
@dataclass(frozen=True)
class BatchRows:
    """Rows ``[start, stop)`` of a global batch of ``total`` rows: what one data-parallel rank computes
    (:meth:`DataParallelGroup.rows`); ``BatchRows.whole(B)`` is the whole batch of a single process."""

    start: int
    stop: int
    total: int

    @classmethod
    def whole(cls, total: int) -> "BatchRows":
        return cls(0, total, total)

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def share(self) -> float:
        """``count / total``: the weight that turns a mean over these rows into their part of the global batch's mean
        (exactly ``1.0`` for the whole batch, so a single process computes its loss with the same float operations)."""
        return self.count / self.total


class _RankSummedPowerIterationState(PowerIterationState):
    """Warm starts from the mean of the final power vectors over the global batch, every rank's rows: the mean's
    direction is the sum's, so each rank's batch sum is summed over the ranks (all-reduce) and scaled to unit length.
    Every rank then holds the same vectors."""

    def absorb_batch(self, k: int, v: torch.Tensor) -> None:
        total = v.sum(0)
        dist.all_reduce(total)
        self.set(k, total / total.norm().clamp_min(1e-30))


@dataclass(frozen=True)
class DataParallelGroup:
    """Rank ``rank`` of the ``world_size`` processes that train one model together (``torchrun ... -m splitz_fast
    train``, in :func:`splitz_fast.runs.torchrun.process_group`); :data:`SINGLE_PROCESS` is the group of one, which
    communicates nothing.

    Every rank holds the same weights, optimizer state, power-iteration warm starts and generators. At each step every
    rank forms the same global batch and takes its contiguous chunk (:meth:`rows`); :func:`splitz_loss` on the chunk
    draws the noise and power-iteration starts of the global batch (the generators advance as in one process) and
    weights its means by the chunk's share, so its loss is the chunk's part of the global batch's loss. Gradients are
    linear in the loss: their sum over the ranks (:meth:`sum_gradients`) is the global batch's gradient, whatever the
    chunk sizes. Every rank then takes the same optimizer step from the same gradient and projects the same
    thresholds, so the replicas stay identical, and the run follows the single-process run up to float rounding.

    Why summed gradients and not ``torch.nn.parallel.DistributedDataParallel``: DDP *averages* gradients, which would
    need each loss rescaled by ``W · rows / total``; it hooks one module's ``forward``, while the SPLITZ loss uses
    ``f_L`` three ways outside one forward (latent, ball bounds, power iteration), so it would need a wrapper module,
    ``find_unused_parameters`` for parameters that get no gradient (λ = 0, frozen thresholds), and the warm starts'
    all-reduce interleaved with its bucketed ones. What it adds, overlapping the all-reduce with the backward pass, is
    small here: the default LeNet's 0.65 M parameters are one 2.6 MB all-reduce per step (``lenet-splitz``: 2.5 M).
    """

    rank: int
    world_size: int

    def rows(self, batch: int) -> BatchRows:
        """This rank's chunk of a global batch of ``batch`` rows: ``[rank·batch // W, (rank+1)·batch // W)``. The
        chunks tile the batch in rank order and differ in size by at most one row (none is empty when ``batch ≥ W``)."""
        return BatchRows(self.rank * batch // self.world_size, (self.rank + 1) * batch // self.world_size, batch)

    def check_batches(self, smallest: int, what: str) -> None:
        """Refuse a run whose smallest ``what`` batch has fewer rows than there are ranks (a rank would have none)."""
        if smallest < self.world_size:
            raise ValueError(f"torchrun runs {self.world_size} ranks but the smallest {what} batch has {smallest} "
                             f"rows; every rank needs a row of every batch: start at most {smallest} processes, or "
                             "change --batch (or --val-fraction)")

    def check_process_group(self) -> None:
        if self.world_size > 1 and not (dist.is_initialized() and dist.get_world_size() == self.world_size
                                        and dist.get_rank() == self.rank):
            raise ValueError(f"data-parallel rank {self.rank} of {self.world_size} needs the job's process group "
                             "(splitz_fast.runs.torchrun.process_group) to be initialised")

    def power_iteration_state(self) -> PowerIterationState:
        """Warm starts from the global batch: summed over the ranks when there are several."""
        return _RankSummedPowerIterationState() if self.world_size > 1 else PowerIterationState()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (unchanged in a group of one)."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def sum_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Replace each gradient by its sum over the ranks: one all-reduce of all gradients in one flat buffer.
        Parameters without a gradient are left out — the autograd graph is the same on every rank, so they are the
        same ones everywhere — and the optimizer skips them as in a single process."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.world_size == 1 or not grads:
            return
        flat = self.sum_(torch.cat([g.reshape(-1) for g in grads]))
        for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(summed.view_as(grad))

    def broadcast_from_rank0(self, module: nn.Module) -> None:
        """Give every rank rank 0's weights and buffers (replicas stay identical even if the ranks were seeded
        differently)."""
        if self.world_size == 1:
            return
        for tensor in module.state_dict().values():
            source = tensor.contiguous()
            dist.broadcast(source, src=0)
            tensor.copy_(source)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


#: The group of one process: no communication; every rank's chunk is the whole batch.
SINGLE_PROCESS = DataParallelGroup(0, 1)
