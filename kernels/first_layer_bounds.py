"""Fused first layer of ``f_L``'s ball bounds: standardization, the affine layer, the exact l2-ball bound, the varying
mask and the clipped output, in one pass over the input.

For the first affine layer ``z = W h + b`` with ``h = (x − mean) / std`` (no standardization: ``h = x``), zero padding
in ``h`` space, and a ball ``‖x' − x‖₂ ≤ γ_b`` per sample ``b``::

    r_i     = sqrt(Σ_taps w_ij² / std_j²)            taps of neuron i that land inside the input (‖w_i D‖₂)
    r_eff   = γ_b · r_i
    margin  = rel_rounding · (Σ_taps |w_ij| |h_j| + |b_i| + r_eff)      (only when rel_rounding > 0)
    lower   = z − (r_eff + margin),  upper = z + (r_eff + margin)
    mask    = (upper > 0) & (lower < θ)                (all True without activation, θ = None)
    latent  = min(max(z, 0), θ)                        f_L(x) of a one-layer f_L
    center, radius of [clip(lower), clip(upper)]       the interval that feeds layer 2

— the ``k = 0`` step of :func:`splitz_fast.bounds.intervals.ball_bounds`, where ``rel_rounding = bounds.ROUNDING_MARGIN``
for certificates (float64) and 0 for the training estimate (float32). The margin dominates the rounding error of the
sums whatever their order (see bounds.py), so the kernel's summation order (tap by tap) needs no bit-equality with
the reference's convolution: the tests compare within float64/float32 rounding.

Layers: ``nn.Conv2d`` (any stride, padding, dilation; ``groups=1``, zero padding) as an implicit GEMM — each
program owns ``BLOCK_M`` output positions × ``BLOCK_N`` output channels and walks the ``C_in·k_h·k_w`` taps once,
accumulating ``z``, ``Σ|w||h|`` and ``Σ w²/std²`` together, so ``x`` is read once and nothing but the outputs is
written. ``nn.Linear`` runs as the 1×1 convolution of a 1×1 image with ``in_features`` channels.

Shapes: ``x`` ``[B, C, H, W]`` (conv) or ``[B, F]`` (linear); ``mean``/``std`` broadcastable to one input
(per channel or per element) or ``None``; ``gamma`` scalar or ``[B]``; ``theta`` as in :mod:`.interval_clip`.
Outputs (:class:`FirstLayerBounds`): ``[B, *out_shape]`` in ``x``'s dtype (float32/float64), ``mask`` bool.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import interpreting
from ._utils import gamma_vector
from .interval_clip import interval_clip_reference
from .thresholds import theta_broadcast, theta_mode

__all__ = ["FirstLayerBounds", "first_layer_bounds", "first_layer_bounds_reference", "first_layer_bounds_triton"]

OP_NAME = "first_layer_bounds"
_BLOCK_M = 32
_BLOCK_N = 16


class FirstLayerBounds(NamedTuple):
    lower: torch.Tensor
    upper: torch.Tensor
    mask: torch.Tensor
    center: torch.Tensor | None
    radius: torch.Tensor | None
    latent: torch.Tensor | None


def _check_args(x: torch.Tensor, layer: nn.Module) -> None:
    if not isinstance(layer, (nn.Conv2d, nn.Linear)):
        raise TypeError(f"layer must be nn.Conv2d or nn.Linear, got {type(layer).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"x must be a float32 or float64 tensor, got {getattr(x, 'dtype', type(x))}")
    if isinstance(layer, nn.Conv2d):
        if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise ValueError("the fused first layer supports Conv2d with groups=1, zero padding and integer padding")
        if x.ndim != 4 or x.shape[1] != layer.in_channels:
            raise ValueError(f"x must be [B, {layer.in_channels}, H, W] for this Conv2d, got {tuple(x.shape)}")
    elif x.ndim != 2 or x.shape[1] != layer.in_features:
        raise ValueError(f"x must be [B, {layer.in_features}] for this Linear, got {tuple(x.shape)}")


def _per_element(t: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """``mean``/``std`` as one value per input element ``[*x.shape[1:]]`` (per-channel values broadcast)."""
    if t is None:
        return None
    t = torch.as_tensor(t).detach().to(device=x.device, dtype=x.dtype)
    if x.ndim == 4 and t.ndim == 1:
        t = t.view(-1, 1, 1)
    try:
        return t.expand(x.shape[1:]).contiguous()
    except RuntimeError as err:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to one input {tuple(x.shape[1:])}") \
            from err


def _linear_part(layer: nn.Module, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, nn.Conv2d):
        return F.conv2d(h, weight, None, layer.stride, layer.padding, layer.dilation)
    return F.linear(h, weight)


# --------------------------------------------------------------------------------------------------------------------
# Reference (the CPU path and the test oracle): the k = 0 step of ball_bounds in PyTorch ops
# --------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def first_layer_bounds_reference(
    x: torch.Tensor,
    layer: nn.Module,
    gamma: float | torch.Tensor,
    theta: float | torch.Tensor | None,
    *,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    rel_rounding: float = 0.0,
    need_next: bool = True,
    need_latent: bool = False,
) -> FirstLayerBounds:
    _check_args(x, layer)
    x = x.detach()
    mean_t, std_t = _per_element(mean, x, "mean"), _per_element(std, x, "std")
    h = x if mean_t is None else (x - mean_t) / std_t
    s2 = torch.ones_like(x[:1]) if std_t is None else (1.0 / std_t).square().unsqueeze(0)
    w = layer.weight.detach().to(x.dtype)
    z = _linear_part(layer, h, w)
    if layer.bias is not None:
        bias = layer.bias.detach().to(x.dtype)
        z = z + (bias.view(1, -1, 1, 1) if z.ndim == 4 else bias)
    r = _linear_part(layer, s2, w.square()).clamp_min(0).sqrt()
    g = gamma_vector(gamma, z)
    margin = None
    if rel_rounding:
        magnitude = _linear_part(layer, h.abs(), w.abs())
        if layer.bias is not None:
            b_abs = layer.bias.detach().to(x.dtype).abs()
            magnitude = magnitude + (b_abs.view(1, -1, 1, 1) if z.ndim == 4 else b_abs)
        margin = rel_rounding * (magnitude + g.view(-1, *([1] * (z.ndim - 1))) * r)
    step = interval_clip_reference(z, r, theta, gamma=g, margin=margin, need_next=need_next)
    latent = None
    if need_latent:
        mode, values = theta_mode(theta, z)
        latent = z if mode == 0 else torch.minimum(z.clamp_min(0), theta_broadcast(mode, values, z))
    return FirstLayerBounds(step.lower, step.upper, step.mask, step.center, step.radius, latent)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernel (built lazily: importing this module never imports triton)
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # Module globals, not locals: Triton (compiled and interpreted) looks a kernel's callees up in its globals.
    global pixel_of, tap_of
    from ._conv_indexing import pixel_of, tap_of

    @triton.jit
    def first_layer_bounds_kernel(
        X, W, BIAS, MEAN, STD, GAMMA, THETA,
        LO, UP, MASK, CEN, RAD, LAT,
        rows, C_OUT, C_IN, H, WIDTH, H_OUT, W_OUT, KH, KW,
        SH, SW, PH, PW, DH, DW, rel_rounding,
        HAS_BIAS: tl.constexpr, STANDARDIZE: tl.constexpr, HAS_MARGIN: tl.constexpr, THETA_MODE: tl.constexpr,
        NEED_NEXT: tl.constexpr, NEED_LATENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # output positions (b, oy, ox)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                  # output channels
        m_in = m < rows
        n_in = n < C_OUT
        spatial = H_OUT * W_OUT
        b, p, oy, ox = pixel_of(m, H_OUT, W_OUT)
        dtype = X.dtype.element_ty
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype)
        magnitude = tl.zeros([BLOCK_M, BLOCK_N], dtype)
        r2 = tl.zeros([BLOCK_M, BLOCK_N], dtype)
        taps = KH * KW
        for k in range(0, C_IN * taps):   # one tap of the receptive field per step: x read once per output tile
            ci, ky, kx = tap_of(k, KH, KW)
            iy = oy * SH - PH + ky * DH
            ix = ox * SW - PW + kx * DW
            valid = m_in & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < WIDTH)
            element = (ci * H + iy) * WIDTH + ix
            h = tl.load(X + b * (C_IN * H * WIDTH) + element, mask=valid, other=0.0)
            inside = valid.to(dtype)                     # padded taps see neither the input nor the perturbation
            scale2 = inside
            if STANDARDIZE:
                mu = tl.load(MEAN + element, mask=valid, other=0.0)
                sd = tl.load(STD + element, mask=valid, other=1.0)
                h = tl.where(valid, (h - mu) / sd, 0.0)
                inv = 1.0 / sd
                scale2 = inside * inv * inv
            w = tl.load(W + n * (C_IN * taps) + k, mask=n_in, other=0.0)
            z += h[:, None] * w[None, :]
            r2 += scale2[:, None] * (w * w)[None, :]
            if HAS_MARGIN:
                magnitude += tl.abs(h)[:, None] * tl.abs(w)[None, :]
        if HAS_BIAS:
            bias = tl.load(BIAS + n, mask=n_in, other=0.0)
            z += bias[None, :]
            magnitude += tl.abs(bias)[None, :]
        g = tl.load(GAMMA + b, mask=m_in, other=0.0)
        r_eff = g[:, None] * tl.sqrt(tl.maximum(r2, 0.0))
        total = r_eff
        if HAS_MARGIN:
            total = r_eff + rel_rounding * (magnitude + r_eff)
        lo = z - total
        up = z + total
        out = b[:, None] * (C_OUT * spatial) + n[None, :] * spatial + p[:, None]
        ok = m_in[:, None] & n_in[None, :]
        tl.store(LO + out, lo, mask=ok)
        tl.store(UP + out, up, mask=ok)
        if THETA_MODE == 0:
            tl.store(MASK + out, tl.full([BLOCK_M, BLOCK_N], 1, tl.uint8), mask=ok)
            clo = lo
            cup = up
            lat = z
        else:
            if THETA_MODE == 1:
                th = tl.load(THETA + n * 0, mask=n_in, other=0.0)[None, :]
            elif THETA_MODE == 2:
                th = tl.load(THETA + n, mask=n_in, other=0.0)[None, :]
            else:
                th = tl.load(THETA + n[None, :] * spatial + p[:, None], mask=ok, other=0.0)
            tl.store(MASK + out, ((up > 0.0) & (lo < th)).to(tl.uint8), mask=ok)
            clo = tl.minimum(tl.maximum(lo, 0.0), th)
            cup = tl.minimum(tl.maximum(up, 0.0), th)
            lat = tl.minimum(tl.maximum(z, 0.0), th)
        if NEED_NEXT:
            tl.store(CEN + out, (clo + cup) * 0.5, mask=ok)
            tl.store(RAD + out, (cup - clo) * 0.5, mask=ok)
        if NEED_LATENT:
            tl.store(LAT + out, lat, mask=ok)

    return first_layer_bounds_kernel


def _conv_geometry(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(x as [B, C, H, W], (C_out, C_in, KH, KW), (H_out, W_out, SH, SW, PH, PW, DH, DW))``; a Linear is the 1×1
    convolution of a 1×1 image."""
    if isinstance(layer, nn.Linear):
        return x.reshape(x.shape[0], -1, 1, 1), (layer.out_features, layer.in_features, 1, 1), (1, 1, 1, 1, 0, 0, 1, 1)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    h, w = x.shape[-2:]
    h_out = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    w_out = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return x, (layer.out_channels, layer.in_channels, kh, kw), (h_out, w_out, sh, sw, ph, pw, dh, dw)


