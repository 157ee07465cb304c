"""The masked convolution factor of the training Lipschitz estimate, fused per image: its power step and its norm.

For a ``Conv2d`` factor ``A_b = diag(m_b) W diag(f_b)`` of :func:`splitz_fast.bounds.estimate.lipschitz_estimate`
(``m`` the varying mask of the layer's outputs, ``f`` the input factor: the previous layer's mask and/or ``1/sd``):

* :func:`masked_conv_gram` — ``A_bᵀ A_b v_b = f ⊙ Wᵀ(m ⊙ W(f ⊙ v_b))``, one power step, without gradient;
* :func:`masked_conv_norm` — ``‖A_b v_b‖₂`` per image, differentiable with respect to ``W`` (and ``v``): the factor
  of the estimate that carries the gradient.

The PyTorch reference runs a convolution, the mask product, a transposed convolution and the factor product, each a
pass over the ``[B, C_out, H_out, W_out]`` activation (for LeNet's conv1 at batch 256: 25.7 MB per pass, ten passes
per power step counting the mask multiply). The native kernel (``csrc/train_cpu.cpp``) walks one image and one output
channel at a time: the output plane (``H_out·W_out`` values) is computed, masked and sent back through the transposed
taps while it sits in the cache, so the only full-size traffic is the ``uint8`` mask. Its backward (gradient of
``Σ_b g_b ‖A_b v_b‖``) recomputes the plane rather than storing it.

Shapes: ``v`` ``[B, C_in, H, W]`` float32/float64; ``weight`` ``[C_out, C_in, kh, kw]`` (the layer's geometry —
stride, padding, dilation — comes from ``layer``, an ``nn.Conv2d`` with ``groups=1`` and zero padding);
``out_mask`` ``[B, C_out, H_out, W_out]`` bool/0-1 or ``None``; ``in_factor`` ``[1 or B, C_in, H, W]`` or ``None``.
Summation order: the native kernel sums each output over the taps in ``(c, ky, kx)`` order and each adjoint input in
output-channel order — not oneDNN's order, so it agrees with the reference to float rounding, not bit for bit.
Gradients flow to ``weight`` and ``v`` (not to the mask or the factor, which are constants of the estimate).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .masked_conv2d import conv2d_adjoint

__all__ = ["input_factor", "masked_conv_gram", "masked_conv_gram_reference", "masked_conv_norm",
           "masked_conv_norm_reference", "native_conv_ok"]

OP_NAME = "conv_power"
# The native kernel runs a direct convolution (axpys along image rows): worth it while each output sums few taps
# (LeNet conv1: 9, a 3-channel 3x3 stem: 27); wider layers stay on oneDNN's GEMMs.
NATIVE_MAX_TAPS = 32


def _check(v: torch.Tensor, weight: torch.Tensor, layer: nn.Module, out_mask, in_factor) -> None:
    if not isinstance(layer, nn.Conv2d) or layer.groups != 1 or layer.padding_mode != "zeros" \
            or isinstance(layer.padding, str):
        raise ValueError(f"layer must be an nn.Conv2d with groups=1, zero padding and integer padding, got {layer}")
    if not isinstance(v, torch.Tensor) or v.ndim != 4 or v.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"v must be a float32/float64 [B, C_in, H, W] tensor, got {getattr(v, 'shape', type(v))}")
    if tuple(weight.shape) != tuple(layer.weight.shape) or v.shape[1] != weight.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit layer {layer} and v {tuple(v.shape)}")
    if out_mask is not None and (out_mask.ndim != 4 or out_mask.shape[0] != v.shape[0]
                                 or out_mask.shape[1] != weight.shape[0]):
        raise ValueError(f"out_mask must be [B, C_out, H_out, W_out] = [{v.shape[0]}, {weight.shape[0]}, ...], got "
                         f"{tuple(out_mask.shape)}")
    if in_factor is not None and (in_factor.ndim != 4 or in_factor.shape[0] not in (1, v.shape[0])
                                  or tuple(in_factor.shape[1:]) != tuple(v.shape[1:])):
        raise ValueError(f"in_factor must be [1 or B, *v.shape[1:]] = [1 or {v.shape[0]}, {tuple(v.shape[1:])}], "
                         f"got {tuple(in_factor.shape)}")


def native_conv_ok(layer: nn.Module) -> bool:
    """Whether the native kernel is the faster path for this layer (a ``Conv2d`` with at most ``NATIVE_MAX_TAPS`` taps
    per output)."""
    return (isinstance(layer, nn.Conv2d) and layer.groups == 1 and layer.padding_mode == "zeros"
            and not isinstance(layer.padding, str)
            and layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1] <= NATIVE_MAX_TAPS)


def input_factor(in_mask: torch.Tensor | None, in_scale: torch.Tensor | None, in_shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The input factor ``f = in_mask ⊙ in_scale`` as ``[1 or B, *in_shape]`` in ``dtype`` (``None`` when both are
    ``None``), as :class:`splitz_fast.bounds.operators.MaskedAffine` forms it."""
    factor = None if in_scale is None else in_scale.to(dtype).expand(1, *in_shape)
    if in_mask is not None:
        m = in_mask.to(dtype).reshape(-1, *in_shape)
        factor = m if factor is None else m * factor
    return factor


