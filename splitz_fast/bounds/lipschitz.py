"""Lipschitz bounds of ``f_L`` over a ball: the certificate bound and the global bound.

``L(x, γ) ≤ Π_k ‖I_k W_k I_{k−1}‖₂`` (``I_0 = I``, ``W_1`` with ``1/sd`` folded in, ``I_k`` the varying masks of
:func:`~splitz_fast.bounds.intervals.ball_bounds`). Why it holds: on the convex ball ``f_L`` is piecewise linear with Jacobian
``J = D_s W_s D_{s−1} ⋯ D_1 W_1 D`` whose activity diagonals satisfy ``D_k = D_k I_k`` and ``‖D_k‖ ≤ 1``, so
``‖J‖ ≤ Π_k ‖I_k W_k I_{k−1}‖``; integrating ``J`` along the segment ``x → x'`` gives the Lipschitz bound.
A non-overlapping max-pool after layer ``k`` adds a selection ``P`` (one entry per disjoint window, ``‖P D_k‖ ≤ 1``)
whose rows vanish for pooled outputs that are constant on the ball, so ``J = ⋯ (I_{k+1} W_{k+1} V)(P D_k)(I_k W_k ⋯)``
with ``V`` the pooled varying mask (:func:`~splitz_fast.bounds.intervals.pool_interval`): the factor of layer ``k+1`` takes
``V`` as its input mask and the pool itself contributes a factor 1.

Three ways to bound each factor ``‖A‖₂`` (:class:`~splitz_fast.bounds.operators.MaskedAffine`):

* ``"exact"`` — deterministic: the float64 Gram matrix ``G = AᵀA`` restricted to the varying inputs (banded and
  sparse for a convolution), an eigenvalue estimate ``μ``, and a Cholesky factorization of ``sI − G`` (``s`` slightly
  above ``μ``) whose success *proves* ``λ_max(G) ≤ s`` up to explicit floating-point terms
  (:func:`~splitz_fast.bounds.certificate.certified_lambda_max`). Under ``"auto"``: used while the Gram dimension is at
  most ``exact_max_dim`` or the estimated cost is at most ``EXACT_MAX_FLOPS`` (see there why).
* ``"probabilistic"`` — for operators too large for a dense Gram (ImageNet-sized first layers): ``k`` power steps
  from a Gaussian start ``b`` give ``‖Gᵏb‖ ≥ λ_maxᵏ |⟨b, e₁⟩|``, and ``P(|⟨b, e₁⟩| < t) ≤ t·√(2/π)``; with
  ``t = δ√(π/2)``, ``‖A‖ ≤ (‖Gᵏb‖/t)^{1/(2k)}`` fails with probability at most ``δ``, whatever the spectrum
  (:func:`probabilistic_norm_bound`). The caller adds every ``δ`` used to α.
* ``"estimate"`` — power iteration only (a *lower* estimate, differentiable): for training, never for certificates
  (:func:`~splitz_fast.bounds.estimate.lipschitz_estimate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._checks import check_count, check_probability
from .certificate import certified_lambda_max_many
from .intervals import BallBounds, ball_bounds, input_scale
from ..model.modules import LeftHalf
from .gram import exact_cost, factor_gram
from .operators import MaskedAffine

DEFAULT_EXACT_MAX_DIM = 4096
DEFAULT_PROBABILISTIC_ITERS = 128
# Under method="auto" a factor takes the exact bound when its Gram dimension is at most exact_max_dim, or when the
# estimated cost of the exact bound (gram.exact_cost) is at most this many flops. Why cost and not dimension
# alone: a convolution's Gram is banded, so its cost is ~3.3·d·band², not d³. Measured on the 2-core CPU (loaded):
# LeNet-splitz conv2 local bounds at γ = 0.1 / 0.5 (estimated 0.6 / 1.4e11 flops) take 4.2 / 7.4 s for the whole
# bound, its global bound (d = 25,088, estimated 3.1e11) 16 s and 1.2 GB — exact, once per model (the probabilistic
# one took 4.9 s and came out 5.6 % looser); an ImageNet stem (d = 150,528, band ≈ 4,000, ~6e12) goes probabilistic.
# The exact bound is worth a few times the probabilistic one's cost: it adds nothing to α and is tight, where the
# probabilistic bound is looser by up to (1/δ)^{1/(2·power_iters)} (5.5 % per factor at δ = 1e-6, 128 steps).
EXACT_MAX_FLOPS = 4e11


@dataclass
class LipschitzBound:
    """A bound on the Lipschitz constant of ``f_L`` for each input of a batch.

    Attributes:
        value: ``[B]`` float64 upper bounds (raw input units → latent units).
        kind: per input, one of ``"identity"`` (``s = 0``), ``"exact"`` (every factor deterministic) or
            ``"probabilistic"`` (at least one factor probabilistic).
        failure_prob: per input, the probability that ``value`` is *not* an upper bound (0 for deterministic kinds):
            the sum of the ``δ`` of its probabilistic factors. Add it to α.
        local: ``True`` for the local bound ``L(x, γ)``, ``False`` for the global one.
        gamma: ``[B]`` the ball radii used (zeros for the global bound).
    """

    value: torch.Tensor
    kind: list[str]
    failure_prob: list[float]
    local: bool
    gamma: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


def probabilistic_norm_bound(
    op: MaskedAffine, power_iters: int, delta: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[B]`` bounds on ``‖A_b‖₂``, each failing with probability at most ``delta`` (see module docstring).

    The power steps run in float64; a relative slack of 1e-6 on the result dominates their rounding.
    """
    device = op.weight.device
    v = torch.randn((op.batch, *op.in_shape), dtype=torch.float64, device=device, generator=generator)
    log_norm = torch.zeros(op.batch, dtype=torch.float64, device=device)
    zero = torch.zeros(op.batch, dtype=torch.bool, device=device)
    with torch.no_grad():
        for _ in range(power_iters):
            w = op.gram_matvec(v)
            norms = w.flatten(1).norm(dim=1)
            zero |= norms == 0
            safe = torch.where(norms > 0, norms, torch.ones_like(norms))
            log_norm += torch.log(safe)
            v = w / safe.view(-1, *([1] * (w.ndim - 1)))
    t = delta * math.sqrt(math.pi / 2)
    bound = torch.exp((log_norm - math.log(t)) / (2 * power_iters)) * (1 + 1e-6)
    # G^k b = 0 means λ_max·|⟨b, e₁⟩| = 0, i.e. λ_max = 0 (⟨b, e₁⟩ ≠ 0 almost surely; δ covers the rest).
    return torch.where(zero, torch.zeros_like(bound), bound)