@torch.no_grad()
def first_layer_bounds_triton(
    x: torch.Tensor,
    layer: nn.Module,
    gamma: float | torch.Tensor,
    theta: float | torch.Tensor | None,
    *,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    rel_rounding: float = 0.0,
    need_next: bool = True,
    need_latent: bool = False,
) -> FirstLayerBounds:
    """The fused Triton pass (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    _check_args(x, layer)
    x = x.detach().contiguous()
    batch = x.shape[0]
    mean_t, std_t = _per_element(mean, x, "mean"), _per_element(std, x, "std")
    if (mean_t is None) != (std_t is None):
        raise ValueError("give both mean and std, or neither")
    # After the argument checks, so that a bad argument gets its own message on every machine.
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("first_layer_bounds_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    import triton

    x4, (c_out, c_in, kh, kw), (h_out, w_out, sh, sw, ph, pw, dh, dw) = _conv_geometry(layer, x)
    out_shape = (batch, c_out, h_out, w_out) if isinstance(layer, nn.Conv2d) else (batch, c_out)
    weight = layer.weight.detach().to(x.dtype).contiguous()
    bias = None if layer.bias is None else layer.bias.detach().to(x.dtype).contiguous()
    probe = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    g = gamma_vector(gamma, probe)
    mode, theta_t = theta_mode(theta, probe)
    lower, upper = torch.empty_like(probe), torch.empty_like(probe)
    mask = torch.empty(out_shape, dtype=torch.uint8, device=x.device)
    center = torch.empty_like(probe) if need_next else None
    radius = torch.empty_like(probe) if need_next else None
    latent = torch.empty_like(probe) if need_latent else None
    rows = batch * h_out * w_out
    if rows and c_out:
        dummy = lower  # placeholder for absent pointers (never dereferenced: the constexpr flags drop those loads)
        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(c_out, _BLOCK_N))
        _kernel()[grid](
            x4, weight, dummy if bias is None else bias, dummy if mean_t is None else mean_t,
            dummy if std_t is None else std_t, g, dummy if theta_t is None else theta_t,
            lower, upper, mask, dummy if center is None else center, dummy if radius is None else radius,
            dummy if latent is None else latent,
            rows, c_out, c_in, x4.shape[2], x4.shape[3], h_out, w_out, kh, kw, sh, sw, ph, pw, dh, dw,
            float(rel_rounding),
            HAS_BIAS=bias is not None, STANDARDIZE=mean_t is not None, HAS_MARGIN=bool(rel_rounding),
            THETA_MODE=mode, NEED_NEXT=need_next, NEED_LATENT=need_latent, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        )
    return FirstLayerBounds(lower, upper, mask.view(torch.bool), center, radius, latent)


def first_layer_bounds(
    x: torch.Tensor,
    layer: nn.Module,
    gamma: float | torch.Tensor,
    theta: float | torch.Tensor | None,
    *,
    backend: str | None = None,
    **options,
) -> FirstLayerBounds:
    """Dispatching entry point (``options``: ``mean``, ``std``, ``rel_rounding``, ``need_next``, ``need_latent`` as in
    :func:`first_layer_bounds_reference`): ``backend`` ``"triton"`` / ``"reference"``, or ``None`` for
    ``splitz_fast.kernels.select_backend("first_layer_bounds", x.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if backend is None:
        from . import select_backend

        backend = select_backend(OP_NAME, x.device)
    if backend == "triton":
        return first_layer_bounds_triton(x, layer, gamma, theta, **options)
    if backend == "reference":
        return first_layer_bounds_reference(x, layer, gamma, theta, **options)
    raise ValueError(f"backend must be 'triton', 'reference' or None, got {backend!r}")
