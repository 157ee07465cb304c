"""Sound upper bounds on the latent displacement of ``f_L`` over an l2 ball, and the largest γ they certify.

**Why.** The SPLITZ certificate only needs ``sup_{x' ∈ B(x, γ)} ‖f_L(x') − f_L(x)‖₂ < R`` where ``R = σ Φ⁻¹(p_A_lower)``
is the certified latent radius of the smoothed ``f_R`` at ``u = f_L(x)``. Theorem 1 bounds that supremum by
``L(x, γ)·γ``; a clipped ReLU's output cannot move by more than its clipped output range, which can be far smaller.

**Theorem.** Let ``Δ(x, γ)`` be any of the bounds below. If ``Δ(x, γ) < R``, no ``x'`` with ``‖x' − x‖₂ ≤ γ`` changes
the prediction of ``g``: ``‖f_L(x') − f_L(x)‖ ≤ Δ(x, γ) < R``, and the smoothed ``f_R`` is constant on the open
latent ball of radius ``R`` around ``u`` (Cohen et al. 2019, Thm 1). More finely (what :meth:`DisplacementBound.radius`
uses), every candidate below has the form ``‖f_L(x') − f_L(x)‖² ≤ C_S + K_S² ‖x' − x‖²`` for all ``x' ∈ B(x, γ)``, so
the radius ``min(γ, √(R² − C_S)/K_S)`` is certified (``0`` when ``C_S ≥ R²``, ``γ`` when ``K_S = 0``). ``S = ∅`` gives
``C = 0``, ``K = L(x, γ)``: exactly Theorem 1's ``min(R/L(x, γ), γ)``.

**Single layer** ``f_L(x) = φ(A x + b)`` (``A = W D``: ``1/sd`` of a standardization folded in, a convolution as its
zero-padded operator, ``φ`` the clipped ReLU ``ReLU_θ`` applied per neuron with its own θ_i, or the identity).
Write ``Δ_i = φ_i(z_i(x')) − φ_i(z_i(x))`` and ``δ = x' − x``, ``‖δ‖ = t ≤ γ``.

1. *Each coordinate moves by at most* ``c_i``: :func:`~splitz_fast.bounds.intervals.ball_bounds` returns float64 bounds
   ``LB_i ≤ z_i(x') ≤ UB_i`` for every ``x' ∈ B(x, γ)`` (rounding margin included), and at ``γ = 0`` bounds
   ``lo_i ≤ z_i(x) ≤ hi_i`` of the centre itself. ``φ_i`` is non-decreasing, so
   ``Δ_i ≤ φ_i(UB_i) − φ_i(lo_i)`` and ``−Δ_i ≤ φ_i(hi_i) − φ_i(LB_i)``; also ``|Δ_i| ≤ φ_i(UB_i) − φ_i(LB_i)``. Hence
   ``|Δ_i| ≤ c_i := min(max(φ(UB) − φ(lo), φ(hi) − φ(LB)), φ(UB) − φ(LB))`` — at most the clipped output range
   ``min(UB, θ) − max(LB, 0)``, and up to half of it when ``x`` sits near one end. A neuron that is not *varying*
   (``UB ≤ 0`` or ``LB ≥ θ``) has ``c_i = 0``. θ = ∞ (plain ReLU) and per-channel / per-element θ are read by
   :func:`~splitz_fast.kernels.thresholds.theta_mode`, the one reading the forward pass uses.
2. *Each coordinate moves by at most* ``|a_i·δ|``: ``φ_i`` is 1-Lipschitz (``|clip(p) − clip(q)| ≤ |p − q|``), so
   ``|Δ_i| ≤ |z_i(x') − z_i(x)| = |a_i·δ|``.
3. *Split.* For any set ``S`` of varying neurons ``V`` (non-varying ones contribute ``Δ_i = 0``)::

       ‖Δ‖² = Σ_{i∈S} Δ_i² + Σ_{i∈V∖S} Δ_i² ≤ Σ_{i∈S} c_i² + Σ_{i∈V∖S} (a_i·δ)²
            = C_S + ‖A_{V∖S} δ‖² ≤ C_S + ‖A_{V∖S}‖₂² t²,

   where ``A_{V∖S}`` keeps the rows of ``V∖S`` (:class:`~splitz_fast.bounds.operators.MaskedAffine` with that out mask).
   Its norm is a *proven* upper bound (``"exact"``: the certified Gram eigenvalue of
   :func:`~splitz_fast.bounds.certificate.certified_lambda_max`) or a probabilistic one whose failure probability is reported
   (``"probabilistic"``, :func:`~splitz_fast.bounds.lipschitz.probabilistic_norm_bound`) — the same per-factor machinery and
   ``"auto"`` rule as :func:`~splitz_fast.bounds.lipschitz.lipschitz_bound` (``_bound_factors``). Every ``S`` gives a valid
   bound, so the minimum over a family of ``S`` is valid too (probabilistic case: on the event that every norm bound
   computed holds, probability ≥ 1 − the reported sum of δ).

**Several layers** ``f_L = φ_s ∘ a_s ∘ g`` with ``g`` the first ``s − 1`` layers (clipped ReLUs and disjoint max-pools
included). Apply 1–3 to the last layer with ``δ`` replaced by ``h' − h = g(x') − g(x)``: (i) ``‖h' − h‖ ≤ P t`` with
``P = Π_{k<s} ‖I_k W_k I_{k−1}‖`` — the product bound of :mod:`splitz_fast.bounds.lipschitz` applied to ``g`` on the convex
ball (its Jacobian there is ``D_{s−1} W_{s−1} ⋯ D_1 W_1 D`` with ``D_k = D_k I_k``, pools a selection of norm ≤ 1);
(ii) ``h' − h`` vanishes outside layer ``s``'s input mask (those activations are constant on the ball), so
``z_i(x') − z_i(x) = (a_i ∘ m_in)·(h' − h)`` and ``A_{V∖S}`` takes that input mask; (iii) ``c_i`` comes from the last
layer's interval bounds, which enclose ``z_s`` over the ball (interval arithmetic, :func:`ball_bounds`). Hence
``‖Δ‖² ≤ C_S + (‖A_{V∖S}‖ P)² t²``. The ``S = ∅`` member uses the full product ``Π_k ‖I_k W_k I_{k−1}‖`` as
:func:`~splitz_fast.bounds.lipschitz.lipschitz_bound` computes it, so ``Δ ≤ L(x, γ)·γ`` bit for bit. Depth 0
(``f_L`` = identity): ``Δ = γ``.

**Monotone in γ.** For ``γ₁ ≤ γ₂`` the intervals nest (``z ± (γ r + margin)`` with a margin increasing in γ at the
first layer; interval arithmetic is inclusion-monotone deeper), so ``c_i`` and ``V`` only grow; for a *fixed* index
set ``S`` (``sets=``) ``C_S`` grows, ``A_{V∖S}`` gains rows (its norm cannot drop) and ``t ≤ γ`` grows, so each member
is non-decreasing in exact arithmetic (the certified eigenvalues carry a relative slack of ~1e-10 that can blur this at
that level). The default family is chosen per γ (thresholds on ``c_i``/‖row‖), so its minimum need not be monotone;
:func:`displacement_radius` uses monotonicity only to decide which γ to evaluate next — every evaluated γ certifies
its own radius, so a non-monotone blip can cost radius, never soundness.

**Floating point.** ``c_i = fl(p − q)`` of exact floats (``min``/``max`` are exact) is within ``u`` of the true
difference; ``C_S = Σ c_i²`` is multiplied by ``1 + 2γ_{N+3}`` (``N`` terms, Higham's summation bound, plus the
rounding of ``c_i`` and its square); ``K_S`` carries ``_bound_factors``' relative slack of 1e-12 (far above the
rounding of its products); ``√(C_S + (K_S γ)²)`` gets a factor ``1 + 8u``. The ``S = ∅`` member is ``fl(L γ)``: ``L``'s
1e-12 slack covers that product. Radii: :meth:`DisplacementBound.radius` shrinks ``R²`` by ``4u`` and the result by
``16u`` so that ``C_S + K_S² t² < R²`` holds in exact arithmetic for every ``t`` below the reported radius.

**Choice of S** (``ratios``): for threshold ``τ``, ``S_τ = {i ∈ V : c_i ≤ τ·‖a_i‖·P·γ}`` — neurons whose clipped move is
small compared with the most their row could move them. The family is ``∅`` (``"lipschitz"``), ``V`` (``"clip"``:
``‖Δ‖ ≤ ‖c‖``, no norm at all) and the ``S_τ``; a cheap power-iteration *estimate* of each ``‖A_{V∖S_τ}‖`` (never a
certificate) ranks the ``S_τ`` and only the ``certify`` best of them get a proven norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .certificate import UNIT_ROUNDOFF_64
from ..kinds import EXACT, IDENTITY, IDENTITY_KIND, PROBABILISTIC, BoundKind
from .intervals import BallBounds, ball_bounds, first_layer_row_norms
from ..kernels.thresholds import theta_broadcast, theta_mode
from .lipschitz import (
    DEFAULT_EXACT_MAX_DIM,
    DEFAULT_PROBABILISTIC_ITERS,
    _bound_factors,
    _check_bound_settings,
    masked_operators,
)
from ..model.modules import LeftHalf
from .operators import MaskedAffine
from .radius import BoundOptions, RadiusResult, RadiusSearch

DEFAULT_RATIOS = (0.25, 0.5, 0.75)
ESTIMATE_ITERS = 24  # power steps of the (uncertified) estimate that ranks the candidate sets


def _gamma_n(n: int) -> float:
    u = UNIT_ROUNDOFF_64
    return n * u / (1 - n * u)


@dataclass
class DisplacementBound:
    """Upper bounds ``Δ(x, γ) ≥ sup_{x' ∈ B(x, γ)} ‖f_L(x') − f_L(x)‖₂`` for a batch, and every candidate behind them.

    Attributes:
        value: ``[B]`` float64, the minimum over the candidates (latent units).
        gamma: ``[B]`` float64 ball radii (raw input units).
        names: one name per candidate: ``"lipschitz"`` (``S = ∅``), ``"clip"`` (``S = V``), ``"ratio<=τ"`` or
            ``"set<k>"`` (explicit ``sets``).
        clip_sq: ``[B, T]`` upper bounds on ``C_S = Σ_{i∈S} c_i²``.
        slope: ``[B, T]`` upper bounds on ``K_S`` (``‖A_{V∖S}‖·P``; ``L(x, γ)`` for ``S = ∅``, 0 for ``S = V``);
            ``inf`` for a candidate that was not certified for that input.
        best: ``[B]`` index of the candidate giving ``value``.
        lipschitz: ``[B]`` ``L(x, γ)`` as :func:`~splitz_fast.bounds.lipschitz.lipschitz_bound` computes it.
        kind: per input ``"identity"``, ``"exact"`` or ``"probabilistic"`` (any probabilistic norm used).
        failure_prob: per input, the summed δ of its probabilistic norms (add to α).
    """

    value: torch.Tensor
    gamma: torch.Tensor
    names: tuple[str, ...]
    clip_sq: torch.Tensor
    slope: torch.Tensor
    best: torch.Tensor
    lipschitz: torch.Tensor
    kind: list[str]
    failure_prob: list[float]
    candidates: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [B, T] Δ of each candidate

    def radius(self, radius_latent: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B] radius, [B] candidate index)``: ``max_S min(γ, √(R² − C_S)/K_S)`` for latent radii ``R`` (scalar or
        ``[B]``), every term certified (see the module docstring, rounding included)."""
        u = UNIT_ROUNDOFF_64
        r = torch.as_tensor(radius_latent, dtype=torch.float64).expand(self.value.shape[0]).clamp_min(0)
        room = (r * r * (1 - 4 * u)).unsqueeze(1) - self.clip_sq
        gamma = self.gamma.unsqueeze(1).expand_as(room)
        rho = torch.where(self.slope > 0, room.clamp_min(0).sqrt() / self.slope * (1 - 16 * u), gamma)
        per = torch.where(room > 0, torch.minimum(rho, gamma), torch.zeros_like(room))
        best, index = per.max(dim=1)
        return best, index


