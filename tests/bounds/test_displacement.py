"""Soundness and tightness of the latent-displacement bound (splitz_fast/bounds/displacement.py).

Oracles never use the library's bound code: a float64 copy of ``f_L`` evaluated at sampled and adversarially pushed
points in the ball, a dense autograd Jacobian with its SVD for the spectral norms, per-neuron clipped ranges from the
exact ball formula ``z ± γ‖a_i‖``, and the paper's toy example worked by hand.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.bounds.displacement import displacement_bound, displacement_radius
from splitz_fast.bounds.lipschitz import lipschitz_bound
from splitz_fast.bounds.radius import BoundOptions, RadiusSearch
from test_lipschitz import _clipped  # a ClippedReLU with random thresholds in [low, high)


def build_left(name: str, seed: int = 0) -> sz.LeftHalf:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "linear-small-theta":  # many varying neurons with tiny clipped ranges
        return sz.LeftHalf([nn.Linear(4, 12)], [_clipped((12,), 0.01, 0.05, gen)], input_shape=(4,))
    if name == "linear-std-inf":  # plain ReLU (θ = ∞) behind a standardization
        return sz.LeftHalf([nn.Linear(5, 6)], [sz.ClippedReLU(math.inf)],
                           standardize=sz.Standardize(torch.rand(5).tolist(), (0.5 + torch.rand(5)).tolist()),
                           input_shape=(5,))
    if name == "conv-std-elementwise":
        conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        return sz.LeftHalf([conv], [_clipped((3, 4, 4), 0.05, 0.6, gen)],
                           standardize=sz.Standardize([0.3, 0.6], [0.2, 0.5]), input_shape=(2, 7, 7))
    if name == "conv-pool-linear":  # two layers: conv, clipped ReLU, max-pool, Linear, clipped ReLU
        conv, fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(2 * 3 * 3, 5)
        return sz.LeftHalf([conv, fc], [_clipped((2,), 0.3, 1.0, gen), _clipped((), 0.05, 0.1, gen)],
                           standardize=sz.Standardize([0.5], [0.3]), input_shape=(1, 6, 6),
                           pools=[nn.MaxPool2d(2), None])
    if name == "mlp-two-clipped":  # two layers, the first one expansive (P > 1)
        l1, l2 = nn.Linear(4, 8), nn.Linear(8, 6)
        l1.weight.data *= 4
        return sz.LeftHalf([l1, l2], [_clipped((8,), 0.5, 1.0, gen), _clipped((6,), 0.1, 0.4, gen)], input_shape=(4,))
    if name == "mlp-last-linear":  # two layers, no activation after the last one
        return sz.LeftHalf([nn.Linear(4, 6), nn.Linear(6, 3)], [_clipped((6,), 0.05, 0.3, gen), None],
                           input_shape=(4,))
    raise KeyError(name)


ONE_LAYER = ["linear-small-theta", "linear-std-inf", "conv-std-elementwise"]
TWO_LAYER = ["conv-pool-linear", "mlp-two-clipped", "mlp-last-linear"]
GAMMAS = [0.0, 0.05, 0.3, 1.5]


def _input(left: sz.LeftHalf, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    # float32 values (the library sees x.float()), held in float64 for the oracles
    return (torch.rand(1, *left.input_shape, generator=gen, dtype=torch.float64) * 1.2 - 0.1).float().double()


def _moves(left64: sz.LeftHalf, x: torch.Tensor, gamma: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(‖x' − x‖, ‖f_L(x') − f_L(x)‖)`` over points of the closed ball: random directions at radius γ, random points
    inside, and projected gradient ascent on ``‖f_L(x') − f_L(x)‖²`` from several starts."""
    gen = torch.Generator().manual_seed(seed)
    n, dim = 256, x[0].numel()
    d = torch.randn(2 * n, dim, generator=gen, dtype=torch.float64)
    d = d / d.norm(dim=1, keepdim=True)
    scale = torch.cat([torch.ones(n, dtype=torch.float64),
                       torch.rand(n, generator=gen, dtype=torch.float64) ** (1 / dim)])
    deltas = [gamma * scale[:, None] * d]
    with torch.no_grad():
        u0 = left64(x)
    delta = (gamma * d[:8]).clone().requires_grad_(True)
    for _ in range(40):
        obj = (left64(x + delta.view(-1, *x.shape[1:])) - u0).flatten(1).square().sum()
        (grad,) = torch.autograd.grad(obj, delta)
        with torch.no_grad():
            step = grad / grad.norm(dim=1, keepdim=True).clamp_min(1e-30)
            delta += 0.25 * gamma * step
            norm = delta.norm(dim=1, keepdim=True)
            delta *= torch.where(norm > gamma, gamma / norm.clamp_min(1e-300), torch.ones_like(norm))
        deltas.append(delta.detach().clone())
    dx = torch.cat(deltas)
    with torch.no_grad():
        du = left64(x + dx.view(-1, *x.shape[1:])) - u0
    return dx.norm(dim=1), du.flatten(1).norm(dim=1)


