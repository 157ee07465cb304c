"""Clipped-ReLU thresholds of every accepted shape are read the same way by the forward pass, the bound code and the
kernels (kernels/thresholds.py), and the certificate bound holds for each: a θ read per row by the forward pass but
per channel by the bounds gave "local" constants far below the true one (a soundness hole this suite guards against).

The activation below is 4×4×4 (C = H = W), so a per-row, per-column or per-channel misreading of θ cannot hide
behind a shape mismatch.
"""
from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn as nn  # noqa: E402

import splitz_fast as sz  # noqa: E402
from splitz_fast.bounds.intervals import ball_bounds  # noqa: E402
from splitz_fast.kernels.interval_clip import interval_clip_reference, interval_clip_triton  # noqa: E402
from splitz_fast.kernels.thresholds import normalize_threshold  # noqa: E402
from _helpers import kernel_devices  # noqa: E402

C = H = W = 4
SAMPLE = (C, H, W)
# Every shape that broadcasts to the activation (1-D means per channel, ClippedReLU's convention).
ACCEPTED = [(), (1,), (C,), (C, 1, 1), (1, H, W), (H, 1), (1, W), (W,), (1, 1, W), (H, W), (C, H, 1), (C, 1, W),
            (C, H, W), (1, 1, 1)]
REFUSED = [(3,), (C + 1, 1), (2, C, H, W), (1, C, H, W), (H, W + 1)]


def _thresholds(shape, seed) -> torch.Tensor:
    """About half the thresholds 0 (those neurons are constant), the others in [0.5, 1.5]: a misread θ switches whole
    groups of varying neurons off in the bound."""
    gen = torch.Generator().manual_seed(seed)
    values = 0.5 + torch.rand(shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < 0.5, torch.zeros(()), values)


def _elementwise_theta(act: sz.ClippedReLU) -> torch.Tensor:
    """θ per element as the forward pass applies it (probe: ReLU_θ(huge) = θ)."""
    return act(torch.full((1, *SAMPLE), 1e9))[0]


def _left_half(shape, seed: int, two_layers: bool) -> sz.LeftHalf:
    torch.manual_seed(seed)
    layers = [nn.Conv2d(2, C, 3, padding=1)]
    acts = [sz.ClippedReLU(1.0, shape=shape)]
    if two_layers:
        layers.append(nn.Conv2d(C, C, 3, padding=1))
        acts.append(sz.ClippedReLU(1.0, shape=shape))
    with torch.no_grad():
        for act, s in zip(acts, (seed, seed + 1)):
            act.threshold.copy_(_thresholds(shape, s))
    return sz.LeftHalf(layers, acts, input_shape=(2, H, W))


def test_normalize_threshold_refuses_ambiguous_or_unbroadcastable_shapes():
    for shape in REFUSED:
        with pytest.raises(ValueError, match="threshold"):
            normalize_threshold(torch.ones(shape), SAMPLE)
    act = sz.ClippedReLU(1.0, shape=(3,))
    with pytest.raises(ValueError, match="per channel"):
        act(torch.zeros(1, *SAMPLE))
    left = sz.LeftHalf([nn.Conv2d(2, C, 3, padding=1)], [sz.ClippedReLU(1.0, shape=(3,))], input_shape=(2, H, W))
    with pytest.raises(ValueError, match="per channel"):
        ball_bounds(left, torch.zeros(1, 2, H, W), 0.1)


@pytest.mark.parametrize("shape", ACCEPTED, ids=str)
def test_forward_reads_theta_as_torch_broadcasting_with_per_channel_1d(shape):
    act = sz.ClippedReLU(1.0, shape=shape)
    with torch.no_grad():
        act.threshold.copy_(_thresholds(shape, 3))
    theta = act.threshold
    if theta.ndim == 1 and theta.numel() > 1:
        expected = theta.view(-1, 1, 1).expand(SAMPLE)
    else:
        expected = theta.expand(SAMPLE)
    assert torch.equal(_elementwise_theta(act), expected)