def _clip(mode: int, values: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    if mode == 0:
        return t
    return torch.minimum(t.clamp_min(0), theta_broadcast(mode, values, t))


def clipped_moves(left: LeftHalf, bounds: BallBounds, point: BallBounds) -> torch.Tensor:
    """``[B, *out_shape]`` float64 ``c_i ≥ sup_{x' ∈ B(x, γ)} |f_L(x')_i − f_L(x)_i|`` from the last layer's ball bounds
    (``bounds``) and the bounds of the centre (``point``: :func:`ball_bounds` at γ = 0); 0 off the varying mask."""
    k = left.depth - 1
    lb, ub, lo, hi = bounds.lower[k], bounds.upper[k], point.lower[k], point.upper[k]
    act = left.activation(k)
    mode, values = theta_mode(None if act is None else act.threshold, lb)
    f_lb, f_ub, f_lo, f_hi = (_clip(mode, values, t) for t in (lb, ub, lo, hi))
    c = torch.minimum(torch.maximum(f_ub - f_lo, f_hi - f_lb), f_ub - f_lb).clamp_min(0)
    return torch.where(bounds.masks[k], c, torch.zeros_like(c))


def _row_norms(op: MaskedAffine, like: torch.Tensor) -> torch.Tensor:
    """``‖a_i‖`` of every row of the (scaled, input-masked) operator, ``[1 or B, *out_shape]`` (for choosing S only)."""
    probe = torch.zeros(1, *op.in_shape, dtype=torch.float64, device=like.device)
    return first_layer_row_norms(op.layer, op.in_factor, probe)


def _estimate_norms(op: MaskedAffine, iters: int) -> torch.Tensor:
    """``[op.batch]`` power-iteration *lower estimates* of ``‖A_b‖`` (ranking only, never a certificate)."""
    gen = torch.Generator(device=op.weight.device).manual_seed(0)
    v = torch.randn((op.batch, *op.in_shape), dtype=torch.float64, device=op.weight.device, generator=gen)
    with torch.no_grad():
        for _ in range(iters):
            v = op.gram_matvec(v)
            v = v / v.flatten(1).norm(dim=1).clamp_min(1e-300).view(-1, *([1] * (v.ndim - 1)))
        return op.matvec(v).flatten(1).norm(dim=1)


def _sub_operator(left: LeftHalf, bounds: BallBounds, input_shape, rows: torch.Tensor, keep: torch.Tensor):
    """The last layer's ``A_{V∖S}`` for the inputs ``rows`` (``[n]`` batch indices) with out masks ``keep``."""
    k = left.depth - 1
    shape = input_shape if k == 0 else tuple(bounds.in_mask(k).shape[1:])
    in_mask = None if k == 0 else bounds.in_mask(k)[rows]
    return MaskedAffine(left.layers[k], shape, out_mask=keep, in_mask=in_mask,
                        in_scale=bounds.input_scale if k == 0 else None, batch=int(rows.numel()))


@torch.no_grad()
def displacement_bound(
    left: LeftHalf,
    x: torch.Tensor,
    gamma: float | torch.Tensor,
    *,
    method: str = "auto",
    ratios: Sequence[float] = DEFAULT_RATIOS,
    sets: Sequence[torch.Tensor] | None = None,
    certify: int | None = 1,
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> DisplacementBound:
    """``Δ(x, γ)`` for each input of ``x: [B, *input_shape]`` (see the module docstring for the proof).

    Args:
        gamma: scalar or ``[B]`` ball radii in raw input units, ≥ 0.
        method: how each spectral norm is bounded, as in :func:`~splitz_fast.bounds.lipschitz.lipschitz_bound`
            (``"auto"``, ``"exact"``, ``"probabilistic"``; ``delta`` per probabilistic norm).
        ratios: thresholds τ of the candidate sets ``S_τ`` (ignored when ``sets`` is given).
        sets: explicit candidate sets instead, each a bool ``[B or 1, *out_shape]`` (intersected with ``V``).
        certify: how many of the ``S_τ`` / ``sets`` (ranked by an uncertified estimate) get a proven norm per input;
            ``None`` for all. ``S = ∅`` and ``S = V`` are always included.
    Returns:
        :class:`DisplacementBound`; ``value ≤ L(x, γ)·γ`` always (the ``S = ∅`` member).
    """
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    batch = x.shape[0]
    u = UNIT_ROUNDOFF_64
    if left.depth == 0:
        g = torch.as_tensor(gamma, dtype=torch.float64).flatten().expand(batch).clone()
        ones = torch.ones(batch, 1, dtype=torch.float64)
        return DisplacementBound(g.clone(), g, ("lipschitz",), torch.zeros(batch, 1, dtype=torch.float64), ones,
                                 torch.zeros(batch, dtype=torch.long), ones[:, 0], ["identity"] * batch,
                                 [0.0] * batch, g.clone().unsqueeze(1))
    factor_args = dict(method=method, delta=delta, power_iters=power_iters, exact_max_dim=exact_max_dim, generator=generator)
    bounds = ball_bounds(left, x, gamma)
    point = ball_bounds(left, x, 0.0)
    g = bounds.gamma.cpu()
    input_shape = tuple(x.shape[1:])
    ops = masked_operators(left, bounds, input_shape, batch, bounds.input_scale)
    # S = ∅: L(x, γ) exactly as lipschitz_bound computes it.
    lip, kinds, failures = _bound_factors(ops, batch, **factor_args)
    n_prob = [int(k == PROBABILISTIC) for k in kinds]
    failures = list(failures)
    # P: the earlier layers' product (depth ≥ 2), the factor that carries ‖h' − h‖ ≤ P t.
    prefix = torch.ones(batch, dtype=torch.float64)
    if left.depth > 1:
        prefix, pkinds, pfail = _bound_factors(ops[:-1], batch, **factor_args)
        n_prob = [n + int(k == PROBABILISTIC) for n, k in zip(n_prob, pkinds)]
        failures = [a + b for a, b in zip(failures, pfail)]

    c = clipped_moves(left, bounds, point)  # [B, *out]
    mask = bounds.masks[-1]
    flat_c = c.flatten(1)
    n_terms = flat_c.shape[1]
    sq_margin = 1 + 2 * _gamma_n(n_terms + 3)

    # Candidate sets S (beyond ∅ and V), as bool [B, *out] within V.
    if sets is not None:
        cand = [s.to(torch.bool).expand_as(mask) & mask for s in sets]
        names = tuple(f"set{i}" for i in range(len(cand)))
    else:
        rn = _row_norms(ops[-1], c)
        reach = rn * (prefix * g).to(rn.device).view(-1, *([1] * (rn.ndim - 1)))
        ratio = torch.where(reach > 0, c / reach.where(reach > 0, torch.ones_like(reach)),
                            torch.full_like(c, math.inf))
        cand = [mask & (ratio <= tau) for tau in ratios]
        names = tuple(f"ratio<={tau:g}" for tau in ratios)
    names = ("lipschitz", "clip") + names
    n_cand = len(names)
    clip_sq = torch.empty(batch, n_cand, dtype=torch.float64)
    slope = torch.full((batch, n_cand), math.inf, dtype=torch.float64)
    clip_sq[:, 0], slope[:, 0] = 0.0, lip
    clip_sq[:, 1], slope[:, 1] = flat_c.square().sum(1).cpu() * sq_margin, 0.0
    if cand:
        s_all = torch.stack(cand, 1)  # [B, T, *out]
        clip_sq[:, 2:] = (flat_c.unsqueeze(1).square() * s_all.flatten(2)).sum(2).cpu() * sq_margin
        keep = mask.unsqueeze(1) & ~s_all
        sizes_s = s_all.flatten(2).sum(2).cpu()
        sizes_v = mask.flatten(1).sum(1).cpu().unsqueeze(1)
        # Degenerate sets: S = ∅ is the "lipschitz" member, S = V the "clip" member.
        empty, full = sizes_s == 0, sizes_s == sizes_v
        slope[:, 2:] = torch.where(empty, lip.unsqueeze(1), slope[:, 2:])
        slope[:, 2:] = torch.where(full & ~empty, torch.zeros_like(slope[:, 2:]), slope[:, 2:])
        todo = ~(empty | full)  # [B, T]
        b_idx, t_idx = todo.nonzero(as_tuple=True)
        if b_idx.numel():
            if certify is not None and certify < len(cand):
                est_op = _sub_operator(left, bounds, input_shape, b_idx.to(mask.device), keep[b_idx, t_idx])
                est = _estimate_norms(est_op, ESTIMATE_ITERS).cpu() * prefix[b_idx]
                score = torch.full((batch, len(cand)), math.inf, dtype=torch.float64)
                score[b_idx, t_idx] = clip_sq[b_idx, 2 + t_idx] + (est * g[b_idx]) ** 2
                order = score.argsort(dim=1)[:, :certify]
                chosen = torch.zeros_like(todo)
                chosen.scatter_(1, order, True)
                todo = todo & chosen
                b_idx, t_idx = todo.nonzero(as_tuple=True)
            op = _sub_operator(left, bounds, input_shape, b_idx.to(mask.device), keep[b_idx, t_idx])
            norms, ckinds, cfail = _bound_factors([op], int(b_idx.numel()), **factor_args)
            slope[b_idx, 2 + t_idx] = norms * prefix[b_idx] * (1 + 4 * u)
            for b, kd, fp in zip(b_idx.tolist(), ckinds, cfail):
                n_prob[b] += int(kd == "probabilistic")
                failures[b] += fp
    # Δ of each candidate: √(C_S + (K_S γ)²)·(1 + 8u); the S = ∅ member is fl(L γ) (see the module docstring).
    gg = g.unsqueeze(1)
    finite = torch.isfinite(slope)
    prod = torch.where(finite, slope * gg, torch.full_like(slope, math.inf))
    each = (clip_sq + prod.square()).sqrt() * (1 + 8 * u)
    each[:, 0] = lip * g
    value, best = each.min(dim=1)
    kind = [EXACT if n == 0 else PROBABILISTIC for n in n_prob]
    return DisplacementBound(value, g, names, clip_sq, slope, best, lip, kind, failures, each)


@dataclass
class DisplacementRadius:
    """The certified radius of one input from :func:`displacement_radius`.

    Attributes:
        radius: the certified radius (raw input units), ≥ ``baseline.radius``.
        gamma: the ball radius whose bound gave it.
        displacement: ``Δ(x, γ)`` at that γ (``nan`` when the baseline won).
        candidate: the candidate set behind it (``"baseline"`` when Theorem 1's search won).
        kind: ``"identity"``, ``"exact"`` or ``"probabilistic"`` (any probabilistic norm among the evaluations).
        failure: summed failure probability of every probabilistic bound evaluated, baseline included (add to α).
        evaluations: γ values bounded, baseline included.
        baseline: the :class:`~splitz_fast.bounds.radius.RadiusResult` of Theorem 1's search on the same input.
    """

    radius: float
    gamma: float
    displacement: float
    candidate: str
    kind: str
    failure: float
    evaluations: int
    baseline: RadiusResult


def displacement_radius(
    left: LeftHalf,
    x: torch.Tensor,
    radius_latent: float,
    *,
    options: BoundOptions | None = None,
    baseline: RadiusResult | None = None,
    generator: torch.Generator | None = None,
    gamma_steps: int = 10,
    max_expansions: int = 8,
    growth: float = 2.0,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    certify: int | None = 1,
) -> DisplacementRadius:
    """Largest certified γ found for one input ``x`` (no batch dimension) whose latent radius is ``radius_latent``.

    1. Theorem 1's search (:class:`~splitz_fast.bounds.radius.RadiusSearch` under ``options``; or ``baseline`` if given)
       gives ``r₀ = max_γ min(R/L(x, γ), γ)`` over its γ's — a certified radius, so the result is never below it.
    2. From ``lo = r₀``, γ grows by ``growth`` while ``Δ``'s radius at γ is γ itself (``Δ(x, γ) < R``), at most
       ``max_expansions`` times and never past ``options.gamma_max``; then ``gamma_steps`` bisection steps between the
       last γ that held and the first that did not. Every evaluated γ certifies ``max_S min(γ, √(R² − C_S)/K_S)``
       (:meth:`DisplacementBound.radius`); the result is the best of them and ``r₀``.

    Probabilistic norms share ``options.bound_delta`` over the most norms the search can bound (union bound); the
    reported ``failure`` adds the baseline's.
    """
    opts = options if options is not None else BoundOptions()
    if baseline is None:
        baseline = RadiusSearch.of_left(left, opts).search(x, radius_latent, generator)
    baseline_kind = BoundKind.parse(baseline.kind)
    best = DisplacementRadius(baseline.radius, baseline.gamma, math.nan, "baseline",
                              IDENTITY if baseline_kind == IDENTITY_KIND else baseline_kind.method,
                              baseline.failure, baseline.evaluations, baseline)
    if left.depth == 0 or radius_latent <= 0:
        return best
    max_evals = max_expansions + gamma_steps
    per_eval = 2 * left.depth + (len(ratios) if certify is None else min(certify, len(ratios)))
    delta_norm = opts.bound_delta / (max_evals * per_eval)
    failure, evaluations, kinds = baseline.failure, baseline.evaluations, set()

    def holds(gamma: float) -> bool:
        nonlocal best, failure, evaluations
        bound = displacement_bound(left, x.unsqueeze(0), gamma, method=opts.bound_method, ratios=ratios,
                                   certify=certify, delta=delta_norm, power_iters=opts.power_iters,
                                   exact_max_dim=opts.exact_max_dim, generator=generator)
        evaluations += 1
        failure += bound.failure_prob[0]
        kinds.add(bound.kind[0])
        radius, index = bound.radius(radius_latent)
        r = float(radius[0])
        if r > best.radius:
            best = DisplacementRadius(r, gamma, float(bound.value[0]), bound.names[int(index[0])], "", 0.0, 0,
                                      baseline)
        return r >= gamma

    lo, hi = baseline.radius, None
    probe = lo * growth if lo > 0 else opts.gamma_max * 2.0 ** -max_expansions
    for _ in range(max_expansions):
        if probe > opts.gamma_max:
            probe = opts.gamma_max
        if holds(probe):
            lo = probe
            if probe >= opts.gamma_max:
                break
            probe *= growth
        else:
            hi = probe
            break
    if hi is not None:
        for _ in range(gamma_steps):
            mid = (lo + hi) / 2
            if holds(mid):
                lo = mid
            else:
                hi = mid
    kind = best.kind if best.candidate == "baseline" else (PROBABILISTIC if PROBABILISTIC in kinds else EXACT)
    return DisplacementRadius(best.radius, best.gamma, best.displacement, best.candidate, kind, failure, evaluations,
                              baseline)