def _dense(left: sz.LeftHalf, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-activation ``z(x)`` and the dense Jacobian ``A = ∂z/∂x`` of a one-layer ``f_L`` (autograd, float64)."""
    left64 = copy.deepcopy(left).double()

    def pre(v):
        h = left64.standardize(v) if left64.standardize is not None else v
        return left64.layers[0](left64.layer_input(left64.layers[0], h)).flatten(1)

    z = pre(x)[0].detach()
    jac = torch.autograd.functional.jacobian(lambda v: pre(v.view(1, *x.shape[1:]))[0], x.flatten())
    return z, jac


def _theta(left: sz.LeftHalf, z_shape) -> torch.Tensor:
    act = left.activation(left.depth - 1)
    return act.broadcast_threshold(torch.zeros(1, *z_shape, dtype=torch.float64)).expand(z_shape).flatten()


# ---------------------------------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("name", ONE_LAYER + TWO_LAYER)
@pytest.mark.parametrize("gamma", GAMMAS[1:])
def test_sampled_moves_never_exceed_bound(name, gamma):
    """(a, f, h) Every sampled or gradient-pushed point of the ball moves ``f_L`` by at most Δ, and by at most each
    candidate's ``√(C_S + K_S² ‖x' − x‖²)`` (the sub-ball form the radius uses) — for the default family and for
    random explicit sets."""
    left = build_left(name)
    x = _input(left, 0)
    out_shape = left(x.float()).shape[1:]
    gen = torch.Generator().manual_seed(8)
    sets = [torch.rand(1, *out_shape, generator=gen) < p for p in (0.25, 0.5, 0.75)]
    dist, move = _moves(copy.deepcopy(left).double(), x, gamma, seed=1)
    for bound in (displacement_bound(left, x.float(), gamma, method="exact", certify=None),
                  displacement_bound(left, x.float(), gamma, method="exact", sets=sets, certify=None)):
        assert float(move.max()) <= float(bound.value[0])
        finite = torch.isfinite(bound.slope[0])
        allowed = (bound.clip_sq[0][finite] + bound.slope[0][finite] ** 2 * dist[:, None] ** 2).sqrt()
        assert (move[:, None] <= allowed).all()


@pytest.mark.parametrize("name", ["linear-small-theta", "conv-pool-linear"])
def test_probabilistic_bound_is_reported_and_holds(name):
    left = build_left(name)
    x = _input(left, 1)
    gen = torch.Generator().manual_seed(0)
    bound = displacement_bound(left, x.float(), 0.3, method="probabilistic", certify=None, delta=1e-4,
                               generator=gen)
    assert bound.kind == ["probabilistic"] and bound.failure_prob[0] >= 1e-4
    _, move = _moves(copy.deepcopy(left).double(), x, 0.3, seed=2)
    assert float(move.max()) <= float(bound.value[0])


# ---------------------------------------------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("name", ONE_LAYER)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_against_dense_reference(name, gamma):
    """(b, f) ``S = ∅`` gives ``L·γ`` with ``L`` the top singular value of the dense masked Jacobian (never below it);
    explicit sets give ``Σ_{S∩V} c_i²`` from the exact ball formula and ``‖A_{V∖S}‖`` from a dense SVD."""
    left = build_left(name)
    x = _input(left, 2)
    z, jac = _dense(left, x)
    half = gamma * jac.norm(dim=1)
    lb, ub = z - half, z + half
    out_shape = left(x.float()).shape[1:]
    theta = _theta(left, out_shape)
    varying = (ub > 0) & (lb < theta)

    def clip(t):
        return torch.minimum(t.clamp_min(0), theta)

    c_ref = torch.where(varying, torch.maximum(clip(ub) - clip(z), clip(z) - clip(lb)), torch.zeros_like(z))
    gen = torch.Generator().manual_seed(3)
    sets = [torch.rand(1, *out_shape, generator=gen) < p for p in (0.3, 0.7)]
    bound = displacement_bound(left, x.float(), gamma, method="exact", sets=sets, certify=None)

    def sigma_max(rows):
        return float(torch.linalg.svdvals(jac[rows])[0]) if rows.any() else 0.0

    lip_ref = sigma_max(varying)
    assert lip_ref <= float(bound.slope[0, 0]) <= lip_ref * (1 + 1e-8) + 1e-12
    assert float(bound.candidates[0, 0]) == pytest.approx(lip_ref * gamma, rel=1e-8, abs=1e-12)
    clip_ref = float(c_ref.square().sum())
    assert clip_ref <= float(bound.clip_sq[0, 1]) <= clip_ref * (1 + 1e-6) + 1e-12
    for j, s in enumerate(sets):
        in_s = s.flatten() & varying
        c_s = float(c_ref[in_s].square().sum())
        assert c_s <= float(bound.clip_sq[0, 2 + j]) <= c_s * (1 + 1e-6) + 1e-12
        k_ref = sigma_max(varying & ~s.flatten())
        if in_s.any() and (varying & ~s.flatten()).any():
            assert k_ref <= float(bound.slope[0, 2 + j]) <= k_ref * (1 + 1e-8) + 1e-12


# ---------------------------------------------------------------------------------------------------------------- (c)
@pytest.mark.parametrize("name", ONE_LAYER + TWO_LAYER)
@pytest.mark.parametrize("method", ["exact", "auto"])
def test_never_worse_than_lipschitz(name, method):
    """(c) Δ ≤ lipschitz_bound·γ for every input and γ (the S = ∅ member is computed the same way)."""
    left = build_left(name)
    x = torch.cat([_input(left, s) for s in range(3)]).float()
    gammas = torch.tensor([0.0, 0.1, 0.7], dtype=torch.float64)
    bound = displacement_bound(left, x, gammas, method=method)
    lip = lipschitz_bound(left, x, gammas, method=method)
    assert torch.equal(bound.lipschitz, lip.value)
    assert (bound.value <= lip.value * gammas).all()


def test_strictly_better_where_clipping_binds():
    """(c) Many varying neurons with tiny clipped ranges (θ ≤ 0.05, γ = 1): Δ is under half of L·γ."""
    left = build_left("linear-small-theta")
    x = _input(left, 0).float()
    bound = displacement_bound(left, x, 1.0)
    lip = lipschitz_bound(left, x, 1.0)
    assert float(bound.value[0]) < 0.5 * float(lip.value[0])


# ---------------------------------------------------------------------------------------------------------------- (d)
@pytest.mark.parametrize("name", ONE_LAYER + TWO_LAYER)
def test_monotone_in_gamma_for_fixed_sets(name):
    """(d) For fixed candidate sets every member, hence their minimum, is non-decreasing in γ (up to the certified
    eigenvalues' relative slack); the ∅ and V members are so under the default family as well."""
    left = build_left(name)
    x = _input(left, 4).float()
    out_shape = left(x).shape[1:]
    gen = torch.Generator().manual_seed(5)
    sets = [torch.rand(1, *out_shape, generator=gen) < p for p in (0.2, 0.5, 0.8)]
    grid = [0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2]
    fixed = [displacement_bound(left, x, g, method="exact", sets=sets, certify=None) for g in grid]
    default = [displacement_bound(left, x, g, method="exact") for g in grid]
    for a, b in zip(fixed, fixed[1:]):
        assert (b.candidates[0] >= a.candidates[0] * (1 - 1e-8)).all()
        assert float(b.value[0]) >= float(a.value[0]) * (1 - 1e-8)
    for a, b in zip(default, default[1:]):
        assert (b.candidates[0, :2] >= a.candidates[0, :2] * (1 - 1e-8)).all()


# ---------------------------------------------------------------------------------------------------------------- (e)
def _toy(two_layers: bool) -> sz.LeftHalf:
    w1 = nn.Linear(3, 3, bias=False)
    w1.weight.data = torch.diag(torch.tensor([2.0, 2.0, 1.0]))
    if not two_layers:
        return sz.LeftHalf([w1], [sz.ClippedReLU(1.0)], input_shape=(3,))
    w2 = nn.Linear(3, 1, bias=False)
    w2.weight.data = torch.ones(1, 3)
    return sz.LeftHalf([w1, w2], [sz.ClippedReLU(1.0), None], input_shape=(3,))


@pytest.mark.parametrize("two_layers", [False, True])
@pytest.mark.parametrize("x3, expected", [(0.0, 0.1), (-0.05, 0.05), (-0.08, 0.02)])
def test_paper_toy_example_by_hand(two_layers, x3, expected):
    """(e) SPEC §1 step 3: W1 = diag(2, 2, 1), θ = 1, x = [1, −1, x₃], γ = 0.1 (and W2 = [1, 1, 1], no activation).
    Neurons 1 and 2 are constant on the ball (z₁ ∈ [1.8, 2.2] ≥ θ, z₂ ∈ [−2.2, −1.8] ≤ 0), so L = 1 (local bound 1).
    Neuron 3 has z₃ ∈ [x₃ − 0.1, x₃ + 0.1]: its clipped output moves by at most max(min(x₃ + 0.1, 1) − max(x₃, 0),
    …) = 0.1 at x₃ = 0, 0.05 at x₃ = −0.05 (it can only rise from 0 to 0.05), 0.02 at x₃ = −0.08 — the true
    suprema, where Theorem 1 gives L·γ = 0.1."""
    left = _toy(two_layers)
    x = torch.tensor([[1.0, -1.0, x3]])
    bound = displacement_bound(left, x, 0.1, method="exact", certify=None)
    lip = lipschitz_bound(left, x, 0.1, method="exact")
    assert float(lip.value[0]) == pytest.approx(1.0, rel=1e-9)
    x3_32 = float(x[0, 2])  # the float32 value the bound sees
    exact = 0.1 + min(x3_32, 0.0)  # the hand formula, at that value
    assert exact == pytest.approx(expected, rel=1e-6)
    assert exact <= float(bound.value[0]) <= exact * (1 + 1e-7)  # slack: the ball bounds' 1e-10 margins
    # The bound is attained: x' = x + 0.1·e₃ moves f_L by exactly `expected`.
    left64 = copy.deepcopy(left).double()
    up = left64(x.double() + torch.tensor([[0.0, 0.0, 0.1]], dtype=torch.float64)) - left64(x.double())
    assert float(up.detach().norm()) == pytest.approx(expected, rel=1e-6)


def test_depth_zero_is_identity():
    left = sz.LeftHalf([], [], input_shape=(3,))
    x = torch.rand(2, 3)
    bound = displacement_bound(left, x, torch.tensor([0.2, 0.7], dtype=torch.float64))
    assert bound.value.tolist() == [0.2, 0.7] and bound.kind == ["identity"] * 2
    result = displacement_radius(left, x[0], 0.9)
    assert result.radius == 0.9 and result.kind == "identity"


# ---------------------------------------------------------------------------------------------------------------- (g)
@pytest.mark.parametrize("name", ONE_LAYER + TWO_LAYER)
@pytest.mark.parametrize("radius_latent", [0.05, 0.4])
def test_radius_never_below_lipschitz_radius_and_sound(name, radius_latent):
    """(g) On a SplitModel's f_L: the displacement radius ≥ RadiusSearch's Theorem-1 radius (computed independently),
    and no sampled or gradient-pushed point strictly inside the displacement radius moves the latent by R or more."""
    left = build_left(name)
    x = _input(left, 6)[0]
    model = sz.SplitModel(left, nn.Sequential(nn.Flatten(), nn.Linear(left(x.float()[None]).numel(), 3)), 3)
    opts = BoundOptions(bound_method="exact")
    lip = RadiusSearch(model, opts).search(x.float(), radius_latent, None)
    result = displacement_radius(model.left, x.float(), radius_latent, options=opts, gamma_steps=6)
    assert result.radius >= lip.radius
    assert result.baseline.radius == lip.radius
    assert result.kind == "exact" and result.failure == 0.0
    r = result.radius * (1 - 1e-9)
    _, move = _moves(copy.deepcopy(left).double(), x.unsqueeze(0), r, seed=7)
    assert float(move.max()) < radius_latent


def test_radius_strictly_larger_where_clipping_binds():
    """(g) Small θ: the displacement radius beats Theorem 1's by a wide margin (here the latent can move by at most
    ‖θ‖ < R at all, so the search runs to gamma_max)."""
    left = build_left("linear-small-theta")
    x = _input(left, 0)[0].float()
    opts = BoundOptions(bound_method="exact", gamma_max=4.0)
    lip = RadiusSearch.of_left(left, opts).search(x, 0.2, None)
    result = displacement_radius(left, x, 0.2, options=opts)
    assert result.radius > 2 * lip.radius
    assert result.candidate != "baseline"
    assert result.radius <= opts.gamma_max
