"""Triton kernels of the bound code vs their float64 PyTorch references: ``interval_clip`` (one fused interval step of
``ball_bounds``) and ``masked_linear`` (the masked products ``I W D I`` of a Linear layer, with gradients).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set below before
anything imports triton), on tiny odd shapes. The same tests run on CUDA tensors where a GPU exists (marked
``gpu``). Outputs are poisoned with NaN (masks with 0xAB) beforehand so that unwritten memory fails the comparison.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch.nn as nn  # noqa: E402

import splitz_fast as sz  # noqa: E402
from splitz_fast.bounds.intervals import (  # noqa: E402
    ROUNDING_MARGIN, affine, ball_bounds, bias_magnitude, first_layer_row_norms, input_scale, linear_part,
)
from splitz_fast.kernels.interval_clip import (  # noqa: E402
    IntervalClip, interval_clip, interval_clip_reference, interval_clip_triton,
)
from splitz_fast.kernels.masked_linear import (  # noqa: E402
    launch_masked_linear, launch_masked_weight_grad, masked_linear, masked_linear_reference, masked_linear_triton,
)
from splitz_fast.bounds.operators import MaskedAffine  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DEVICES = [
    pytest.param("cpu", id="interp", marks=pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                                                             reason="needs triton with TRITON_INTERPRET=1")),
    pytest.param("cuda", id="cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs CUDA")]),
]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
POISON_MASK = 0xAB


def _gen(seed) -> torch.Generator:
    """A CPU generator seeded by an int or, deterministically across runs, by any repr-able test parameters."""
    if not isinstance(seed, int):
        seed = zlib.crc32(repr(seed).encode())
    return torch.Generator().manual_seed(seed)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# ====================================================================================================================
# interval_clip
# ====================================================================================================================

SHAPES = {"conv": (2, 3, 5, 3), "linear": (3, 13)}
THETAS = ["none", "scalar", "inf", "channel", "element"]
RADII = ["per-sample", "rows-gamma-margin-rel", "rows-gamma-shared-margin"]


def _theta(kind: str, sample: tuple[int, ...], gen: torch.Generator):
    if kind == "none":
        return None
    if kind == "scalar":
        return 0.6
    if kind == "inf":
        return math.inf
    if kind == "channel":
        return 0.2 + torch.rand(sample[0], generator=gen)
    return 0.2 + torch.rand(sample, generator=gen)


def _interval_inputs(shape, radius_kind, gen, dtype):
    batch, sample = shape[0], shape[1:]
    z = (1.5 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    kwargs = {}
    if radius_kind == "per-sample":
        r = (0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype)
    else:
        r = torch.rand(sample, generator=gen, dtype=torch.float64).to(dtype)
        kwargs["gamma"] = torch.rand(batch, generator=gen, dtype=torch.float64).to(dtype)
        if radius_kind == "rows-gamma-margin-rel":
            kwargs["margin"] = (1e-3 * torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype)
            kwargs["rel_margin"] = 1e-3
        else:
            kwargs["margin"] = (1e-3 * torch.rand((1, *sample), generator=gen, dtype=torch.float64)).to(dtype)
    return z, r, kwargs


def _poisoned_interval_out(z: torch.Tensor, need_next: bool = True) -> IntervalClip:
    nan = lambda: torch.full_like(z, math.nan)  # noqa: E731
    mask = torch.full(z.shape, POISON_MASK, dtype=torch.uint8, device=z.device)
    return IntervalClip(nan(), nan(), mask, nan() if need_next else None, nan() if need_next else None)


def _to64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.float64)
    return value


def _check_interval(got: IntervalClip, ref: IntervalClip, z, total_mag, theta64, dtype):
    """``got`` (any device/dtype) vs the float64 reference ``ref`` computed from the same (upcast) inputs."""
    got = IntervalClip(*(None if t is None else t.detach().cpu() for t in got))
    mask_u8 = got.mask.view(torch.uint8) if got.mask.dtype == torch.bool else got.mask
    assert set(mask_u8.unique().tolist()) <= {0, 1}, "mask memory left unwritten"
    for name in ("lower", "upper", "center", "radius"):
        assert not torch.isnan(getattr(got, name)).any(), f"{name}: NaN (unwritten memory)"
    scale = z.abs() + total_mag
    # The soundness direction: upper never below, lower never above the float64 reference beyond the rounding of
    # the kernel's own dtype (1 ulp in float64, where the result is in fact bit-identical).
    tiny = (2 if dtype == torch.float64 else 4) * _eps(dtype) * scale
    assert (got.upper.double() >= ref.upper - tiny).all()
    assert (got.lower.double() <= ref.lower + tiny).all()
    if dtype == torch.float64:
        for name in IntervalClip._fields:
            assert torch.equal(getattr(got, name), getattr(ref, name)), f"{name} differs from the float64 reference"
        return
    tol = 4 * _eps(dtype) * scale
    for name in ("lower", "upper", "center", "radius"):
        assert ((getattr(got, name).double() - getattr(ref, name)).abs() <= tol).all(), name
    # float32 masks may differ from float64 only where the bound sits within rounding of 0 or θ.
    differ = got.mask.bool() != ref.mask
    if theta64 is None:
        assert not differ.any()
    else:
        th = _theta_for(theta64, ref.upper)
        near = ((ref.upper.abs() <= tol) | ((ref.lower - th).abs() <= tol))
        assert not (differ & ~near).any()


def _theta_for(theta64, like):
    t = torch.as_tensor(theta64, dtype=torch.float64)
    if t.ndim == 1 and like.ndim > 2:
        return t.view(-1, *([1] * (like.ndim - 2)))
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("theta_kind", THETAS)
@pytest.mark.parametrize("radius_kind", RADII)
def test_interval_clip_matches_float64_reference(device, dtype, shape_name, theta_kind, radius_kind):
    gen = _gen((shape_name, theta_kind, radius_kind, str(dtype)))
    shape = SHAPES[shape_name]
    z, r, kwargs = _interval_inputs(shape, radius_kind, gen, dtype)
    theta = _theta(theta_kind, shape[1:], gen)
    dev = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    out = _poisoned_interval_out(z.to(device))
    got = interval_clip_triton(dev(z), dev(r), dev(theta), out=out, **{k: dev(v) for k, v in kwargs.items()})
    assert got.lower is out.lower and got.center is out.center
    ref = interval_clip_reference(_to64(z), _to64(r), _to64(theta), **{k: _to64(v) for k, v in kwargs.items()})
    total = ref.upper - _to64(z)
    _check_interval(got, ref, _to64(z), total.abs(), _to64(theta) if theta is not None else None, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_interval_clip_last_layer_and_fresh_outputs(device):
    gen = _gen(1)
    z, r, kwargs = _interval_inputs((4, 2, 3, 3), "rows-gamma-margin-rel", gen, torch.float64)
    theta = torch.tensor([0.5, 2.0]).view(2, 1, 1)  # [C, 1, 1] as broadcast_threshold gives it
    z, r = z.to(device), r.to(device)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    last = interval_clip_triton(z, r, theta.to(device), need_next=False,
                                out=_poisoned_interval_out(z, need_next=False), **kwargs)
    assert last.center is None and last.radius is None
    fresh = interval_clip_triton(z, r, theta.to(device), **kwargs)  # allocated by the launcher
    assert fresh.mask.dtype == torch.bool and fresh.mask.shape == z.shape
    ref = interval_clip_reference(z.cpu(), r.cpu(), theta, **{k: _to64(v) for k, v in kwargs.items()})
    for name in ("lower", "upper", "mask"):
        assert torch.equal(getattr(last, name).cpu(), getattr(ref, name))
    for name in IntervalClip._fields:
        assert torch.equal(getattr(fresh, name).cpu(), getattr(ref, name))


@pytest.mark.parametrize("device", DEVICES)
def test_interval_clip_boundary_cases_are_exact(device):
    # Columns: upper exactly 0 (constant 0), lower exactly θ (constant θ), a straddling neuron, a zero-width interval
    # inside (0, θ) (varying: its derivative is 1), lower exactly 0 with upper in (0, θ).
    z = torch.tensor([[-0.5, 1.5, 0.5, 0.25, 0.25]], dtype=torch.float64)
    r = torch.tensor([[0.5, 0.5, 1.0, 0.0, 0.25]], dtype=torch.float64)
    theta = 1.0
    got = interval_clip_triton(z.to(device), r.to(device), theta, out=_poisoned_interval_out(z.to(device)))
    ref = interval_clip_reference(z, r, theta)
    assert got.mask.cpu().tolist() == [[False, False, True, True, True]] == ref.mask.tolist()
    assert got.center.cpu().tolist() == [[0.0, 1.0, 0.5, 0.25, 0.25]]
    assert got.radius.cpu().tolist() == [[0.0, 0.0, 0.5, 0.0, 0.25]]
    # θ = 0: every output interval is [0, 0]; the mask keeps its definition (only the straddling neuron is True).
    zero = interval_clip_triton(z.to(device), r.to(device), 0.0)
    assert zero.mask.cpu().tolist() == [[False, False, True, False, False]]
    assert not zero.center.any() and not zero.radius.any()


def test_interval_clip_reference_argument_checks():
    z = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="gamma"):
        interval_clip_reference(z, torch.ones(3, dtype=torch.float64), 1.0, gamma=torch.ones(3))
    with pytest.raises(ValueError, match="r must have shape"):
        interval_clip_reference(z, torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="theta"):
        interval_clip_reference(z, torch.ones(3), torch.ones(4))
    with pytest.raises(TypeError, match="float32 or float64"):
        interval_clip_reference(z.half(), torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="backend"):
        interval_clip(z, torch.ones(3), 1.0, backend="fast")


@pytest.mark.parametrize("choice", [None, "auto", "reference"])
def test_dispatch_on_cpu_uses_the_reference(monkeypatch, choice):
    if choice is None:
        monkeypatch.delenv("SPLITZ_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SPLITZ_BACKEND", choice)
    gen = _gen(3)
    z = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    rows = torch.rand(4, generator=gen, dtype=torch.float64)
    got = interval_clip(z, rows, 0.5, gamma=0.3)
    ref = interval_clip_reference(z, rows, 0.5, gamma=0.3)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    assert torch.equal(masked_linear(z, w), masked_linear_reference(z, w))


# -- the wiring into ball_bounds: the op, called per layer, reproduces bounds.ball_bounds bit for bit ---------------

def _left_halves():
    gen = _gen(5)
    torch.manual_seed(5)

    def clipped(shape):
        act = sz.ClippedReLU(1.0, shape=shape)
        act.threshold.copy_(0.2 + 1.3 * torch.rand(shape, generator=gen))
        return act

    conv_mlp = sz.LeftHalf(
        [nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Linear(3 * 3 * 3, 7), nn.Linear(7, 4)],
        [clipped((3,)), clipped(()), None], standardize=sz.Standardize([0.3, 0.6], [0.2, 0.5]), input_shape=(2, 5, 5))
    mlp = sz.LeftHalf([nn.Linear(6, 9), nn.Linear(9, 5)], [clipped((9,)), sz.ClippedReLU(math.inf)],
                      input_shape=(6,))
    return {"conv-mlp": conv_mlp, "mlp": mlp}


def ball_bounds_via(op, left: sz.LeftHalf, x: torch.Tensor, gamma: torch.Tensor, device) -> tuple[list, list, list]:
    """The layer loop of ``bounds.ball_bounds`` (float64, rigorous) with the interval step done by ``op``."""
    x64 = x.detach().double()
    scale = input_scale(left, x64)
    h = left.standardize(x64) if left.standardize is not None else x64
    lowers, uppers, masks = [], [], []
    center, radius = h, None
    for k, layer in enumerate(left.layers):
        abs_w = layer.weight.detach().double().abs()
        z = affine(layer, center)
        if k == 0:
            r, g = first_layer_row_norms(layer, scale, x64), gamma
            r_eff = gamma.view(-1, *([1] * (z.ndim - 1))) * r
        else:
            r, g = linear_part(layer, radius, weight=abs_w), None
            r_eff = r
        magnitude = linear_part(layer, center.abs() if k == 0 else center.abs() + radius, weight=abs_w)
        margin = ROUNDING_MARGIN * (magnitude + bias_magnitude(layer, z) + r_eff)
        act = left.activation(k)
        theta = None if act is None else act.threshold.detach()
        to = (lambda t: t.to(device)) if device is not None else (lambda t: t)
        res = op(to(z), to(r), None if theta is None else to(theta), gamma=None if g is None else to(g),
                 margin=to(margin), need_next=k < left.depth - 1)
        lowers.append(res.lower.cpu())
        uppers.append(res.upper.cpu())
        masks.append(res.mask.cpu())
        center, radius = (None, None) if res.center is None else (res.center.cpu(), res.radius.cpu())
    return lowers, uppers, masks


@pytest.mark.parametrize("name", ["conv-mlp", "mlp"])
@pytest.mark.parametrize("device", [pytest.param(None, id="reference")] + DEVICES)
def test_interval_clip_reproduces_ball_bounds(name, device):
    left = _left_halves()[name]
    gen = _gen(7)
    x = torch.rand(3, *left.input_shape, generator=gen)
    gamma = torch.tensor([0.0, 0.05, 0.4], dtype=torch.float64)
    expected = ball_bounds(left, x, gamma)
    op = interval_clip_reference if device is None else interval_clip_triton
    lowers, uppers, masks = ball_bounds_via(op, left, x, gamma, device)
    for k in range(left.depth):
        assert torch.equal(lowers[k], expected.lower[k])
        assert torch.equal(uppers[k], expected.upper[k])
        assert torch.equal(masks[k], expected.masks[k])


# ====================================================================================================================
# masked_linear
# ====================================================================================================================

MASKINGS = ["none", "both", "shared-in+scale", "out-only-float"]
SIZES = [pytest.param((1, 37, 21), id="B1"), pytest.param((19, 23, 70), id="B19")]


def _masked_inputs(sizes, masking, dtype, gen, transpose=False):
    batch, n_out, n_in = sizes
    weight = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64).to(dtype)
    x = torch.randn(batch, n_out if transpose else n_in, generator=gen, dtype=torch.float64).to(dtype)
    kw: dict = {}
    if masking == "both":
        kw["out_mask"] = torch.rand(batch, n_out, generator=gen) > 0.35
        kw["in_mask"] = (torch.rand(batch, n_in, generator=gen) > 0.3).to(torch.uint8)
        kw["scale"] = 0.5 + torch.rand(n_in, generator=gen, dtype=torch.float64).to(dtype)
    elif masking == "shared-in+scale":
        kw["in_mask"] = torch.rand(1, n_in, generator=gen) > 0.5
        kw["scale"] = 0.5 + torch.rand(n_in, generator=gen, dtype=torch.float64).to(dtype)
    elif masking == "out-only-float":
        kw["out_mask"] = (torch.rand(batch, n_out, generator=gen) > 0.5).to(dtype)
    return x, weight, kw


def _move(kw, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _assert_close_by_magnitude(got, expected, magnitude, terms, dtype, what):
    """``|got − expected| ≤ (terms + 4)·eps·magnitude`` (a bound on the rounding of a ``terms``-long sum)."""
    got = got.detach().cpu().double()
    bound = (terms + 4) * _eps(dtype) * magnitude + 1e-300
    bad = (got - expected).abs() > bound
    assert not torch.isnan(got).any(), f"{what}: NaN (unwritten memory)"
    assert not bad.any(), f"{what}: max error {(got - expected).abs().max():.3g} over bound {bound.max():.3g}"


def _abs_kwargs(kw):
    return {k: (v.abs() if k == "scale" else v) for k, v in kw.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("transpose", [False, True], ids=["matvec", "rmatvec"])
def test_masked_linear_forward_matches_float64_reference(device, dtype, sizes, masking, transpose):
    gen = _gen((sizes, masking, transpose, str(dtype)))
    x, weight, kw = _masked_inputs(sizes, masking, dtype, gen, transpose)
    n = sizes[2] if transpose else sizes[1]
    out = torch.full((sizes[0], n), math.nan, dtype=dtype, device=device)
    got = launch_masked_linear(x.to(device), weight.to(device), transpose=transpose, out=out, **_move(kw, device))
    assert got is out
    kw64 = {k: (_to64(v) if k == "scale" else v) for k, v in kw.items()}
    expected = masked_linear_reference(_to64(x), _to64(weight), transpose=transpose, **kw64)
    magnitude = masked_linear_reference(_to64(x).abs(), _to64(weight).abs(), transpose=transpose, **_abs_kwargs(kw64))
    terms = sizes[1] if transpose else sizes[2]
    _assert_close_by_magnitude(got, expected, magnitude, terms, dtype, "forward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masking", ["none", "both", "shared-in+scale"])
@pytest.mark.parametrize("transpose", [False, True], ids=["matvec", "rmatvec"])
def test_masked_linear_gradients_match_reference_autograd(device, dtype, masking, transpose):
    sizes = (5, 23, 19)
    gen = _gen((masking, transpose, str(dtype), "grad"))
    x, weight, kw = _masked_inputs(sizes, masking, dtype, gen, transpose)
    grad_out = torch.randn(sizes[0], sizes[2] if transpose else sizes[1], generator=gen, dtype=torch.float64)
    xd = x.to(device).requires_grad_(True)
    wd = weight.to(device).requires_grad_(True)
    y = masked_linear_triton(xd, wd, transpose=transpose, **_move(kw, device))
    gx, gw = torch.autograd.grad(y, (xd, wd), grad_out.to(device=device, dtype=dtype))

    kw64 = {k: (_to64(v) if k == "scale" else v) for k, v in kw.items()}
    x64 = _to64(x).requires_grad_(True)
    w64 = _to64(weight).requires_grad_(True)
    y64 = masked_linear_reference(x64, w64, transpose=transpose, **kw64)
    ex, ew = torch.autograd.grad(y64, (x64, w64), grad_out)
    # Magnitudes: the same products on absolute values.
    xa, wa, ga = _to64(x).abs().requires_grad_(True), _to64(weight).abs().requires_grad_(True), grad_out.abs()
    ya = masked_linear_reference(xa, wa, transpose=transpose, **_abs_kwargs(kw64))
    mx, mw = torch.autograd.grad(ya, (xa, wa), ga)
    _assert_close_by_magnitude(gx, ex, mx, sizes[1] if not transpose else sizes[2], dtype, "grad x")
    _assert_close_by_magnitude(gw, ew, mw, sizes[0], dtype, "grad W")


@pytest.mark.parametrize("device", DEVICES)
def test_masked_linear_gradcheck_float64(device):
    gen = _gen(11)
    x, weight, kw = _masked_inputs((2, 5, 4), "both", torch.float64, gen)
    xd = x.to(device).requires_grad_(True)
    wd = weight.to(device).requires_grad_(True)
    kwd = _move(kw, device)
    for transpose in (False, True):
        xt = xd if not transpose else torch.randn(2, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda a, w: masked_linear_triton(a, w, transpose=transpose, **kwd), (xt, wd), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_weight_grad_writes_every_entry(device, dtype):
    gen = _gen(13)
    batch, n_out, n_in = 7, 33, 70  # several tiles in both directions for both dtypes
    p = torch.randn(batch, n_out, generator=gen, dtype=torch.float64)
    q = torch.randn(batch, n_in, generator=gen, dtype=torch.float64)
    mo = torch.rand(batch, n_out, generator=gen) > 0.5
    mi = torch.rand(batch, n_in, generator=gen) > 0.5
    s = 0.5 + torch.rand(n_in, generator=gen, dtype=torch.float64)
    out = torch.full((n_out, n_in), math.nan, dtype=dtype, device=device)
    got = launch_masked_weight_grad(p.to(device=device, dtype=dtype), q.to(device=device, dtype=dtype),
                                    out_mask=mo.to(device), in_mask=mi.to(device), scale=s.to(device), out=out)
    p, q, s = p.to(dtype).double(), q.to(dtype).double(), s.to(dtype).double()
    expected = (p * mo).T @ (q * mi * s)
    magnitude = (p.abs() * mo).T @ (q.abs() * mi * s)
    _assert_close_by_magnitude(got, expected, magnitude, batch, dtype, "weight grad")


@pytest.mark.parametrize("device", DEVICES)
def test_masked_linear_strided_weight_and_large_batch(device):
    # A transposed (non-contiguous) weight, a batch spanning several row tiles, N spanning several column tiles.
    gen = _gen(17)
    base = torch.randn(33, 65, generator=gen)
    weight = base.T  # [65, 33], strides (1, 65)
    v = torch.randn(70, 33, generator=gen)
    mo = torch.rand(70, 65, generator=gen) > 0.5
    got = launch_masked_linear(v.to(device), weight.to(device) if device == "cpu" else base.to(device).T,
                               out_mask=mo.to(device))
    expected = masked_linear_reference(v.double(), weight.double(), out_mask=mo)
    magnitude = masked_linear_reference(v.double().abs(), weight.double().abs(), out_mask=mo)
    _assert_close_by_magnitude(got, expected, magnitude, 33, torch.float32, "strided")


@pytest.mark.parametrize("device", DEVICES)
def test_masked_linear_matches_masked_affine_for_a_linear_layer(device):
    # The wiring: MaskedAffine(Linear after a conv, in_shape (C, H, W)) matvec/rmatvec/gram_matvec == this op.
    gen = _gen(19)
    torch.manual_seed(19)
    layer = nn.Linear(2 * 3 * 3, 11).double()
    in_shape = (2, 3, 3)
    batch = 4
    out_mask = torch.rand(batch, 11, generator=gen) > 0.4
    in_mask = torch.rand(batch, *in_shape, generator=gen) > 0.3
    in_scale = (0.5 + torch.rand(1, 2, 1, 1, generator=gen, dtype=torch.float64)).expand(1, *in_shape)
    op = MaskedAffine(layer, in_shape, out_mask=out_mask, in_mask=in_mask, in_scale=in_scale, batch=batch)
    v = torch.randn(batch, *in_shape, generator=gen, dtype=torch.float64)
    u = torch.randn(batch, 11, generator=gen, dtype=torch.float64)
    w = layer.weight.detach().to(device)
    kw = dict(out_mask=out_mask.to(device), in_mask=in_mask.to(device), scale=in_scale.to(device))
    y = masked_linear_triton(v.flatten(1).to(device), w, **kw)
    vt = masked_linear_triton(u.to(device), w, transpose=True, **kw).reshape(batch, *in_shape)
    gram = masked_linear_triton(y, w, transpose=True, in_mask=kw["in_mask"], scale=kw["scale"])  # y is masked
    # The simplest wiring passes MaskedAffine's combined float factor (mask · 1/sd) as the input mask.
    factor = dict(out_mask=op.out_mask.to(device), in_mask=op.in_factor.to(device))
    y_f = masked_linear_triton(v.flatten(1).to(device), w, **factor)
    vt_f = masked_linear_triton(u.to(device), w, transpose=True, **factor).reshape(batch, *in_shape)
    for got, expected in ((y, op.matvec(v)), (vt, op.rmatvec(u)), (gram.reshape(batch, *in_shape), op.gram_matvec(v)),
                          (y_f, op.matvec(v)), (vt_f, op.rmatvec(u))):
        torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-12, atol=1e-12)


def test_masked_linear_argument_checks():
    w = torch.randn(3, 4)
    with pytest.raises(TypeError, match="same dtype"):
        masked_linear_reference(torch.randn(2, 4, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"\[B, in\]"):
        masked_linear_reference(torch.randn(2, 3), w)
    with pytest.raises(ValueError, match="in_mask"):
        masked_linear_reference(torch.randn(2, 4), w, in_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="scale"):
        masked_linear_reference(torch.randn(2, 4), w, scale=torch.ones(3))
    with pytest.raises(NotImplementedError, match="scale"):
        masked_linear_triton(torch.randn(2, 4), w, scale=torch.ones(4, requires_grad=True))
    with pytest.raises(ValueError, match="backend"):
        masked_linear(torch.randn(2, 4), w, backend="fast")


def test_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from splitz_fast.kernels.interval_clip import interval_clip, interval_clip_reference\n"
        "from splitz_fast.kernels.masked_linear import masked_linear, masked_linear_reference\n"
        "z = torch.randn(2, 3, dtype=torch.float64)\n"
        "assert interval_clip(z, torch.ones(3, dtype=torch.float64), 1.0, backend='reference').mask.shape == (2, 3)\n"
        "assert masked_linear(z, torch.randn(4, 3, dtype=torch.float64), backend='reference').shape == (2, 4)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- the real NVIDIA compiler, without a GPU: the kernels build for sm_90 and the float64 interval step has no FMA ----

_COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from splitz_fast.kernels.interval_clip import LAUNCH_OPTIONS, _kernels as interval_kernels

import itertools, time
LIMIT_S = float(sys.argv[1])  # per specialisation: a slow one would stall the first GPU call that needs it
slowest = (0.0, None)
built, total = 0, 0.0

def build(fn, types, consts, attrs=None, **options):
    global slowest, built, total
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types(n)) for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    start = time.perf_counter()
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm
    seconds = time.perf_counter() - start
    label = (fn.__name__, consts)
    assert seconds <= LIMIT_S, f"{label} took {seconds:.1f} s to compile for sm_90 (limit {LIMIT_S} s)"
    slowest = max(slowest, (seconds, label), key=lambda item: item[0])
    built, total = built + 1, total + seconds
    return asm

# Each kernel in every combination of its constexpr flags that its launcher can derive from its arguments (the
# tiles: those the launcher picks, or for the autotuned kernel those the tuner times), in each dtype it accepts.
def flag_sets(**choices):  # every combination of the flags' values, as dicts
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]

BOOL = (False, True)

# The interval step: float64 (the certificate's) and float32 (training).
fn = interval_kernels()
flags = ("R_PER_SAMPLE", "HAS_GAMMA", "HAS_MARGIN", "MARGIN_PER_SAMPLE", "HAS_REL", "NEED_NEXT")
for dt in ("fp32", "fp64"):
    for mode in (0, 1, 2, 3):
        for values in itertools.product(BOOL, repeat=len(flags)):
            consts = dict(zip(flags, values), THETA_MODE=mode, BLOCK=1024)
            if consts["MARGIN_PER_SAMPLE"] and not consts["HAS_MARGIN"]:
                continue  # not a launch the wrapper makes
            types = lambda n: "*u8" if n == "MASK" else "i32" if n in ("numel", "N", "C", "INNER") else "*" + dt
            ptx = build(fn, types, consts, **LAUNCH_OPTIONS)["ptx"]  # the options the launcher uses
            assert "fma." not in ptx, (dt, consts, "contracted multiply-add")
            assert dt == "fp32" or ".f32" not in ptx, (consts, "float32 arithmetic in the float64 kernel")
# The masked products: every flag set with bool masks (uint8 views) at the largest tile; the other tiles, and masks as
# float factors in the weight's dtype, with every mask on. A·x takes the input mask and scale before the product and
# the output mask after it, Aᵀ·x the reverse: never both scales.
import torch
from splitz_fast.kernels import masked_linear as linear
mm, outer = linear._kernels()
for dtype, dt in ((torch.float32, "fp32"), (torch.float64, "fp64")):
    tiles = sorted({linear._blocks(dtype, m) for m in (1, 17, 33)})  # the launcher's tiles for every batch size
    for mask in ("u8", dt):
        types = lambda n: ("*" + mask if n in ("PRE", "POST", "PM", "QM") else "i32" if n in ("M", "N", "K")
                           or n.startswith("stride") else "*" + dt)
        for (block_m, block_n, block_k, use_dot), tf32 in itertools.product(tiles, BOOL if dt == "fp32" else (False,)):
            tile = dict(USE_DOT=use_dot, ALLOW_TF32=tf32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
            every = (block_m, mask) == (tiles[-1][0], "u8")  # every flag set at one tile; the others fully masked
            for consts in flag_sets(HAS_PRE=BOOL, HAS_PRE_S=BOOL, HAS_POST=BOOL, HAS_POST_S=BOOL) if every else \
                    [dict(HAS_PRE=True, HAS_PRE_S=True, HAS_POST=True, HAS_POST_S=False)]:
                if not (consts["HAS_PRE_S"] and consts["HAS_POST_S"]):
                    build(mm, types, dict(consts, **tile), num_warps=4)
        # The weight gradient: its own tile for tl.dot, as the launcher sets it.
        block_m, block_n, block_k, use_dot = linear._blocks(dtype, 64)
        if use_dot:
            block_m, block_k = 32, 16
        for tf32 in BOOL if use_dot else (False,):
            tile = dict(USE_DOT=use_dot, ALLOW_TF32=tf32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
            for consts in flag_sets(HAS_PM=BOOL, HAS_QM=BOOL, HAS_QS=BOOL) if mask == "u8" else \
                    [dict(HAS_PM=True, HAS_QM=True, HAS_QS=True)]:
                build(outer, types, dict(consts, **tile), num_warps=4)
# The implicit-GEMM kernels, which call the shared index helpers of kernels/_conv_indexing.py.
from splitz_fast.kernels import first_layer_bounds as first_layer, masked_conv2d as conv
for dt in ("fp32", "fp64"):
    for fac in ("u8", dt):  # a bool mask or a float factor
        pointers = {"V": dt, "U": dt, "W": dt, "OUT": dt, "FAC": fac, "MOUT": "u8"}
        types = lambda n: "*" + pointers[n] if n in pointers else "i32"
        for fn in conv._kernels():
            for consts in flag_sets(HAS_FAC=BOOL, HAS_MOUT=BOOL) if fac == "u8" else [dict(HAS_FAC=True, HAS_MOUT=True)]:
                build(fn, types, dict(consts, BLOCK_M=conv._BLOCK_M, BLOCK_N=conv._BLOCK_N))
    pointers = dict.fromkeys(("X", "W", "BIAS", "MEAN", "STD", "GAMMA", "THETA", "LO", "UP", "CEN", "RAD", "LAT"), dt)
    pointers["MASK"] = "u8"
    types = lambda n: "*" + pointers[n] if n in pointers else "fp32" if n == "rel_rounding" else "i32"
    for consts in flag_sets(HAS_BIAS=BOOL, STANDARDIZE=BOOL, HAS_MARGIN=BOOL, THETA_MODE=(0, 1, 2, 3), NEED_NEXT=BOOL,
                            NEED_LATENT=BOOL):
        build(first_layer._kernel(), types, dict(consts, BLOCK_M=first_layer._BLOCK_M, BLOCK_N=first_layer._BLOCK_N))
# The sampling engine's noise kernels: the plain draw (one element or one pair per lane) and the draw through a 2x2 max
# pool (float32 and bfloat16 out).
from splitz_fast.kernels.noise import _kernels as noise_kernels
kernels = noise_kernels()
for out in ("fp32", "bf16"):
    types = lambda n: {"latent_ptr": "*fp32", "out_ptr": "*" + out, "sigma": "fp32"}.get(n, "i32")
    for channels_last in BOOL:
        build(kernels.noise, types, dict(CHANNELS_LAST=channels_last, BF16=out == "bf16", BLOCK_S=1, BLOCK_E=1024))
        build(kernels.noise_pairs, types, dict(CHANNELS_LAST=channels_last, BF16=out == "bf16", BLOCK_S=1, BLOCK_P=512))
    build(kernels.noise_maxpool2, types, dict(BF16=out == "bf16", BLOCK_S=1, BLOCK_E=512))
# The vote count (every batch of the certify path): bf16 and float64 logits, 10, 1000 and 2000 classes as the launcher
# tiles them (a block histogram with one atomic per bin up to 1024 classes, one atomic per row above).
import triton.language as tl
from splitz_fast.kernels.votes import _kernels as votes_kernels
for logits, value in (("bf16", tl.float32), ("fp64", tl.float64)):
    types = lambda n: {"logits_ptr": "*" + logits, "counts_ptr": "*i64"}.get(n, "i32")
    for classes in (10, 1000, 2000):
        block_c = min(triton.next_power_of_2(classes), 512)
        block_r = max(1, min(64, 4096 // block_c))
        block_h = triton.next_power_of_2(classes)
        build(votes_kernels().votes, types, dict(VALUE=value, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_H=block_h,
                                         LOCAL_HIST=block_r * block_h <= 8192))
# f_R's fused convolution + ReLU + 2x2 max pool, specialised as a launch on LeNet's channels_last activations is
# (pointers and the sizes/strides that are multiples of 16 marked so): every tile the tuner times (CONFIGS, the
# launcher's channel tiles) at the flags of LeNet's layers (bias; IEEE float32, TF32, bf16), and every flag set the
# launcher can pass at the first tile. The tap-aligned loop must load through asynchronous copies into shared memory,
# not element by element.
from splitz_fast.kernels.conv_relu_pool import CONFIGS, GATHER_MAX_BLOCK_M, _kernel as conv_pool_kernel
fn = conv_pool_kernel()
aligned16 = {fn.arg_names.index(n) for n in ("X", "WK", "OUT", "BIAS", "C_IN", "C_OUT", "K_TOTAL", "sx_b", "sx_h",
                                              "sx_w")}
lenet = {("fp32", False, True), ("fp32", True, True), ("bf16", False, True)}
for dt, tf32, has_bias in itertools.product(("fp32", "bf16", "fp16"), BOOL, BOOL):
    pointers = {"X": dt, "WK": dt, "OUT": dt, "BIAS": "fp32"}
    types = lambda n: "*" + pointers[n] if n in pointers else "i32"
    tiles = list(itertools.product(CONFIGS, (16, 32, 64))) if (dt, tf32, has_bias) in lenet else [(CONFIGS[0], 64)]
    for tap_aligned in BOOL:
        for (block_m, warps), block_n in tiles:
            if block_m > GATHER_MAX_BLOCK_M and not tap_aligned:
                continue
            # 32-bit addresses and the 32-wide step at every tile; at the first tile also 64-bit addresses, and the
            # 16-wide step of the gather (a 3x3 first layer: the tap-aligned loop always steps by 32)
            first = (block_m, warps) == CONFIGS[0]
            variants = [(False, 32)] + ([(True, 32)] if first else []) + ([(False, 16)] if first and not tap_aligned
                                                                          else [])
            for index64, block_k in variants:
                ttgir = build(fn, types, dict(HAS_BIAS=has_bias, IS_FP32=dt == "fp32", TF32=tf32, WIDEN=False,
                                              TAP_ALIGNED=tap_aligned, INDEX64=index64, BLOCK_M=block_m,
                                              BLOCK_N=block_n, BLOCK_K=block_k),
                              attrs={(i,): [["tt.divisibility", 16]] for i in aligned16}, num_warps=warps,
                              num_stages=3)["ttgir"]
                if tap_aligned:  # after software pipelining only the epilogue's bias is a plain load
                    assert ttgir.count("tt.load ") == has_bias and "ttg.async_copy_global_to_local" in ttgir, \
                        (dt, tf32, has_bias, block_m, block_n, index64, block_k,
                         "operand loads not pipelined as asynchronous copies")
print(f"compiled {built} specialisations with triton {triton.__version__} in {total:.0f} s; slowest {slowest[0]:.2f} s: "
      f"{slowest[1]}")
"""