@pytest.mark.parametrize("shape", ACCEPTED, ids=str)
def test_ball_bound_masks_use_the_forward_thresholds(shape):
    left = _left_half(shape, 11, two_layers=False)
    x = torch.rand(3, 2, H, W, generator=torch.Generator().manual_seed(5))
    bounds = ball_bounds(left, x, torch.tensor([0.05, 0.2, 0.6], dtype=torch.float64))
    theta = _elementwise_theta(left.activation(0)).double()
    expected = (bounds.upper[0] > 0) & (bounds.lower[0] < theta)
    assert torch.equal(bounds.masks[0], expected)


# 1–30 s per case on the 2-core CI machine (28 cases): by default the audit's (H, 1) case and the element-wise one with
# one layer; every shape and the two-layer nets under `-m slow` (make test-slow, CI's second step).
@pytest.mark.parametrize("two_layers", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["one-layer", "two-layers"])
@pytest.mark.parametrize("shape", [s if s in {(H, 1), (C, H, W)} else pytest.param(s, marks=pytest.mark.slow)
                                   for s in ACCEPTED], ids=str)
def test_local_bound_dominates_jacobian_norms_in_the_ball(shape, two_layers):
    """‖J_{f_L}(x')‖₂ ≤ L(x, γ) at points x' of the ball, for an f_L whose thresholds have ``shape``."""
    left = _left_half(shape, 21, two_layers=two_layers)
    left64 = copy.deepcopy(left).double()  # the same real-valued function, differentiated in float64
    gen = torch.Generator().manual_seed(7)
    gamma = 0.3
    for _ in range(3):
        x = torch.rand(1, 2, H, W, generator=gen)
        bound = float(sz.lipschitz_bound(left, x, gamma, method="exact").value[0])
        for _ in range(6):
            d = torch.randn(1, 2, H, W, generator=gen, dtype=torch.float64)
            point = x.double() + d / d.norm() * gamma * float(torch.rand((), generator=gen, dtype=torch.float64))
            jac = torch.autograd.functional.jacobian(lambda v: left64(v.view(1, 2, H, W)).flatten(), point.flatten())
            assert torch.linalg.matrix_norm(jac, ord=2) <= bound * (1 + 1e-9)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("shape", [(C,), (H, 1), (1, 1, W), (1, H, W), (C, H, W)], ids=str)
def test_interval_clip_kernel_reads_theta_like_the_reference(device, shape):
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(2, *SAMPLE, generator=gen, dtype=torch.float64)
    r = torch.rand(2, *SAMPLE, generator=gen, dtype=torch.float64)
    theta = _thresholds(shape, 4).double()
    got = interval_clip_triton(z.to(device), r.to(device), theta.to(device))
    ref = interval_clip_reference(z, r, theta)
    act = sz.ClippedReLU(1.0, shape=shape)
    with torch.no_grad():
        act.threshold.copy_(theta.float())
    expected_mask = (ref.upper > 0) & (ref.lower < _elementwise_theta(act).double())
    assert torch.equal(ref.mask, expected_mask)
    for name in ("lower", "upper", "mask", "center", "radius"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name))


def test_per_row_thresholds_regression_bound_is_not_per_channel():
    """The audit's case: θ of shape (H, 1) with H = C. Row 0 varies (θ = 1.5), rows 1–3 are constant (θ = 0);
    channel 0's filter is tiny. Read per channel, only channel 0 would vary and L would be ~100× too small."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, C, 3, padding=1)
    with torch.no_grad():
        conv.weight[0].mul_(0.01)
    act = sz.ClippedReLU(1.0, shape=(H, 1))
    with torch.no_grad():
        act.threshold.copy_(torch.tensor([[1.5], [0.0], [0.0], [0.0]]))
    left = sz.LeftHalf([conv], [act], input_shape=(2, H, W))
    x = torch.full((1, 2, H, W), 0.5)
    bound = float(sz.lipschitz_bound(left, x, 1e-3, method="exact").value[0])
    jac = torch.autograd.functional.jacobian(lambda v: left(v.view(1, 2, H, W)).flatten(), x.flatten())
    assert torch.linalg.matrix_norm(jac, ord=2) <= bound * (1 + 1e-6)
    assert torch.linalg.matrix_norm(jac, ord=2) > 0.5 * bound
