"""The settings of one training run (:class:`TrainConfig`: its schedules of λ, γ, the learning rate and the radius
term's weight) and how the power-iteration estimate enters the loss.

How the estimate enters the loss is the config's ``lip_objective`` (:data:`LIP_OBJECTIVES`): the paper's per-sample
hinge, the published code's hinge on the batch mean, or a Lagrangian that holds the mean estimate at a target
``L*`` with a multiplier updated by dual ascent. Training objectives decide which model is found, never whether a
certificate holds: certification bounds the trained ``f_L`` soundly whatever produced it. Named recipes
(:mod:`splitz_fast.training.recipes`) bundle these choices.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch

from .._checks import check_count, check_nonnegative, check_positive


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
            (:func:`~splitz_fast.training.loss.stability_penalty`: a soft count of ``f_L``'s neurons that vary on
            the training ball, from the certificate's interval bounds); 0 (default) leaves it out.
        stability_scale: τ of the stability term (pre-activation units): a varying neuron that must move its bounds
            by ``d`` to become constant costs ``tanh(d / τ)``.
        flatness_weight: weight κ_f of the spectral-flatness term ``κ_f · mean_i log(L̂_i² n / ‖A_i‖_F²)``
            (:func:`~splitz_fast.training.loss.flatness_penalty`; one-layer ``f_L`` only); 0 (default) leaves it out.
        init_checkpoint: a ``splitz train`` checkpoint whose affine layers initialise the model (warm start, e.g. from
            an RS model of the same σ); ``None`` = fresh weights from ``seed``.
        radius_weight, radius_target, radius_beta, radius_ramp_fraction: the radius term
            (:func:`~splitz_fast.training.loss.radius_penalty`, off at weight 0, the default): its weight, target
            radius (raw input units), β and the share of steps it ramps over.
        consistency_lambda, consistency_eta: the weights λ and η of Jeong & Shin's consistency regularization
            (:func:`~splitz_fast.training.loss.consistency_penalty`): ``λ · mean KL(p̂ ‖ p_j) + η · H(p̂)`` over the
            ``noise_samples`` ≥ 2 draws of each input, added to the noisy cross-entropy; 0 and 0 (default) leave it
            out. Their MNIST settings: 2 draws, λ = 20, η = 0.5 (recipe ``consistency``).
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
    consistency_lambda: float = 0.0
    consistency_eta: float = 0.0

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
    """Validate the fields of the optional loss terms (stability, flatness, radius, consistency)."""
    check_nonnegative("stability_weight", config.stability_weight)
    check_positive("stability_scale", config.stability_scale)
    check_nonnegative("flatness_weight", config.flatness_weight)
    check_nonnegative("radius_weight", config.radius_weight)
    check_positive("radius_target", config.radius_target)
    check_positive("radius_beta", config.radius_beta)
    if not 0.0 <= config.radius_ramp_fraction <= 1.0:
        raise ValueError(f"radius_ramp_fraction must lie in [0, 1], got {config.radius_ramp_fraction}")
    check_nonnegative("consistency_lambda", config.consistency_lambda)
    check_nonnegative("consistency_eta", config.consistency_eta)
    if (config.consistency_lambda > 0 or config.consistency_eta > 0) and config.noise_samples < 2:
        raise ValueError(f"noise_samples must be >= 2 where the consistency terms are on (they pull the predictions "
                         f"of an input's noise draws together), got {config.noise_samples}")


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
