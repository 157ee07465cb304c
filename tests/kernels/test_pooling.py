"""Max-pooling inside f_L: what is refused, that the bounds pass soundly through a pool, and that the certificate
bound equals the product of dense masked factors (the pooled varying mask V as the next factor's input mask) and
dominates the Jacobian norm of f_L at points of the ball."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.bounds.intervals import pool_interval
from splitz_fast.bounds.lipschitz import masked_operators


def pooled_left(seed: int = 0, threshold: float = 0.6) -> sz.LeftHalf:
    """conv(1→3, 3×3, p1) on 6×6 → clipped ReLU → 2×2 max-pool → conv(3→4, 2×2) → clipped ReLU → 2×2 max-pool →
    linear(4 → 5) → clipped ReLU: two pools, both kinds of layer after a pool."""
    torch.manual_seed(seed)
    c1, c2, fc = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 4, 2), nn.Linear(4, 5)
    acts = [sz.ClippedReLU(threshold), sz.ClippedReLU(threshold), sz.ClippedReLU(threshold)]
    return sz.LeftHalf([c1, c2, fc], acts, input_shape=(1, 6, 6), pools=[nn.MaxPool2d(2), nn.MaxPool2d(2), None])


def test_only_non_overlapping_max_pools_are_accepted():
    conv, fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(2 * 3 * 3, 4)
    for bad, kind in [(nn.MaxPool2d(3, stride=2), ValueError), (nn.MaxPool2d(2, padding=1), ValueError),
                      (nn.MaxPool2d(2, dilation=2), ValueError), (nn.AvgPool2d(2), TypeError)]:
        with pytest.raises(kind, match="non-overlapping|MaxPool2d"):
            sz.LeftHalf([conv, fc], input_shape=(1, 6, 6), pools=[bad, None])
    with pytest.raises(ValueError, match="belongs to f_R"):
        sz.LeftHalf([conv], input_shape=(1, 6, 6), pools=[nn.MaxPool2d(2)])
    with pytest.raises(ValueError, match="pools"):
        sz.LeftHalf([conv, fc], input_shape=(1, 6, 6), pools=[None])
    net = nn.Sequential(conv, nn.ReLU(), nn.MaxPool2d(3, stride=2), nn.Flatten(), nn.Linear(2 * 2 * 2, 4))
    with pytest.raises(ValueError, match="non-overlapping"):
        sz.split_sequential(net, 2, num_classes=4, input_shape=(1, 6, 6))


@pytest.mark.parametrize("variant,split", [("splitz", 3), ("advertorch", 2), ("advertorch", 3)])
def test_split_keeps_the_networks_function(variant, split):
    """With θ = ∞, f_R(f_L(x)) is the unsplit network, pools included."""
    torch.manual_seed(0)
    network = sz.zoo.models.lenet_network(variant).eval()
    reference = copy.deepcopy(network)
    model = sz.split_sequential(network, split, num_classes=10, input_shape=(1, 28, 28), threshold=float("inf"))
    assert any(model.left.pool(k) is not None for k in range(model.left.depth))
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model.right(model.left(x)), reference(x))


@pytest.mark.parametrize("seed", range(4))
def test_pool_interval_contains_every_pooled_point(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 3, 6, 6)
    theta = torch.tensor(0.8, dtype=torch.float64)
    # Activation intervals inside [0, θ], some of them points (constant neurons), some saturated at θ.
    a = (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8)
    b = (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    point = torch.rand(shape, generator=gen) < 0.5
    hi = torch.where(point, lo, hi)
    saturated = torch.rand(shape, generator=gen) < 0.1
    lo, hi = torch.where(saturated, theta, lo), torch.where(saturated, theta, hi)
    center, radius = (lo + hi) / 2, (hi - lo) / 2
    pc, pr, varying = pool_interval(nn.MaxPool2d(2), center, radius, theta)
    for _ in range(50):
        t = torch.rand(shape, generator=gen, dtype=torch.float64)
        pooled = nn.functional.max_pool2d(lo + t * (hi - lo), 2)
        assert bool((pooled >= pc - pr).all()) and bool((pooled <= pc + pr).all())
        # A pooled output declared constant takes exactly its center.
        assert torch.equal(pooled[~varying], pc[~varying])
    # A window with a saturated entry is constant at θ; a window of points is constant.
    window_saturated = nn.functional.max_pool2d(saturated.double(), 2) > 0
    window_points = nn.functional.max_pool2d((~point & ~saturated).double(), 2) == 0
    assert not bool(varying[window_saturated | window_points].any())


@pytest.mark.parametrize("gamma", [pytest.param(0.05, marks=pytest.mark.slow), 0.3,
                                   pytest.param(1.0, marks=pytest.mark.slow)])  # ~14 s each on 2 CPU cores
def test_bounds_after_a_pool_contain_sampled_pre_activations(gamma):
    left = pooled_left()
    x = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    bounds = sz.ball_bounds(left, x, gamma)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(200):
            d = torch.randn(x.shape, generator=gen)
            d = d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * gamma * torch.rand(2, 1, 1, 1, generator=gen)
            h = (x + d).double()
            left64 = copy.deepcopy(left).double()
            for k, (layer, act, pool) in enumerate(zip(left64.layers, left64.activations, left64.pools)):
                z = layer(left64.layer_input(layer, h))
                assert bool((z >= bounds.lower[k]).all()) and bool((z <= bounds.upper[k]).all())
                h = pool(act(z))


def _dense_factor(op, b: int) -> torch.Tensor:
    """``I_out W I_in`` of one masked factor as a dense float64 matrix, by applying the layer to basis vectors."""
    n = torch.Size(op.in_shape).numel()
    eye = torch.eye(n, dtype=torch.float64).view(n, *op.in_shape)
    layer = copy.deepcopy(op.layer).double()
    with torch.no_grad():
        cols = layer(eye.flatten(1) if isinstance(layer, nn.Linear) else eye)
    if layer.bias is not None:
        cols = cols - layer.bias.view(1, -1, *([1] * (cols.ndim - 2)))
    dense = cols.flatten(1).T
    if op.out_mask is not None:
        dense = op.out_mask[b].flatten().double()[:, None] * dense
    if op.in_mask is not None:
        dense = dense * op.in_mask[b].flatten().double()[None, :]
    return dense.detach()


@pytest.mark.parametrize("gamma", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 1, 2])  # seed 0: ~15 s per γ on 2 cores
def test_exact_bound_with_pools_matches_dense_factors_and_dominates_the_jacobian(seed, gamma):
    left = pooled_left(seed)
    x = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(seed))
    bound = sz.lipschitz_bound(left, x, gamma, method="exact")
    assert bound.kind == ["exact", "exact"]
    bounds = sz.ball_bounds(left, x, gamma)
    ops = masked_operators(left, bounds, (1, 6, 6), 2, None)
    assert ops[1].in_shape == (3, 3, 3) and ops[2].in_shape == (4, 1, 1)
    for b in range(2):
        product = 1.0
        for op in ops:
            product *= float(torch.linalg.matrix_norm(_dense_factor(op, b), ord=2))
        assert product <= float(bound.value[b]) <= product * (1 + 1e-6)
        # Soundness on its own terms: the Jacobian norm of f_L at points of the ball never exceeds the bound.
        left64 = copy.deepcopy(left).double()
        gen = torch.Generator().manual_seed(10 + b)
        for _ in range(30):
            d = torch.randn(1, 6, 6, generator=gen, dtype=torch.float64)
            point = x[b].double() + d / d.norm() * gamma * float(torch.rand(1, generator=gen))
            jac = torch.autograd.functional.jacobian(lambda v: left64(v.unsqueeze(0))[0], point)
            assert float(torch.linalg.matrix_norm(jac.reshape(5, 36), ord=2)) <= float(bound.value[b])


def test_the_pooled_mask_tightens_the_bound():
    """With a large threshold gap most pooled outputs of a saturated layer are constant: V must then drop columns of
    the next factor, so the local bound falls below the bound without it (masks of layer 1 passed through unpooled
    would be the wrong shape; the unmasked next factor is the honest comparison)."""
    left = pooled_left(0, threshold=0.05)  # low θ: most first-layer neurons saturate
    x = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(0)) + 0.5
    bounds = sz.ball_bounds(left, x, 0.01)
    assert not bool(bounds.in_mask(1).all())  # some pooled outputs are constant
    ops = masked_operators(left, bounds, (1, 6, 6), 1, None)
    with_v = float(torch.linalg.matrix_norm(_dense_factor(ops[1], 0), ord=2))
    ops[1].in_mask = None
    without_v = float(torch.linalg.matrix_norm(_dense_factor(ops[1], 0), ord=2))
    assert with_v < without_v


@pytest.mark.slow  # ~1.5 min on 2 CPU cores
def test_training_estimate_and_certify_run_through_pools():
    torch.manual_seed(0)
    model = sz.lenet(split_index=3, variant="splitz").eval()
    x = torch.rand(2, 1, 28, 28)
    state = sz.PowerIterationState()
    estimate = sz.lipschitz_estimate(model.left, x, 0.1, power_iters=3, state=state)
    assert estimate.shape == (2,) and bool(torch.isfinite(estimate).all())
    assert [tuple(v.shape) for v in state.vectors] == [(1, 28, 28), (32, 28, 28), (64, 14, 14)]
    # A tiny σ makes the untrained f_R decide, so the γ search and the sound bound run.
    result = sz.Smoother(model, 1e-3).certify(x[0], n0=20, n=200, alpha=0.01, batch_size=100, seed=0)
    assert result.prediction >= 0 and result.bound_kind.startswith("local") and result.lipschitz > 0
