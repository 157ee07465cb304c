"""Masked products of a ``Conv2d`` layer for a batch, with the masks applied inside an implicit-GEMM Triton kernel —
the convolution factors of the power iterations (training estimate and probabilistic certificate bound).

For a convolution ``W`` (``groups=1``, zero padding, any stride/padding/dilation) and, per sample ``b``, an output
mask ``m_b`` (``[C_out, H_out, W_out]``) and an input factor ``f_b`` (``[C_in, H, W]``: the folded ``1/sd`` times the
previous layer's varying mask), the operator of :class:`splitz_fast.bounds.operators.MaskedAffine` is
``A_b = diag(m_b) · W · diag(f_b)``. This op computes, batched:

* ``transpose=False`` (``matvec``):  ``y_b = m_b ⊙ conv(f_b ⊙ v_b)``,            ``v: [B, C_in, H, W] → [B, C_out, H_out, W_out]``;
* ``transpose=True``  (``rmatvec``): ``v_b = f_b ⊙ convᵀ(m_b ⊙ u_b)``,           ``u → [B, C_in, H, W]``.

Each program owns ``BLOCK_M`` output pixels × ``BLOCK_N`` output channels and walks the receptive field tap by tap
(``C_in·k_h·k_w`` taps forward; for the transpose, the ``C_out·k_h·k_w`` taps whose stride phase lands on the pixel),
multiplying the factor into the operand as it is loaded and the mask into the accumulator before the store: no
masked copy of the vector and no ``x.repeat`` is materialized. Masks and factors may be per sample (``[B, …]``) or
shared (``[1, …]``), in any memory format (strides are passed), bool or float.

:class:`MaskedConv2dFunction` is the ``autograd.Function`` used by the training estimate: forward in Triton, the
vector gradient is the same kernel with ``transpose`` flipped, and the weight gradient (a reduction over batch and
pixels, needed once per training step) uses ``torch.nn.grad.conv2d_weight`` on the masked operands.
Summation order differs from cuDNN/oneDNN, so results agree with the reference within rounding, not bit for bit.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import interpreting

__all__ = ["MaskedConv2dFunction", "masked_conv2d", "masked_conv2d_reference", "masked_conv2d_triton"]

OP_NAME = "masked_conv2d"
_BLOCK_M = 32
_BLOCK_N = 16


def _geometry(layer: nn.Conv2d) -> tuple[int, ...]:
    if not isinstance(layer, nn.Conv2d) or layer.groups != 1 or layer.padding_mode != "zeros" \
            or isinstance(layer.padding, str):
        raise ValueError("masked_conv2d supports nn.Conv2d with groups=1, zero padding and integer padding")
    return (*layer.kernel_size, *layer.stride, *layer.padding, *layer.dilation)


def _out_size(in_size: tuple[int, int], layer: nn.Conv2d) -> tuple[int, int]:
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(layer)
    return ((in_size[0] + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (in_size[1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1)


def _check(x: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, transpose: bool, in_size) -> tuple[int, int]:
    _geometry(layer)
    if weight.dtype not in (torch.float32, torch.float64) or x.dtype != weight.dtype:
        raise TypeError(f"the vector ({x.dtype}) and the weight ({weight.dtype}) must both be float32 or float64")
    channels = weight.shape[0] if transpose else weight.shape[1]
    if x.ndim != 4 or x.shape[1] != channels or x.shape[0] < 1:
        raise ValueError(f"the vector must be [B, {channels}, H, W] with B >= 1, got {tuple(x.shape)}")
    if transpose:
        if in_size is None:
            raise ValueError("transpose=True needs in_size, the (H, W) of the layer's input")
        if tuple(x.shape[-2:]) != _out_size(tuple(in_size), layer):
            raise ValueError(f"u has spatial size {tuple(x.shape[-2:])}, but this layer maps {tuple(in_size)} to "
                             f"{_out_size(tuple(in_size), layer)}")
        return tuple(in_size)
    return tuple(x.shape[-2:])


def _per_sample(name: str, t: torch.Tensor | None, batch: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``[B, *shape]`` or ``[1, *shape]`` view (any strides) of a mask/factor."""
    if t is None:
        return None
    if t.ndim == len(shape):
        t = t.unsqueeze(0)
    if tuple(t.shape[1:]) != shape or t.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be [B or 1, {', '.join(map(str, shape))}], got {tuple(t.shape)}")
    return t


# --------------------------------------------------------------------------------------------------------------------
# Reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------------------------

def conv2d_adjoint(u: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, in_size: tuple[int, int]) -> torch.Tensor:
    """``Wᵀ u`` for the zero-padded convolution ``layer`` (weights ``weight``) whose input is ``[*, C_in, *in_size]``:
    a transposed convolution, with the output padding that restores ``in_size`` when the stride drops pixels."""
    out_padding = []
    for size_in, size_out, k, s, p, d in zip(in_size, u.shape[-2:], layer.kernel_size, layer.stride, layer.padding,
                                             layer.dilation):
        out_padding.append(size_in - ((size_out - 1) * s - 2 * p + d * (k - 1) + 1))
    return F.conv_transpose2d(u, weight, None, layer.stride, layer.padding, tuple(out_padding), 1, layer.dilation)