def _layer_shapes(left: LeftHalf, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Input shape of every affine layer of ``f_L``."""
    shapes = []
    weight = left.layers[0].weight
    h = torch.zeros(1, *input_shape, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for layer, act, pool in zip(left.layers, left.activations, left.pools):
            shapes.append(tuple(h.shape[1:]))
            h = pool(act(layer(left.layer_input(layer, h))))
    return shapes


def masked_operators(
    left: LeftHalf, bounds: BallBounds | None, input_shape: tuple[int, ...], batch: int, scale: torch.Tensor | None,
    dtype: torch.dtype = torch.float64,
) -> list[MaskedAffine]:
    """The factors ``I_k W_k I_{k−1}`` of the product bound; without ``bounds``, the unmasked (global) factors."""
    left.check_structure()  # the factors below are sound only for the pieces this check admits
    ops = []
    shapes = _layer_shapes(left, input_shape)
    for k, layer in enumerate(left.layers):
        out_mask = None if bounds is None else bounds.masks[k]
        in_mask = None if bounds is None else bounds.in_mask(k)
        ops.append(
            MaskedAffine(
                layer, shapes[k], out_mask=out_mask, in_mask=in_mask, in_scale=scale if k == 0 else None,
                batch=batch, dtype=dtype,
            )
        )
    return ops


def _check_bound_settings(method: str, delta: float, power_iters: int, exact_max_dim: int) -> None:
    """The settings every bound entry point takes, checked as :class:`~splitz_fast.bounds.radius.BoundOptions` checks them
    (a ``delta`` of 0 or above 1 would make the probabilistic slack meaningless, not just loose)."""
    if method not in ("auto", "exact", "probabilistic"):
        raise ValueError(f"method must be 'auto', 'exact' or 'probabilistic', got {method!r}")
    check_probability("delta", delta)
    check_count("power_iters", power_iters)
    check_count("exact_max_dim", exact_max_dim, minimum=0)


def _bound_factors(
    ops: list[MaskedAffine], batch: int, *, method: str, delta: float, power_iters: int, exact_max_dim: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, list[str], list[float]]:
    return _bound_factors_many([(ops, batch, generator)], method=method, delta=delta, power_iters=power_iters,
                               exact_max_dim=exact_max_dim)[0]


def _bound_factors_many(
    groups: list[tuple[list[MaskedAffine], int, torch.Generator | None]], *, method: str, delta: float,
    power_iters: int, exact_max_dim: int,
) -> list[tuple[torch.Tensor, list[str], list[float]]]:
    """The product of factor bounds of each group ``(ops, batch, generator)`` (groups: inputs of a radius-search
    round, each with its own generator; every group has one operator per layer of ``f_L``). Per layer, the exact
    factors of all groups are certified together (:func:`~splitz_fast.bounds.certificate.certified_lambda_max_many`); a probabilistic factor draws
    from its own group's generator, in layer order, as it would alone."""
    values = [torch.ones(batch, dtype=torch.float64) for _, batch, _ in groups]
    n_prob = [[0] * batch for _, batch, _ in groups]
    for k in range(len(groups[0][0]) if groups else 0):
        grams, owners = [], []
        for g, (ops, batch, generator) in enumerate(groups):
            op = ops[k]
            use_exact = method == "exact"
            if method == "auto":
                dim, flops = exact_cost(op)
                use_exact = dim <= exact_max_dim or flops <= EXACT_MAX_FLOPS
            if use_exact:
                grams += [factor_gram(op, b) for b in range(batch)]
                owners += [(g, b) for b in range(batch)]
            else:
                values[g] *= probabilistic_norm_bound(op, power_iters, delta, generator).cpu()
                n_prob[g] = [n + 1 for n in n_prob[g]]
        for (g, b), top in zip(owners, certified_lambda_max_many([gram for gram, _ in grams],
                                                                 [terms for _, terms in grams])):
            values[g][b] *= math.sqrt(top)
    return [(value * (1 + 1e-12), ["exact" if n == 0 else "probabilistic" for n in counts], [n * delta for n in counts])
            for value, counts in zip(values, n_prob)]


def lipschitz_bound(
    left: LeftHalf,
    x: torch.Tensor,
    gamma: float | torch.Tensor,
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """Certificate bound on the local Lipschitz constant ``L(x, γ)`` of ``f_L`` for each input of ``x: [B, ...]``.

    Args:
        gamma: scalar or ``[B]`` ball radii in raw input units, ≥ 0.
        method: ``"exact"`` (deterministic, restricted Gram + Cholesky certificate), ``"probabilistic"`` (power
            method from a random start, failure probability ``delta`` per factor), or ``"auto"`` (per factor: exact
            while the Gram dimension is ≤ ``exact_max_dim`` or the estimated cost ≤ ``EXACT_MAX_FLOPS``).
        power_iters: power steps of the probabilistic bound; the bound's slack factor is about ``(1/δ)^{1/(2·power_iters)}``.
    """
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    batch = x.shape[0]
    if left.depth == 0:
        return LipschitzBound(torch.ones(batch, dtype=torch.float64), ["identity"] * batch, [0.0] * batch, True,
                              torch.as_tensor(gamma, dtype=torch.float64).expand(batch).clone())
    return bound_from_ball(left, ball_bounds(left, x, gamma), tuple(x.shape[1:]), method=method, delta=delta,
                           power_iters=power_iters, exact_max_dim=exact_max_dim, generator=generator)


def bound_from_ball(
    left: LeftHalf,
    bounds: BallBounds,
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """:func:`lipschitz_bound` from ball bounds already computed (:func:`~splitz_fast.bounds.intervals.ball_bounds`, or a
    :meth:`~splitz_fast.bounds.intervals.BallBounds.rows` slice of a larger batch's): the same factors and the same value."""
    return bounds_from_balls(left, [bounds], input_shape, method=method, delta=delta, power_iters=power_iters,
                             exact_max_dim=exact_max_dim, generators=[generator])[0]


def bounds_from_balls(
    left: LeftHalf,
    balls: list[BallBounds],
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generators: list[torch.Generator | None] | None = None,
) -> list[LipschitzBound]:
    """:func:`bound_from_ball` of each of ``balls`` (each with its own generator), each equal to its own call; their
    exact factors are certified together, layer by layer (:func:`~splitz_fast.bounds.certificate.certified_lambda_max_many`: on CUDA one batched
    squaring and Cholesky for all of them)."""
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    generators = generators if generators is not None else [None] * len(balls)
    if len(generators) != len(balls):
        raise ValueError(f"one generator per ball: {len(balls)} balls, {len(generators)} generators")
    groups = [(masked_operators(left, ball, input_shape, ball.gamma.shape[0], ball.input_scale), ball.gamma.shape[0],
               generator) for ball, generator in zip(balls, generators)]
    factors = _bound_factors_many(groups, method=method, delta=delta, power_iters=power_iters,
                                  exact_max_dim=exact_max_dim)
    return [LipschitzBound(value, kind, failure, True, ball.gamma.cpu())
            for (value, kind, failure), ball in zip(factors, balls)]


def global_lipschitz_bound(
    left: LeftHalf,
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """The global bound ``Π_k ‖W_k‖₂`` (with ``1/sd`` folded into ``W_1``; convolutions as zero-padded operators on
    ``input_shape``). Input-independent; returned for a batch of one. Its Grams are the full (unmasked) ones; a
    convolution's is banded, so under ``"auto"`` e.g. LeNet-splitz split 2's conv2 (d = 25,088) is exact (~16 s,
    ~1.2 GB on a 2-core CPU; see ``EXACT_MAX_FLOPS``)."""
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    if left.depth == 0:
        return LipschitzBound(torch.ones(1, dtype=torch.float64), ["identity"], [0.0], False, torch.zeros(1))
    device = left.layers[0].weight.device
    probe = torch.zeros(1, *input_shape, device=device)
    scale = input_scale(left, probe.to(torch.float64))
    ops = masked_operators(left, None, tuple(input_shape), 1, scale)
    value, kind, failure = _bound_factors(
        ops, 1, method=method, delta=delta, power_iters=power_iters, exact_max_dim=exact_max_dim, generator=generator
    )
    return LipschitzBound(value, kind, failure, False, torch.zeros(1, dtype=torch.float64))
