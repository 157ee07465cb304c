"""The rule of ``nn.Linear`` in ``f_L``; an image input is flattened first (as ``nn.Flatten`` would)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.masked_linear import masked_linear
from .base import LayerRule


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(t.shape[0], -1)


class LinearRule(LayerRule):
    """``nn.Linear`` as the dense matrix ``W: [out, in]`` on flattened inputs."""

    kind = nn.Linear
    flattens_input = True
    channels_last = False
    banded_gram = False
    masked_kernel = "masked_linear"
    noun = "linear layer"
    fold_kinds = (nn.Linear,)

    def apply(self, layer: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, layer.weight, layer.bias)

    def linear_part(self, layer: nn.Linear, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.layer_input(h), weight)

    def adjoint(self, layer: nn.Linear, u: torch.Tensor, weight: torch.Tensor, in_shape: tuple[int, ...]
                ) -> torch.Tensor:
        return (u @ weight).reshape(u.shape[0], *in_shape)

    def masked_apply(self, layer: nn.Linear, v: torch.Tensor, weight: torch.Tensor, *, out_mask: torch.Tensor | None,
                     in_factor: torch.Tensor | None) -> torch.Tensor:
        return masked_linear(v.reshape(v.shape[0], -1), weight, out_mask=out_mask, in_mask=_flat(in_factor),
                             backend="triton")

    def masked_adjoint(self, layer: nn.Linear, u: torch.Tensor, weight: torch.Tensor, *,
                       out_mask: torch.Tensor | None, in_factor: torch.Tensor | None, in_shape: tuple[int, ...]
                       ) -> torch.Tensor:
        v = masked_linear(u, weight, out_mask=out_mask, in_mask=_flat(in_factor), transpose=True, backend="triton")
        return v.reshape(u.shape[0], *in_shape)

    def out_features(self, layer: nn.Module) -> int:
        return layer.out_features

    def fold_batchnorm(self, layer: nn.Linear, scale: torch.Tensor, shift: torch.Tensor) -> nn.Module:
        weight, bias = self.folded_parameters(layer, scale, shift)
        return LinearBatchNorm1d(layer, weight, bias, scale, shift).train(False)


class LinearBatchNorm1d(nn.Module):
    """``BatchNorm1d(Linear(x))`` in eval mode. For ``[B, F]`` inputs (the BatchNorm normalizes the linear layer's
    outputs) one linear layer with the BatchNorm folded in; for higher-rank inputs ``[B, C, ..., F]`` the BatchNorm
    normalizes dim 1, not the features, so the linear layer runs as it is and the per-channel affine map after it."""

    def __init__(self, linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor,
                 shift: torch.Tensor):
        super().__init__()
        dtype = linear.weight.dtype
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        self.linear = linear
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("shift", shift.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            return F.linear(x, self.weight, self.bias)
        y = self.linear(x)
        if y.ndim != 3:
            raise ValueError(f"BatchNorm1d expects 2D or 3D input (got {y.ndim}D input)")
        return y * self.scale.view(-1, 1).to(y.dtype) + self.shift.view(-1, 1).to(y.dtype)
