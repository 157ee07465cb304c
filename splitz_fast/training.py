"""SPLITZ training (paper Eq. final_loss, Algorithm 2) and its randomized-smoothing baseline, with resumable runs.

    loss = (1 − λ) · 1/N Σ_i 1/Q Σ_q CE(f_R(f_L(x_i) + δ_q), y_i)  +  λ · 1/N Σ_i max(θ_lip, L̂(x_i, γ_train))

``L̂`` is the differentiable power-iteration *estimate* (:func:`~splitz_fast.lipschitz.lipschitz_estimate`); the hinge
is applied per sample, then averaged. With ``split_index = 0`` (or λ = 0) the loss is plain Gaussian augmentation —
the RS baseline trained in the same loop. Clipped-ReLU thresholds are projected to ≥ 0 after every step.
How the estimate enters the loss is the config's ``lip_objective`` (:data:`LIP_OBJECTIVES`): the paper's per-sample
hinge above, the published code's hinge on the batch mean, or a Lagrangian that holds the mean estimate at a target
``L*`` with a multiplier updated by dual ascent. Training objectives decide which model is found, never whether a
certificate holds: certification bounds the trained ``f_L`` soundly whatever produced it. Named recipes
(:mod:`splitz_fast.recipes`) bundle these choices.

A run lives in one folder: ``last.pt`` (written atomically after every epoch), ``best.pt`` (best validation noisy
accuracy: the paper's early stop), ``train.log`` (one JSON line per epoch, with its wall time). Checkpoints hold only
tensors and plain Python values, so they load with ``torch.load(..., weights_only=True)``, and no wall times, so
identical runs write identical checkpoints (:func:`checkpoint_digest` identifies them by content). The data order of epoch ``e`` depends only on
``(seed, e)``, so a run resumed from ``last.pt`` continues exactly as an uninterrupted one would.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import math
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ._checks import check_count, check_nonnegative, check_positive, check_tensor
from .lipschitz import PowerIterationState, lipschitz_estimate
from .models import build_model
from .modules import AFFINE_TYPES, SplitModel
from .bounds import BallBounds, first_layer_row_norms, input_scale
from .kernels import clip_mask, select_composite, train_noise
from .kernels.noise_votes import standard_normal

CHECKPOINT_FORMAT = 1


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
            then cosine to ``lr_min``: the paper's CIFAR schedule), ``"cosine"`` or ``"none"``.
        val_fraction: share of the training set held out (seeded) for validation and best-checkpoint selection.
        max_batches: stop each epoch (and each validation pass) after this many batches (quick runs and tests);
            ``None`` = full epochs.
        lip_objective: how ``L̂`` enters the loss, a key of :data:`LIP_OBJECTIVES`: ``"per-sample-hinge"`` (the
            paper), ``"batch-mean-hinge"`` (the published code) or ``"lagrangian"`` (target ``lip_target``).
        lip_target, dual_step, dual_init: the Lagrangian's target ``L*`` for the batch-mean estimate, the step of its
            multiplier's dual ascent ``μ ← max(0, μ + dual_step · (mean L̂ − L*))`` after every training step, and
            ``μ``'s start. Read by ``"lagrangian"`` only.
        gamma_ramp: ramp the estimate's ball radius linearly from 0 (first epoch) to ``gamma_train`` (last epoch).
        init_checkpoint: a ``splitz train`` checkpoint whose affine layers initialise the model (warm start, e.g. from
            an RS model of the same σ); ``None`` = fresh weights from ``seed``.
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
        return self

    @property
    def objective(self) -> "LipschitzObjective":
        return LIP_OBJECTIVES[self.lip_objective]

    def lambda_at(self, epoch: int) -> float:
        if self.epochs == 1:
            return self.lambda_start
        return self.lambda_start + (self.lambda_end - self.lambda_start) * epoch / (self.epochs - 1)

    def gamma_at(self, epoch: int) -> float:
        """The estimate's ball radius at ``epoch``: ``gamma_train``, or its linear ramp from 0 (``gamma_ramp``)."""
        if not self.gamma_ramp or self.epochs == 1:
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


class LipschitzObjective(abc.ABC):
    """How the per-sample estimates ``lip`` (``[B]``) and the cross-entropy ``ce`` make the loss, given the weight
    ``weight`` of the Lipschitz term (λ of the hinges, the multiplier μ of the Lagrangian)."""

    #: whether ``weight`` is a multiplier updated from the measured estimate (else λ of the config's schedule).
    has_multiplier = False

    @abc.abstractmethod
    def combine(self, ce: torch.Tensor, lip: torch.Tensor, weight: float, config: "TrainConfig") -> torch.Tensor:
        """The loss of one batch."""


