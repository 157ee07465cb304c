"""The SPLITZ loss (paper Eq. final_loss, Algorithm 2) and its randomized-smoothing baseline: the training noise, the
loss of one batch (:func:`splitz_loss`) and its optional terms (radius, stability, flatness).

    loss = (1 − λ) · 1/N Σ_i 1/Q Σ_q CE(f_R(f_L(x_i) + δ_q), y_i)  +  λ · 1/N Σ_i max(θ_lip, L̂(x_i, γ_train))

``L̂`` is the differentiable power-iteration *estimate* (:func:`~splitz_fast.bounds.estimate.lipschitz_estimate`); the hinge
is applied per sample, then averaged. With ``split_index = 0`` (or λ = 0) the loss is plain Gaussian augmentation —
the RS baseline trained in the same loop. Clipped-ReLU thresholds are projected to ≥ 0 after every step.
How the estimate enters the loss is the config's ``lip_objective`` (:data:`~splitz_fast.training.config.LIP_OBJECTIVES`):
the paper's per-sample hinge above, the published code's hinge on the batch mean, or a Lagrangian that holds the mean
estimate at a target ``L*`` with a multiplier updated by dual ascent. With ``stability_weight > 0`` the loss also holds
``stability_weight · mean_i S(x_i, γ)``, a soft count of ``f_L``'s neurons that vary on the training ball, from the
certificate's interval bounds made differentiable (:func:`ball_intervals`, :func:`stability_penalty`): the ``stable``
recipe's way of making ``f_L`` flat where it is certified. With ``flatness_weight > 0`` it holds
``flatness_weight · mean_i log(L̂_i² n / ‖A_i‖_F²)`` (:func:`flatness_penalty`): how far the masked operator's spectrum
is from flat, so that latent noise that is as large as the certificate assumes in the worst direction is not much
larger, relative to the signal, in all the others. With ``radius_weight > 0`` it holds MACER's hinge on a soft SPLITZ
radius, ``radius_weight · mean_i [correct_i] · max(0, radius_target − min(γ_i, σ Φ⁻¹(p̃_A,i) / L̂(x_i, γ_i)))``
(:func:`radius_penalty`): pressure on the radius the certificate reports, with ``L̂`` on each input's own ball. With
``consistency_lambda`` or ``consistency_eta`` > 0 the noisy cross-entropy is joined by Jeong & Shin's consistency
regularization over the ``Q ≥ 2`` draws of each input (:func:`consistency_penalty`), at every split: the noise is added
to ``f_L(x)``, so at split 0 it is theirs exactly.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import check_tensor
from ..bounds.estimate import PowerIterationState, lipschitz_estimate
from ..model.modules import SplitModel
from ..bounds.intervals import (BallBounds, ball_bounds, first_layer_row_norms, input_scale, linear_part,
                                masked_frobenius_sq, squared_row_norms)
from ..kernels import clip_mask, select_composite, train_noise
from ..kernels.philox_reference import standard_normal
from .config import TrainConfig
from .parallel import BatchRows


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
    :meth:`~splitz_fast.training.parallel.DataParallelGroup.power_iteration_state`.)

    With ``config.consistency_lambda`` or ``config.consistency_eta`` > 0 the cross-entropy becomes ``CE +
    consistency_lambda · mean_i KL_i + consistency_eta · mean_i H_i`` (:func:`consistency_penalty`, weighted by
    ``rows.share`` as the cross-entropy is) before the Lipschitz objective combines it (so the paper's hinge weighs
    the pair by ``1 − λ``); ``parts`` then holds the unweighted means ``consistency_kl`` and ``consistency_entropy``
    and ``ce`` the cross-entropy alone.

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
    if config.consistency_lambda > 0 or config.consistency_eta > 0:
        # Part of the noisy classification loss: the Lipschitz objectives weigh it as they weigh the cross-entropy.
        kl, entropy = consistency_penalty(logits, x.shape[0])
        parts["consistency_kl"] = float(kl.detach().mean()) * rows.share
        parts["consistency_entropy"] = float(entropy.detach().mean()) * rows.share
        cross_entropy = cross_entropy + (config.consistency_lambda * kl.mean()
                                         + config.consistency_eta * entropy.mean()) * rows.share
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


def consistency_penalty(logits: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jeong & Shin's consistency regularization (NeurIPS 2020, "Consistency Regularization for Certified Robustness
    of Smoothed Classifiers"): per input, the mean over its ``m`` noise draws of ``KL(p̂ ‖ p_j)`` and the entropy
    ``H(p̂)`` of their mean prediction, ``p_j = softmax(logits_j)`` and ``p̂ = 1/m Σ_j p_j``. Returns ``(kl, entropy)``,
    both ``[batch]``, with gradient (through ``p̂`` too, as in their objective
    ``mean_j CE(p_j, y) + λ · mean_j KL(p̂ ‖ p_j) + η · H(p̂)``; MNIST: ``m = 2``, ``λ = 20``, ``η = 0.5``).

    Why it helps: the smoothed classifier's margin is that of ``p̂``'s expectation over the noise; pulling every
    draw's prediction to their mean makes the base classifier's votes agree, which raises ``p_A`` (the KL term),
    and lowering ``H(p̂)`` makes that agreement a confident one rather than a uniform ``p̂`` (the entropy term).

    ``logits``: ``[batch · m, C]``, input ``i``'s draws at rows ``i m … i m + m − 1`` (the layout of
    :func:`splitz_loss`). Computed from log-probabilities (``log p̂ = logsumexp_j log p_j − log m``), so both terms and
    their gradients stay finite where a probability underflows to 0 — ``p log p`` on the probabilities themselves
    would give ``0 · (−∞)`` there. With ``m = 1``, ``p̂ = p_1``: the KL is 0 and the entropy that of the one draw."""
    if batch == 0 or logits.ndim != 2 or logits.shape[0] % batch:
        raise ValueError(f"logits must be [batch · m, C] with m draws per input: {tuple(logits.shape)} for {batch} "
                         "inputs")
    m = logits.shape[0] // batch
    log_p = torch.log_softmax(logits, dim=1).view(batch, m, -1)
    log_mean = torch.logsumexp(log_p, dim=1) - math.log(m)  # [batch, C]: log p̂
    mean = log_mean.exp()
    entropy = -(mean * log_mean).sum(1)
    kl = (mean.unsqueeze(1) * (log_mean.unsqueeze(1) - log_p)).sum(2).mean(1)
    return kl, entropy


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
    * ``L̃(x_i, γ_i)``: :func:`~splitz_fast.bounds.estimate.lipschitz_estimate` with the certificate's varying masks of
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