def masked_conv2d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    layer: nn.Conv2d,
    *,
    out_mask: torch.Tensor | None = None,
    in_factor: torch.Tensor | None = None,
    transpose: bool = False,
    in_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """PyTorch ``A x`` / ``Aᵀ x`` (differentiable through PyTorch's own autograd)."""
    in_size = _check(x, weight, layer, transpose, in_size)
    if not transpose:
        v = x if in_factor is None else x * in_factor.to(x.dtype)
        y = F.conv2d(v, weight, None, layer.stride, layer.padding, layer.dilation)
        return y if out_mask is None else y * out_mask.to(x.dtype)
    u = x if out_mask is None else x * out_mask.to(x.dtype)
    v = conv2d_adjoint(u, weight, layer, in_size)
    return v if in_factor is None else v * in_factor.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels (built lazily: importing this module never imports triton)
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # Module globals, not locals: Triton (compiled and interpreted) looks a kernel's callees up in its globals.
    global pixel_of, tap_of
    from ._conv_indexing import pixel_of, tap_of

    @triton.jit
    def _forward(
        V, W, FAC, MOUT, OUT,
        rows, C_OUT, C_IN, H, WID, H_OUT, W_OUT, KH, KW, SH, SW, PH, PW, DH, DW,
        sv_b, sv_c, sv_h, sv_w, sf_b, sf_c, sf_h, sf_w, sm_b, sm_c, sm_h, sm_w,
        HAS_FAC: tl.constexpr, HAS_MOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)    # output pixels (b, oy, ox)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # output channels
        m_in = m < rows
        n_in = n < C_OUT
        spatial = H_OUT * W_OUT
        b, p, oy, ox = pixel_of(m, H_OUT, W_OUT)
        acc = tl.zeros([BLOCK_M, BLOCK_N], OUT.dtype.element_ty)
        taps = KH * KW
        for k in range(0, C_IN * taps):
            ci, ky, kx = tap_of(k, KH, KW)
            iy = oy * SH - PH + ky * DH
            ix = ox * SW - PW + kx * DW
            valid = m_in & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < WID)
            val = tl.load(V + b * sv_b + ci * sv_c + iy * sv_h + ix * sv_w, mask=valid, other=0.0)
            if HAS_FAC:
                val *= tl.load(FAC + b * sf_b + ci * sf_c + iy * sf_h + ix * sf_w, mask=valid, other=0).to(val.dtype)
            w = tl.load(W + n * (C_IN * taps) + k, mask=n_in, other=0.0)
            acc += val[:, None] * w[None, :]
        ok = m_in[:, None] & n_in[None, :]
        if HAS_MOUT:
            mo = tl.load(MOUT + b[:, None] * sm_b + n[None, :] * sm_c + (oy * sm_h + ox * sm_w)[:, None], mask=ok,
                         other=0)
            acc *= mo.to(acc.dtype)
        tl.store(OUT + b[:, None] * (C_OUT * spatial) + n[None, :] * spatial + p[:, None], acc, mask=ok)

    @triton.jit
    def _adjoint(
        U, W, FAC, MOUT, OUT,
        rows, C_OUT, C_IN, H, WID, H_OUT, W_OUT, KH, KW, SH, SW, PH, PW, DH, DW,
        su_b, su_c, su_h, su_w, sf_b, sf_c, sf_h, sf_w, sm_b, sm_c, sm_h, sm_w,
        HAS_FAC: tl.constexpr, HAS_MOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)    # input pixels (b, iy, ix)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # input channels
        m_in = m < rows
        n_in = n < C_IN
        spatial = H * WID
        b, p, iy, ix = pixel_of(m, H, WID)
        acc = tl.zeros([BLOCK_M, BLOCK_N], OUT.dtype.element_ty)
        taps = KH * KW
        for k in range(0, C_OUT * taps):
            co, ky, kx = tap_of(k, KH, KW)
            ty = iy + PH - ky * DH   # = oy·SH for the output pixel this tap comes from, if the phase matches
            tx = ix + PW - kx * DW
            oy = ty // SH
            ox = tx // SW
            valid = m_in & (ty >= 0) & (tx >= 0) & (oy * SH == ty) & (ox * SW == tx) & (oy < H_OUT) & (ox < W_OUT)
            val = tl.load(U + b * su_b + co * su_c + oy * su_h + ox * su_w, mask=valid, other=0.0)
            if HAS_MOUT:
                val *= tl.load(MOUT + b * sm_b + co * sm_c + oy * sm_h + ox * sm_w, mask=valid, other=0).to(val.dtype)
            w = tl.load(W + co * (C_IN * taps) + n * taps + ky * KW + kx, mask=n_in, other=0.0)
            acc += val[:, None] * w[None, :]
        ok = m_in[:, None] & n_in[None, :]
        if HAS_FAC:
            fa = tl.load(FAC + b[:, None] * sf_b + n[None, :] * sf_c + (iy * sf_h + ix * sf_w)[:, None], mask=ok,
                         other=0)
            acc *= fa.to(acc.dtype)
        tl.store(OUT + b[:, None] * (C_IN * spatial) + n[None, :] * spatial + p[:, None], acc, mask=ok)

    return _forward, _adjoint