# Seconds one kernel specialisation may take to compile for sm_90 on this CPU. Each takes under 3 s here (2 cores);
# the limit leaves room for a loaded machine and still names a specialisation that would stall a GPU run.
COMPILE_LIMIT_S = 30.0

# The Triton of the GPU machines (SPEC §6: torch 2.11 / triton 3.6), older than this machine's: a kernel that uses a
# newer feature would only fail there, in the first minutes of a scarce GPU run. Installed from the offline index.
GPU_MACHINE_TRITON = "3.6.0"


@pytest.fixture(scope="session")
def gpu_machine_triton(tmp_path_factory) -> str:
    """A folder holding ``triton==GPU_MACHINE_TRITON`` alone (put first on ``PYTHONPATH``: it shadows this
    environment's Triton; torch is not needed to compile)."""
    target = tmp_path_factory.mktemp("gpu-machine-triton")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                           str(target), f"triton=={GPU_MACHINE_TRITON}"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "No matching distribution" in proc.stderr:
        pytest.skip(f"triton=={GPU_MACHINE_TRITON} is not on this machine's package index")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(target)


@pytest.mark.slow  # ~4 min on 2 CPU cores per Triton, ~830 builds (plus ~20 s to install the GPU machines' one)
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("stack", ["this machine", "the GPU machines"])
def test_kernels_compile_for_sm90_quickly_without_fma_in_the_float64_interval_step(stack, request, tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    if stack == "the GPU machines":
        env["PYTHONPATH"] = os.pathsep.join([request.getfixturevalue("gpu_machine_triton"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(COMPILE_LIMIT_S)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
    if stack == "the GPU machines":
        assert f"with triton {GPU_MACHINE_TRITON}" in proc.stdout, proc.stdout


# ====================================================================================================================
# GPU-only: realistic sizes, TF32
# ====================================================================================================================

@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs CUDA")
def test_gpu_realistic_sizes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    # interval_clip on a CIFAR-sized first conv layer, float64.
    z = torch.randn(64, 16, 32, 32, device="cuda", dtype=torch.float64, generator=gen)
    rows = torch.rand(16, 32, 32, device="cuda", dtype=torch.float64, generator=gen)
    gamma = torch.rand(64, device="cuda", dtype=torch.float64, generator=gen)
    margin = 1e-10 * torch.rand_like(z)
    theta = 0.5 + torch.rand(16, device="cuda", dtype=torch.float64, generator=gen)
    got = interval_clip_triton(z, rows, theta, gamma=gamma, margin=margin, out=_poisoned_interval_out(z))
    ref = interval_clip_reference(z, rows, theta, gamma=gamma, margin=margin)
    for name in IntervalClip._fields:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # masked_linear: LeNet fc1 (3136 → 200), batch 256, float32 IEEE and TF32, float64.
    for dtype, allow_tf32, rtol in ((torch.float32, False, 1e-4), (torch.float32, True, 2e-2),
                                    (torch.float64, False, 1e-10)):
        w = torch.randn(200, 3136, device="cuda", dtype=dtype, generator=gen) / 56
        v = torch.randn(256, 3136, device="cuda", dtype=dtype, generator=gen)
        mo = torch.rand(256, 200, device="cuda", generator=gen) > 0.5
        mi = torch.rand(256, 3136, device="cuda", generator=gen) > 0.5
        y = masked_linear_triton(v, w, out_mask=mo, in_mask=mi, allow_tf32=allow_tf32)
        expected = masked_linear_reference(v.double(), w.double(), out_mask=mo, in_mask=mi)
        scale = expected.abs().max()
        assert ((y.double() - expected).abs() <= rtol * scale).all(), (dtype, allow_tf32)
