"""The fused first-layer bound kernel (``kernels/first_layer_bounds.py``) against its PyTorch reference and against
``ball_bounds``' own first layer, on tiny odd shapes: convolutions with stride, padding and dilation, linear layers,
with and without standardization, bias, rounding margin and each θ mode, float32 and float64.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors; the same tests run on CUDA where a GPU exists
(marked ``gpu``). Uninitialized memory is poisoned (``torch.utils.deterministic.fill_uninitialized_memory``: NaN for
floats, 0xFF for the uint8 mask) so an output the kernel forgot to write fails the comparison.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _helpers import kernel_devices
import splitz_fast as sz
from splitz_fast.bounds.intervals import ROUNDING_MARGIN, ball_bounds
from splitz_fast.kernels.first_layer_bounds import (
    first_layer_bounds, first_layer_bounds_reference, first_layer_bounds_triton,
)

DEVICES = kernel_devices()
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
# name → (layer factory, one input's shape)
LAYERS = {
    "conv3x3-p1": (lambda: nn.Conv2d(2, 5, 3, padding=1), (2, 7, 6)),
    "conv7x7-s2-p3": (lambda: nn.Conv2d(3, 4, 7, stride=2, padding=3), (3, 9, 11)),
    "conv3x2-dil2-nobias": (lambda: nn.Conv2d(1, 17, (3, 2), dilation=2, bias=False), (1, 8, 7)),
    "conv-stride3-pad2": (lambda: nn.Conv2d(2, 3, 4, stride=3, padding=2), (2, 10, 5)),
    "linear": (lambda: nn.Linear(13, 19), (13,)),
    "linear-nobias": (lambda: nn.Linear(6, 3, bias=False), (6,)),
}
# conv7x7-s2-p3 costs ~3 s per case in Triton's interpreter on the 2-core CI machine (16 cases): `-m slow` there.
LAYER_PARAMS = [pytest.param(n, marks=pytest.mark.slow) if n == "conv7x7-s2-p3" else n for n in LAYERS]


def _theta(mode: str, out_channels: int, out_shape, gen):
    if mode == "none":
        return None
    if mode == "scalar":
        return 0.7
    if mode == "channel":
        return torch.rand(out_channels, generator=gen) + 0.2
    return torch.rand(out_shape, generator=gen) + 0.2


def _case(name, dtype, standardize, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    factory, shape = LAYERS[name]
    torch.manual_seed(seed)
    layer = factory().to(device=device, dtype=dtype)
    x = torch.rand(3, *shape, generator=gen, dtype=dtype).to(device)
    mean = std = None
    if standardize:
        mean = (torch.rand(shape[0], generator=gen, dtype=dtype) * 0.5).to(device)
        std = (torch.rand(shape[0], generator=gen, dtype=dtype) * 0.3 + 0.2).to(device)
    gamma = torch.tensor([0.0, 0.3, 1.7], dtype=dtype, device=device)
    return layer, x, mean, std, gamma, gen


def _assert_close(ours, ref, dtype):
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for field in ("lower", "upper", "center", "radius", "latent"):
        a, b = getattr(ours, field), getattr(ref, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert not torch.isnan(a).any(), f"{field} has unwritten (NaN) entries"
            torch.testing.assert_close(a.cpu(), b.cpu(), **tol, msg=field)
    # Masks may differ only where a bound sits within rounding of 0 or θ; with random data that does not happen.
    assert torch.equal(ours.mask.cpu(), ref.mask.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYER_PARAMS)
@pytest.mark.parametrize("standardize", [False, True], ids=["raw", "std"])
@pytest.mark.parametrize("theta_mode", ["none", "scalar", "channel", "element"])
def test_fused_first_layer_matches_reference(poisoned, device, dtype, name, standardize, theta_mode):
    layer, x, mean, std, gamma, gen = _case(name, dtype, standardize, device)
    with torch.no_grad():
        out_shape = layer(x[:1] if mean is None else x[:1]).shape[1:]
    theta = _theta(theta_mode, out_shape[0], out_shape, gen)
    theta = theta.to(device=device, dtype=dtype) if isinstance(theta, torch.Tensor) else theta
    rel = ROUNDING_MARGIN if dtype == torch.float64 else 0.0
    kwargs = dict(mean=mean, std=std, rel_rounding=rel, need_next=True, need_latent=True)
    ours = first_layer_bounds_triton(x, layer, gamma, theta, **kwargs)
    ref = first_layer_bounds_reference(x, layer, gamma, theta, **kwargs)
    assert ours.lower.shape == (3, *out_shape) and ours.mask.dtype == torch.bool
    _assert_close(ours, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("need_next,need_latent", [(False, False), (False, True), (True, False)])
def test_optional_outputs_are_absent_when_not_asked(device, need_next, need_latent):
    layer, x, mean, std, gamma, _ = _case("conv3x3-p1", torch.float64, True, device)
    ours = first_layer_bounds_triton(x, layer, gamma, 1.0, mean=mean, std=std, need_next=need_next,
                                     need_latent=need_latent)
    assert (ours.center is None) == (not need_next) and (ours.radius is None) == (not need_next)
    assert (ours.latent is None) == (not need_latent)
    ref = first_layer_bounds_reference(x, layer, gamma, 1.0, mean=mean, std=std, need_next=need_next,
                                       need_latent=need_latent)
    _assert_close(ours, ref, torch.float64)


def test_reference_latent_is_the_clipped_layer_output():
    """The reference's ``latent`` is f_L(x) of a one-layer f_L, as the model computes it."""
    torch.manual_seed(0)
    left = sz.LeftHalf([nn.Conv2d(3, 4, 3, padding=1)], [sz.ClippedReLU(0.5)],
                       standardize=sz.Standardize([0.4, 0.5, 0.6], [0.2, 0.3, 0.25]), input_shape=(3, 6, 5))
    x = torch.rand(2, 3, 6, 5, dtype=torch.float64)
    left = left.double()
    ref = first_layer_bounds_reference(x, left.layers[0], 0.1, 0.5, mean=left.standardize.mean,
                                       std=left.standardize.std, need_latent=True)
    torch.testing.assert_close(ref.latent, left(x), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("standardize", [False, True], ids=["raw", "std"])
@pytest.mark.parametrize("first", ["conv", "linear"])
def test_ball_bounds_first_layer_equals_the_fused_reference(standardize, first):
    """The first layer of ball_bounds (certificate precision) is this op: lower/upper/mask of layer 1 agree."""
    torch.manual_seed(1)
    if first == "conv":
        layers, shape, std_args = [nn.Conv2d(2, 4, 3, padding=1)], (2, 5, 6), ([0.3, 0.6], [0.2, 0.4])
    else:
        layers, shape, std_args = [nn.Linear(7, 5)], (7,), ([0.1] * 7, [0.5] * 7)
    left = sz.LeftHalf(layers, [sz.ClippedReLU(1.0)], standardize=sz.Standardize(*std_args) if standardize else None,
                       input_shape=shape)
    x = torch.rand(4, *shape)
    bounds = ball_bounds(left, x, 0.4)
    mean, std = (left.standardize.mean, left.standardize.std) if standardize else (None, None)
    ref = first_layer_bounds_reference(x.double(), left.layers[0], 0.4, 1.0, mean=mean, std=std,
                                       rel_rounding=ROUNDING_MARGIN)
    torch.testing.assert_close(bounds.lower[0], ref.lower, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(bounds.upper[0], ref.upper, rtol=1e-15, atol=1e-15)
    assert torch.equal(bounds.masks[0], ref.mask)


@pytest.mark.parametrize("bad,match", [
    (dict(layer=nn.Conv2d(2, 3, 3, groups=1, padding="same")), "padding"),
    (dict(layer=nn.Conv2d(2, 2, 3, groups=2)), "groups"),
    (dict(layer=nn.Conv2d(3, 3, 3)), r"\[B, 3, H, W\]"),
    (dict(x=torch.zeros(2, 2, 5, 5, dtype=torch.int64)), "float32 or float64"),
    (dict(layer=nn.ReLU()), "Conv2d or nn.Linear"),
    (dict(std=torch.ones(2)), "both mean and std"),
])
def test_bad_arguments_are_refused(bad, match):
    args = dict(x=torch.rand(2, 2, 5, 5), layer=nn.Conv2d(2, 3, 3), std=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        first_layer_bounds(args["x"], args["layer"], 0.1, 1.0, std=args["std"], backend="triton")


def test_python_float_gamma_is_not_rounded_to_float32():
    """γ = 0.4 as a Python float must mean 0.4 in float64 (float32's 0.4000000059… would bound another ball)."""
    layer = nn.Linear(3, 2)
    x = torch.rand(2, 3, dtype=torch.float64)
    as_float = first_layer_bounds_reference(x, layer, 0.4, None)
    as_tensor = first_layer_bounds_reference(x, layer, torch.tensor(0.4, dtype=torch.float64), None)
    assert torch.equal(as_float.lower, as_tensor.lower) and torch.equal(as_float.upper, as_tensor.upper)