class PerSampleHinge(LipschitzObjective):
    """The paper's Eq. (final_loss): ``(1 − λ) CE + λ · mean_i max(θ_lip, L̂_i)`` — each sample's estimate is pushed
    down until it reaches θ_lip, then left alone."""

    def combine(self, ce, lip, weight, config):
        return (1.0 - weight) * ce + weight * torch.clamp(lip, min=config.theta_lip).mean()


class BatchMeanHinge(LipschitzObjective):
    """The published SPLITZ code's effective objective: the hinge on the batch mean, ``κ CE + (1 − κ) max(θ_lip,
    mean L̂)`` with ``κ = 1 − λ``, and the cross-entropy's weight set to 1 while ``mean L̂ ≤ θ_lip`` (the hinge is then
    constant). Samples with large ``L̂`` can hide behind small ones; kept as a recipe to reproduce that code."""

    def combine(self, ce, lip, weight, config):
        mean = lip.mean()
        if float(mean.detach()) <= config.theta_lip:
            return ce + 0.0 * mean  # hinge inactive; keeps the graph's shape the same on every step
        return (1.0 - weight) * ce + weight * mean


class Lagrangian(LipschitzObjective):
    """The constrained recipe: minimise CE subject to ``mean L̂ ≤ L*`` through ``CE + μ · (mean L̂ − L*)``, with the
    multiplier μ raised while the constraint is violated and lowered (to ≥ 0) while it holds — a moving λ that settles
    where the estimate sits at the target instead of a fixed schedule."""

    has_multiplier = True

    def combine(self, ce, lip, weight, config):
        return ce + weight * (lip.mean() - config.lip_target)


#: The ``lip_objective`` values of :class:`TrainConfig`.
LIP_OBJECTIVES: dict[str, LipschitzObjective] = {
    "per-sample-hinge": PerSampleHinge(), "batch-mean-hinge": BatchMeanHinge(), "lagrangian": Lagrangian(),
}


def philox_training_noise(latent: torch.Tensor, q: int, sigma: float,
                          generator: torch.Generator | None) -> torch.Tensor:
    """``q`` noisy copies of each latent from the Philox stream under a 64-bit seed drawn from ``generator`` (one per
    step; :mod:`splitz_fast.kernels.train_noise`: native on the CPU, its reference elsewhere); channels_last for image
    latents (f_R's first pool runs faster there)."""
    seed = train_noise.draw_seed(generator, latent.device)
    return train_noise.noisy_repeat(latent, q, sigma, seed, channels_last=latent.ndim == 4,
                                    backend=select_composite(train_noise.OP_NAME, latent.device))


