"""Data-parallel training (``torchrun ... -m splitz_fast train``): the ranks' rows of each global batch
(:class:`BatchRows`) and the collectives the training loop needs (:class:`DataParallelGroup`); :data:`SINGLE_PROCESS`
is the group of one. The process group they run in: :func:`splitz_fast.runs.torchrun.process_group`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..bounds.estimate import PowerIterationState


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
    rank forms the same global batch and takes its contiguous chunk (:meth:`rows`);
    :func:`~splitz_fast.training.loss.splitz_loss` on the chunk draws the noise and power-iteration starts of the global batch (the generators advance as in one process) and
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