def _strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    if t is None:
        return (0, 0, 0, 0)
    s = t.stride()
    return (s[0] if t.shape[0] > 1 else 0, s[1], s[2], s[3])  # a shared [1, …] mask broadcasts over the batch


def _launch(x, weight, layer, out_mask, in_factor, transpose, in_size) -> torch.Tensor:
    import triton

    in_size = _check(x, weight, layer, transpose, in_size)
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(layer)
    c_out, c_in = weight.shape[:2]
    h_out, w_out = _out_size(in_size, layer)
    batch = x.shape[0]
    out_mask = _per_sample("out_mask", out_mask, batch, (c_out, h_out, w_out))
    in_factor = _per_sample("in_factor", in_factor, batch, (c_in, *in_size))
    # After the argument checks, so that a bad argument gets its own message on every machine.
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("masked_conv2d_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if out_mask is not None and out_mask.dtype == torch.bool:
        out_mask = out_mask.view(torch.uint8)
    if in_factor is not None and in_factor.dtype == torch.bool:
        in_factor = in_factor.view(torch.uint8)
    w = weight.detach().contiguous()
    shape = (batch, c_in, *in_size) if transpose else (batch, c_out, h_out, w_out)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    rows = batch * shape[2] * shape[3]
    if rows == 0:
        return out
    forward, adjoint = _kernels()
    dummy = out  # placeholder for absent pointers (never dereferenced: the constexpr flags drop those loads)
    grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(shape[1], _BLOCK_N))
    (adjoint if transpose else forward)[grid](
        x.detach(), w, dummy if in_factor is None else in_factor, dummy if out_mask is None else out_mask, out,
        rows, c_out, c_in, in_size[0], in_size[1], h_out, w_out, kh, kw, sh, sw, ph, pw, dh, dw,
        *x.stride(), *_strides(in_factor), *_strides(out_mask),
        HAS_FAC=in_factor is not None, HAS_MOUT=out_mask is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )
    return out


class MaskedConv2dFunction(torch.autograd.Function):
    """Forward in Triton; gradients w.r.t. the vector (the flipped product, in Triton) and the weight (masks and
    factors are constants)."""

    @staticmethod
    def forward(ctx, x, weight, layer, out_mask, in_factor, transpose, in_size):
        ctx.layer, ctx.transpose, ctx.in_size = layer, transpose, _check(x, weight, layer, transpose, in_size)
        ctx.save_for_backward(x, weight, out_mask, in_factor)
        return _launch(x, weight, layer, out_mask, in_factor, transpose, in_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, out_mask, in_factor = ctx.saved_tensors
        layer, transpose, in_size = ctx.layer, ctx.transpose, ctx.in_size
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _launch(grad.contiguous(), weight, layer, out_mask, in_factor, not transpose, in_size)
        if ctx.needs_input_grad[1]:
            # ∂/∂W of ⟨g, m ⊙ W(f ⊙ v)⟩: the weight gradient of a convolution with input f ⊙ v and output grad m ⊙ g.
            out_side, in_side = (grad, x) if not transpose else (x, grad)
            if out_mask is not None:
                out_side = out_side * out_mask.to(out_side.dtype)
            if in_factor is not None:
                in_side = in_side * in_factor.to(in_side.dtype)
            grad_w = torch.nn.grad.conv2d_weight(in_side, weight.shape, out_side, layer.stride, layer.padding,
                                                 layer.dilation)
        return grad_x, grad_w, None, None, None, None, None


def masked_conv2d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    layer: nn.Conv2d,
    *,
    out_mask: torch.Tensor | None = None,
    in_factor: torch.Tensor | None = None,
    transpose: bool = False,
    in_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Triton ``A x`` / ``Aᵀ x`` with autograd (gradients w.r.t. ``x`` and ``weight``)."""
    for name, t in (("out_mask", out_mask), ("in_factor", in_factor)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} must not require grad (masks and factors are constants of the operator)")
    return MaskedConv2dFunction.apply(x, weight, layer, out_mask, in_factor, transpose, in_size)


def masked_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    layer: nn.Conv2d,
    *,
    backend: str | None = None,
    **options,
) -> torch.Tensor:
    """Dispatching entry point (``options``: ``out_mask``, ``in_factor``, ``transpose``, ``in_size``):
    ``backend`` ``"triton"`` / ``"reference"``, or ``None`` for
    ``splitz_fast.kernels.select_backend("masked_conv2d", x.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if backend is None:
        from . import select_backend

        backend = select_backend(OP_NAME, x.device)
    if backend == "triton":
        return masked_conv2d_triton(x, weight, layer, **options)
    if backend == "reference":
        return masked_conv2d_reference(x, weight, layer, **options)
    raise ValueError(f"backend must be 'triton', 'reference' or None, got {backend!r}")