def torch_training_noise(latent: torch.Tensor, q: int, sigma: float,
                         generator: torch.Generator | None) -> torch.Tensor:
    """``q`` noisy copies of each latent with ``torch.randn`` noise from ``generator`` (the stream before the native
    kernels; the default where they do not run)."""
    draws = standard_normal(latent.shape[0] * q, latent.shape[1:], generator, latent.device, channels_last=True)
    return latent.float().repeat_interleave(q, dim=0) + sigma * draws


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SPLITZ objective on a batch ``x: [B, *input_shape]``, ``y: [B]``; returns ``(loss, parts)``.

    ``lam`` weighs the Lipschitz term as ``config.objective`` combines it (λ of the hinges, μ of the Lagrangian);
    ``gamma`` is the estimate's ball radius (default ``config.gamma_train``). With ``model.split_index == 0``, or
    ``lam == 0`` under a hinge, it is the Gaussian-augmentation loss (no Lipschitz term). ``parts`` holds the
    cross-entropy and, where computed, the batch-mean estimate ``lip`` (the Lagrangian's multiplier reads it).

    ``training_noise(latent, q, sigma, generator)`` draws the ``[B q, ...]`` noisy copies, reproducibly from
    ``generator``: :func:`philox_training_noise` (a 64-bit seed drawn from ``generator`` each step, then the Philox
    stream of ``csrc/philox.h``) or :func:`torch_training_noise` (``torch.randn``); ``None`` (default) takes Philox
    where the native training kernel runs (``select_composite("train_noise")``: CPU with the extension built) and
    ``torch.randn`` elsewhere (today's stream), so checkpoints trained with and without a compiler differ.
    Where the native kernels run, a one-layer clipped-ReLU ``f_L`` (split 1) is evaluated fused
    (:func:`_fused_first_layer`): its affine layer once, then the clipped ReLU and the estimate's varying mask in one
    pass; the values are those of the unfused path.
    """
    q = config.noise_samples
    objective = config.objective
    gamma = config.gamma_train if gamma is None else gamma
    need_lip = model.split_index > 0 and (lam != 0.0 or objective.has_multiplier)
    fused = _fused_first_layer(model.left, x, gamma) if need_lip else None
    if fused is None:
        latent, bounds = model.left(x), None  # f_L once per input; the Q noise draws are added after it
    else:
        latent, bounds = fused
    if training_noise is None:
        native = select_composite(train_noise.OP_NAME, latent.device) == "native"
        training_noise = philox_training_noise if native else torch_training_noise
    noisy = training_noise(latent, q, config.sigma, generator)
    cross_entropy = F.cross_entropy(model.right(noisy), y.repeat_interleave(q))
    parts = {"ce": float(cross_entropy.detach())}
    if not need_lip:
        return cross_entropy, parts
    lip = lipschitz_estimate(model.left, x, gamma, n_iter=config.power_iters, state=state,
                             generator=generator, bounds=bounds)
    parts["lip"] = float(lip.detach().mean())
    return objective.combine(cross_entropy, lip, lam, config), parts


def _fused_first_layer(left, x: torch.Tensor, gamma_train: float):
    """``(f_L(x), bounds)`` for a one-layer ``f_L`` whose layer ends in a clipped ReLU, where the native ``clip_mask``
    kernel runs (else ``None``): the layer's pre-activation once (standardization included, gradient to the weights),
    then :func:`splitz_fast.kernels.clip_mask.clip_mask` — ``min(relu(z), θ)`` and the varying mask of the ball
    ``gamma_train`` of :func:`~splitz_fast.bounds.ball_bounds`'s first layer (float32, no margin, as the training estimate
    computes it) — as the ``BallBounds`` the estimate reads (masks only; no lower/upper)."""
    if left.depth != 1 or left.activation(0) is None or select_composite(clip_mask.OP_NAME, x.device) != "native":
        return None
    layer = left.layers[0]
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if layer.weight.dtype != dtype:
        return None
    left.check_thresholds()
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
    return _split_train_val(dataset, config["val_fraction"], config["seed"])[1]


def _split_train_val(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    n = len(dataset)
    n_val = max(1, int(round(n * fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.utils.data.Subset(dataset, order[n_val:]), torch.utils.data.Subset(dataset, order[:n_val])


@torch.no_grad()
def evaluate(model: SplitModel, loader: DataLoader, config: TrainConfig, device: torch.device) -> dict[str, float]:
    """Validation: accuracy under one draw of training noise, clean accuracy, and the mean training estimate L̂."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(config.seed + 10_000)
    correct_noisy = correct_clean = total = 0
    lip_sum = 0.0
    for batch_index, (x, y) in enumerate(loader):
        if config.max_batches is not None and batch_index >= config.max_batches:
            break
        x, y = x.to(device), y.to(device)
        latent = model.left(x)
        noisy = latent + config.sigma * torch.randn(latent.shape, device=device, generator=gen)
        correct_noisy += int((model.right(noisy).argmax(1) == y).sum())
        correct_clean += int((model.right(latent).argmax(1) == y).sum())
        if model.split_index > 0:
            lip_sum += float(lipschitz_estimate(model.left, x, config.gamma_train, n_iter=config.power_iters,
                                                generator=gen).sum())
        total += len(y)
    model.train(was_training)
    return {"val_noisy_acc": correct_noisy / total, "val_clean_acc": correct_clean / total,
            "val_lip_estimate": lip_sum / total if model.split_index > 0 else 1.0}


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


_EXPECTED_CHECKPOINT = (f"expected a splitz_fast checkpoint (format {CHECKPOINT_FORMAT}) written by `splitz train` or "
                        "splitz_fast.train()")


def _unreadable_reason(path: Path) -> str:
    """Why torch.load(weights_only=True) failed, in a few words (torch's own messages run to many lines)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        return "the file is not a torch.save archive (damaged, truncated, or another kind of file)"
    return "the archive is damaged, or holds Python objects other than tensors and plain values"


def load_checkpoint_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` and check its format; one-line errors for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception:  # pickle errors, truncated files, foreign objects
        raise ValueError(f"{path} is not a splitz_fast checkpoint: {_unreadable_reason(path)}; "
                         f"{_EXPECTED_CHECKPOINT}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT or "model" not in ckpt:
        raise ValueError(f"{path} is not a splitz_fast checkpoint: {_EXPECTED_CHECKPOINT}")
    return ckpt


def checkpoint_digest(ckpt: dict) -> str:
    """SHA-256 identifying a checkpoint's model: its weights and the settings that made them, never file bytes.

    Covers the ``model`` state_dict tensors, sorted by name (name, dtype, shape, then the raw bytes), and the JSON
    (sorted keys) of ``model_spec`` and ``config``. Two bit-identical trainings give the same digest.
    """
    digest = hashlib.sha256()
    for name in sorted(ckpt["model"]):
        tensor = ckpt["model"][name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    settings = {"model_spec": ckpt.get("model_spec"), "config": ckpt.get("config")}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


#: What :func:`checkpoint_digest` covers, recorded beside it in certification sidecars.
CHECKPOINT_DIGEST_COVERS = ("sha256 over the model state_dict tensors sorted by name (name, dtype, shape, bytes) "
                            "and the JSON of model_spec and training config; not the file bytes")


@dataclass
class TrainResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    best_epoch: int = -1
    best_val_noisy_acc: float = -1.0
    out_dir: Path | None = None


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
) -> TrainResult:
    """Train ``model`` with the SPLITZ loss (RS loss when ``split_index == 0``) and write checkpoints to ``out_dir``.

    Args:
        train_set: dataset of ``(x, y)``; ``config.val_fraction`` of it (seeded) is held out for validation.
        model_spec: how to rebuild the model (e.g. ``{"name": "lenet", "split_index": 1}``), stored in checkpoints.
        resume: continue from ``out_dir/last.pt``; refused if that run used a different config or model spec.
            Without ``resume``, an existing ``last.pt`` is an error (nothing is overwritten silently).
        stop_after_epochs: stop (as an interruption would) after this many epochs of *this call*.
    """
    config.validate()
    device = torch.device(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    last_path, best_path, log_path = out / "last.pt", out / "best.pt", out / "train.log"
    config_dict = dataclasses.asdict(config)
    spec = dict(model_spec or {})

    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    state = PowerIterationState()
    result = TrainResult(out_dir=out)
    start_epoch = 0
    objective = config.objective
    multiplier = config.dual_init  # the Lagrangian's μ (unused by the hinges)
    if last_path.exists():
        if not resume:
            raise FileExistsError(f"{last_path} exists: pass resume=True (--resume) to continue that run, "
                                  "or choose another output folder")
        ckpt = load_checkpoint_file(last_path, device)
        # Fields added after a checkpoint was written read as their defaults (what that run effectively used).
        previous = {**dataclasses.asdict(TrainConfig()), **ckpt["config"], "model_spec": ckpt.get("model_spec", {})}
        changed = [f"{key} ({previous.get(key)!r} in last.pt, {value!r} now)"
                   for key, value in {**config_dict, "model_spec": spec}.items() if previous.get(key) != value]
        if changed:
            raise ValueError(f"cannot resume {last_path}: it was written with another config or model: "
                             f"{'; '.join(changed)}; use the same settings or a new output folder")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.vectors = [v.to(device) for v in ckpt["power_vectors"]]
        result.history = list(ckpt["history"])
        result.best_epoch, result.best_val_noisy_acc = ckpt["best_epoch"], ckpt["best_val_noisy_acc"]
        multiplier = ckpt.get("multiplier", config.dual_init)
        start_epoch = ckpt["epoch"] + 1
    elif config.init_checkpoint is not None:
        warm_start_(model, load_checkpoint_file(config.init_checkpoint, device), config)

    train_part, val_part = _split_train_val(train_set, config.val_fraction, config.seed)
    val_loader = DataLoader(val_part, batch_size=config.batch_size, shuffle=False, num_workers=config.num_workers)
    epochs_run = 0
    for epoch in range(start_epoch, config.epochs):
        if stop_after_epochs is not None and epochs_run >= stop_after_epochs:
            break
        lam = config.lambda_at(epoch)
        gamma = config.gamma_at(epoch)
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(epoch)
        # The epoch's data order and noise depend only on (seed, epoch): resuming reproduces them.
        order_gen = torch.Generator().manual_seed(config.seed * 100_003 + epoch)
        noise_gen = torch.Generator(device=device).manual_seed(config.seed * 100_019 + epoch)
        loader = DataLoader(train_part, batch_size=config.batch_size, shuffle=True, generator=order_gen,
                            num_workers=config.num_workers, drop_last=False)
        model.train()
        sums = {"loss": 0.0, "ce": 0.0, "lip": 0.0}
        batches = 0
        start = time.perf_counter()
        n_batches = len(loader) if config.max_batches is None else min(len(loader), config.max_batches)
        progress = tqdm(loader, total=n_batches, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False)
        for x, y in progress:
            if batches >= n_batches:
                break
            x, y = x.to(device), y.to(device)
            weight = multiplier if objective.has_multiplier else lam
            loss, parts = splitz_loss(model, x, y, config, weight, state, noise_gen, gamma=gamma)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            model.left.project_thresholds_()
            if objective.has_multiplier and "lip" in parts:  # dual ascent on μ
                multiplier = max(0.0, multiplier + config.dual_step * (parts["lip"] - config.lip_target))
            sums["loss"] += float(loss.detach())
            sums["ce"] += parts["ce"]
            sums["lip"] += parts.get("lip", 1.0)
            batches += 1
            progress.set_postfix(loss=f"{sums['loss'] / batches:.4f}")
        progress.close()
        seconds = time.perf_counter() - start
        record = {"epoch": epoch, "lr": config.lr_at(epoch), "lambda": lam, "gamma_train": gamma,
                  "multiplier": multiplier if objective.has_multiplier else None,
                  "train_loss": sums["loss"] / batches, "train_ce": sums["ce"] / batches,
                  "train_lip_estimate": sums["lip"] / batches}
        record.update(evaluate(model, val_loader, config, device))
        # Wall times go to train.log only: checkpoints of identical runs must be identical.
        result.history.append(record)
        timed_record = {**record, "epoch_seconds": seconds}
        improved = record["val_noisy_acc"] > result.best_val_noisy_acc
        if improved:
            result.best_epoch, result.best_val_noisy_acc = epoch, record["val_noisy_acc"]
        ckpt = {"format": CHECKPOINT_FORMAT, "config": config_dict, "model_spec": spec,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "power_vectors": [v.detach().cpu() for v in state.vectors if v is not None], "multiplier": multiplier,
                "history": result.history, "best_epoch": result.best_epoch,
                "best_val_noisy_acc": result.best_val_noisy_acc}
        if improved:
            _atomic_save(ckpt, best_path)
        _atomic_save(ckpt, last_path)
        with log_path.open("a") as fh:
            fh.write(json.dumps(timed_record) + "\n")
        if on_epoch_end is not None:
            on_epoch_end(timed_record)
        epochs_run += 1
    return result


def warm_start_(model: SplitModel, checkpoint: dict, config: TrainConfig) -> SplitModel:
    """Copy a checkpoint's affine layers into ``model``, in network order, whatever the two splits are (an RS model,
    split 0, warm-starts a SPLITZ model of split 1: same LeNet, different halves). Thresholds and optimizer state
    start fresh. Refused when the checkpoint was trained at another σ or its affine layers do not match one for one.
    """
    spec = checkpoint.get("model_spec") or {}
    trained_sigma = (checkpoint.get("config") or {}).get("sigma")
    if trained_sigma != config.sigma:
        raise ValueError(f"--init {config.init_checkpoint} was trained at σ = {trained_sigma}, this run at σ = "
                         f"{config.sigma}; warm-start from a checkpoint of the same σ")
    source = load_state_into(build_model(spec["name"], **spec["kwargs"]), checkpoint)
    pairs = list(zip(_affine_layers(source), _affine_layers(model)))
    if len(_affine_layers(source)) != len(_affine_layers(model)) or any(
            a.weight.shape != b.weight.shape for a, b in pairs):
        raise ValueError(f"--init {config.init_checkpoint} is a {spec.get('name')} whose affine layers do not match "
                         "this model's one for one; warm-start from the same architecture")
    with torch.no_grad():
        for src, dst in pairs:
            dst.weight.copy_(src.weight)
            if dst.bias is not None:
                dst.bias.copy_(src.bias)
    return model


def _affine_layers(model: SplitModel) -> list[nn.Module]:
    """The affine layers of ``f_R ∘ f_L`` in network order (``f_L``'s, then ``f_R``'s as ``modules()`` walks them)."""
    return [m for half in (model.left, model.right) for m in half.modules() if isinstance(m, AFFINE_TYPES)]


def load_state_into(model: nn.Module, checkpoint: dict) -> nn.Module:
    """Load a checkpoint's weights into a model built from its ``model_spec``; a mismatch is one line saying how."""
    saved, expected = checkpoint["model"], model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        first = (missing or unexpected or reshaped)[0]
        raise ValueError(
            f"checkpoint weights do not fit the model {checkpoint.get('model_spec')} as this version builds it "
            f"({len(missing)} missing, {len(unexpected)} unexpected, {len(reshaped)} reshaped tensors, e.g. "
            f"{first!r}): it was written for another split or architecture")
    model.load_state_dict(saved)
    return model
