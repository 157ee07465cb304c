"""The masked linear operators whose spectral norms bound the Lipschitz constant of ``f_L``.

For affine layer ``k`` of ``f_L`` (weights ``W_k``), the factor in ``L(x, γ) ≤ Π_k ‖I_k W_k I_{k−1}‖`` is

    A_k = diag(out_mask) · W_k · diag(in_scale) · diag(in_mask)

per input of the batch: ``out_mask`` is the varying mask of layer ``k`` (all ones for the global bound or a layer
without activation), ``in_mask`` the varying mask of layer ``k−1`` (none for the first layer), ``in_scale`` the
folded ``1/sd`` (first layer only). :class:`MaskedAffine` applies ``A`` and ``Aᵀ`` batched and builds the explicit
float64 Gram matrix of one input, restricted to the varying inputs, for the exact bound (:mod:`splitz_fast.bounds.gram`:
dense for a Linear factor, banded and sparse for a convolution).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .intervals import linear_part
from ..kernels import select_backend
from ..model.layers import rule_for


def _channels_last(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.ndim != 4 else t.contiguous(memory_format=torch.channels_last)


class MaskedAffine:
    """``A_b = diag(m_out_b) W diag(s) diag(m_in_b)`` for a batch ``b = 0..B−1``.

    Args:
        layer: ``nn.Conv2d`` or ``nn.Linear`` (its weight is used as is, so gradients flow to it).
        in_shape: shape of one input of the layer, e.g. ``(3, 32, 32)``; ``(F,)`` or a conv shape for a Linear.
        out_mask: ``[B, *out_shape]`` bool/0-1, or ``None`` (no masking).
        in_mask: ``[B, *in_shape]`` bool/0-1, or ``None``.
        in_scale: tensor broadcastable to ``[1, *in_shape]`` (``1/sd``), or ``None``.
        batch: ``B`` (needed when both masks are ``None``).
    """

    def __init__(
        self,
        layer: nn.Module,
        in_shape: tuple[int, ...],
        *,
        out_mask: torch.Tensor | None,
        in_mask: torch.Tensor | None,
        in_scale: torch.Tensor | None,
        batch: int,
        dtype: torch.dtype = torch.float64,
    ):
        self.layer = layer
        self.rule = rule_for(layer)
        self.in_shape = tuple(in_shape)
        self.batch = batch
        self.dtype = dtype
        self.weight = layer.weight.to(dtype)
        self.out_mask = None if out_mask is None else out_mask.to(dtype)
        in_factor = None
        if in_scale is not None:
            in_factor = in_scale.to(dtype).expand(1, *self.in_shape)
        if in_mask is not None:
            m = in_mask.to(dtype).reshape(-1, *self.in_shape)
            in_factor = m if in_factor is None else m * in_factor
        self.in_factor = in_factor  # [1 or B, *in_shape] or None
        # The layer kind's fused masked Triton op (masked matmul, masked implicit-GEMM convolution) runs where the
        # dispatch picks it (CUDA, or SPLITZ_BACKEND=triton).
        self._triton = select_backend(self.rule.masked_kernel, self.weight.device) == "triton"
        if self.rule.channels_last and not self._triton:
            # NHWC operands take the faster convolution path (CPU: ~1.6x per power step for LeNet's conv1).
            self.out_mask = _channels_last(self.out_mask)
            self.in_factor = _channels_last(self.in_factor)
        self.in_mask = None if in_mask is None else in_mask.reshape(-1, *self.in_shape).bool()

    @property
    def out_shape(self) -> tuple[int, ...]:
        probe = torch.zeros(1, *self.in_shape, dtype=self.dtype, device=self.weight.device)
        return tuple(linear_part(self.layer, probe, self.weight.detach()).shape[1:])

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A v`` for ``v: [B, *in_shape]`` → ``[B, *out_shape]``."""
        if self._triton:
            return self.rule.masked_apply(self.layer, v, self.weight, out_mask=self.out_mask,
                                          in_factor=self.in_factor)
        if self.in_factor is not None:
            v = v * self.in_factor
        y = linear_part(self.layer, v, self.weight)
        return y if self.out_mask is None else y * self.out_mask

    def gram_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``AᵀA v`` (one power step); the output mask is applied once, not twice."""
        return self.rmatvec(self.matvec(v), masked=True)

    def rmatvec(self, u: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """``Aᵀ u`` for ``u: [B, *out_shape]`` → ``[B, *in_shape]`` (``masked``: ``u`` is already zero off the mask)."""
        if self._triton:
            return self.rule.masked_adjoint(self.layer, u, self.weight, out_mask=None if masked else self.out_mask,
                                            in_factor=self.in_factor, in_shape=self.in_shape)
        if self.out_mask is not None and not masked:
            u = u * self.out_mask
        v = self.rule.adjoint(self.layer, u, self.weight, self.in_shape)
        return v if self.in_factor is None else v * self.in_factor