# --------------------------------------------------------------------------------------------------------------------
# Reference (the test oracle, and the path wherever the native module is not used)
# --------------------------------------------------------------------------------------------------------------------

def _forward_reference(v, weight, layer, out_mask, in_factor):
    if in_factor is not None:
        v = v * in_factor.to(v.dtype)
    y = F.conv2d(v, weight.to(v.dtype), None, layer.stride, layer.padding, layer.dilation)
    return y if out_mask is None else y * out_mask.to(v.dtype)


@torch.no_grad()
def masked_conv_gram_reference(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                               out_mask: torch.Tensor | None = None,
                               in_factor: torch.Tensor | None = None) -> torch.Tensor:
    """``f ⊙ Wᵀ(m ⊙ W(f ⊙ v))`` in PyTorch ops: ``[B, C_in, H, W]`` → the same shape."""
    _check(v, weight, layer, out_mask, in_factor)
    y = _forward_reference(v, weight, layer, out_mask, in_factor)
    out = conv2d_adjoint(y, weight.to(v.dtype), layer, tuple(v.shape[-2:]))
    return out if in_factor is None else out * in_factor.to(v.dtype)


def masked_conv_norm_reference(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                               out_mask: torch.Tensor | None = None,
                               in_factor: torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` norms ``‖m ⊙ W(f ⊙ v_b)‖₂`` in PyTorch ops (differentiable through PyTorch's autograd)."""
    _check(v, weight, layer, out_mask, in_factor)
    return _forward_reference(v, weight, layer, out_mask, in_factor).flatten(1).norm(dim=1)


# --------------------------------------------------------------------------------------------------------------------
# Native kernels (csrc/train_cpu.cpp)
# --------------------------------------------------------------------------------------------------------------------

def _module():
    from .native import train_module

    module = train_module()
    if module is None:
        raise RuntimeError("the native training kernels of splitz_fast (csrc/train_cpu.cpp) are not available on this "
                           "machine (see the warning above); use the reference (SPLITZ_BACKEND=reference)")
    return module


def _native_operands(v, weight, layer, out_mask, in_factor):
    if v.device.type != "cpu":
        raise ValueError(f"v is on {v.device}: the native conv_power kernels run on CPU tensors")
    v = v.detach().contiguous()
    w = weight.detach().to(v.dtype).contiguous()
    mask = None
    if out_mask is not None:
        mask = out_mask.detach()
        mask = (mask.bool() if mask.dtype != torch.bool else mask).contiguous().view(torch.uint8)
    factor = None if in_factor is None else in_factor.detach().to(v.dtype).contiguous()
    geometry = (list(layer.stride), list(layer.padding), list(layer.dilation))
    return v, w, mask, factor, geometry


@torch.no_grad()
def masked_conv_gram_native(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                            out_mask: torch.Tensor | None = None,
                            in_factor: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`masked_conv_gram_reference` by the C++ kernel (CPU tensors; out_mask read as ``!= 0``)."""
    _check(v, weight, layer, out_mask, in_factor)
    v, w, mask, factor, geometry = _native_operands(v, weight, layer, out_mask, in_factor)
    return _module().masked_conv_gram(v, w, mask, factor, *geometry)


class _MaskedConvNorm(torch.autograd.Function):
    """``‖m ⊙ W(f ⊙ v_b)‖₂`` per image by the native kernel; backward: ``∂/∂W = Σ_b (g_b/n_b) (m ⊙ y_b) ⋆ (f ⊙ v_b)``
    (recomputing ``y_b``) and ``∂/∂v_b = (g_b/n_b) A_bᵀA_b v_b``; a zero norm has a zero gradient (as torch's norm)."""

    @staticmethod
    def forward(ctx, v, weight, layer, out_mask, in_factor):
        v_c, w, mask, factor, geometry = _native_operands(v, weight, layer, out_mask, in_factor)
        norms = _module().masked_conv_sumsq(v_c, w, mask, factor, *geometry).clamp_min(0).sqrt()
        ctx.save_for_backward(v_c, w, norms)
        ctx.extras = (mask, factor, geometry, weight.dtype)
        return norms

    @staticmethod
    def backward(ctx, grad):
        v, w, norms = ctx.saved_tensors
        mask, factor, geometry, weight_dtype = ctx.extras
        scale = torch.where(norms > 0, grad.to(norms.dtype) / norms.clamp_min(torch.finfo(norms.dtype).tiny),
                            torch.zeros_like(norms)).contiguous()
        grad_v = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_v = _module().masked_conv_gram(v, w, mask, factor, *geometry) * scale.view(-1, 1, 1, 1)
        if ctx.needs_input_grad[1]:
            # d‖y‖/dW = (1/‖y‖) Σ y ∂y/∂W = (1/(2‖y‖)) d‖y‖²/dW.
            grad_w = _module().masked_conv_sumsq_grad_weight(v, w, mask, factor, scale * 0.5, *geometry)
            grad_w = grad_w.to(weight_dtype)
        return grad_v, grad_w, None, None, None


def masked_conv_norm_native(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                            out_mask: torch.Tensor | None = None,
                            in_factor: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`masked_conv_norm_reference` by the C++ kernel, an ``autograd.Function`` (gradients w.r.t. ``weight``
    and ``v``)."""
    _check(v, weight, layer, out_mask, in_factor)
    return _MaskedConvNorm.apply(v, weight, layer, out_mask, in_factor)


# --------------------------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------------------------

def _backend(backend: str | None, v: torch.Tensor) -> str:
    if backend is None:
        from . import select_backend
        backend = select_backend(OP_NAME, v.device)
    if backend not in ("native", "reference"):
        raise ValueError(f"backend must be 'native', 'reference' or None, got {backend!r}")
    return backend


def masked_conv_gram(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                     out_mask: torch.Tensor | None = None, in_factor: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """One power step ``A_bᵀA_b v_b`` (see module docstring); ``backend`` ``"native"`` / ``"reference"``, or ``None``
    for ``select_backend("conv_power", v.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if _backend(backend, v) == "native":
        return masked_conv_gram_native(v, weight, layer, out_mask=out_mask, in_factor=in_factor)
    return masked_conv_gram_reference(v, weight, layer, out_mask=out_mask, in_factor=in_factor)


def masked_conv_norm(v: torch.Tensor, weight: torch.Tensor, layer: nn.Conv2d, *,
                     out_mask: torch.Tensor | None = None, in_factor: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """``[B]`` norms ``‖A_b v_b‖₂``, differentiable w.r.t. ``weight`` and ``v`` (dispatch as :func:`masked_conv_gram`)."""
    if _backend(backend, v) == "native":
        return masked_conv_norm_native(v, weight, layer, out_mask=out_mask, in_factor=in_factor)
    return masked_conv_norm_reference(v, weight, layer, out_mask=out_mask, in_factor=in_factor)
