"""The rule of ``nn.Conv2d`` in ``f_L``: zero padding given as numbers, ``groups=1``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.masked_conv2d import conv2d_adjoint, masked_conv2d
from .base import LayerRule


class Conv2dRule(LayerRule):
    """``nn.Conv2d`` as the zero-padded linear operator on ``[C_in, H, W]`` inputs that the bounds read."""

    kind = nn.Conv2d
    computing_methods = ("forward", "_conv_forward")
    flattens_input = False
    channels_last = True
    banded_gram = True
    masked_kernel = "masked_conv2d"
    noun = "convolution"
    # A per-output-channel scale folds into a convolution of any dimension alike: f_R's Conv1d and Conv3d fold here.
    fold_kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def check_configuration(self, layer: nn.Conv2d) -> None:
        if layer.groups != 1 or layer.padding_mode != "zeros":
            raise ValueError("f_L supports Conv2d with groups=1 and padding_mode='zeros' only")
        if isinstance(layer.padding, str):
            raise ValueError(f"f_L's Conv2d needs integer padding, got padding={layer.padding!r}: write it out "
                             "(padding=0 for 'valid'; for 'same' with stride 1, padding=dilation·(kernel_size − 1)/2 "
                             "per side, an odd kernel)")

    def apply(self, layer: nn.Conv2d, h: torch.Tensor) -> torch.Tensor:
        return F.conv2d(h, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation, layer.groups)

    def linear_part(self, layer: nn.Conv2d, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(h, weight, None, layer.stride, layer.padding, layer.dilation)

    def adjoint(self, layer: nn.Conv2d, u: torch.Tensor, weight: torch.Tensor, in_shape: tuple[int, ...]
                ) -> torch.Tensor:
        return conv2d_adjoint(u, weight, layer, in_shape[-2:])

    def masked_apply(self, layer: nn.Conv2d, v: torch.Tensor, weight: torch.Tensor, *, out_mask: torch.Tensor | None,
                     in_factor: torch.Tensor | None) -> torch.Tensor:
        return masked_conv2d(v, weight, layer, out_mask=out_mask, in_factor=in_factor, backend="triton")

    def masked_adjoint(self, layer: nn.Conv2d, u: torch.Tensor, weight: torch.Tensor, *,
                       out_mask: torch.Tensor | None, in_factor: torch.Tensor | None, in_shape: tuple[int, ...]
                       ) -> torch.Tensor:
        return masked_conv2d(u, weight, layer, out_mask=out_mask, in_factor=in_factor, transpose=True,
                             in_size=in_shape[-2:], backend="triton")

    def out_features(self, layer: nn.Module) -> int:
        return layer.out_channels

    @torch.no_grad()
    def fold_batchnorm(self, layer: nn.Module, scale: torch.Tensor, shift: torch.Tensor) -> nn.Module:
        """A new convolution of the layer's torch class (``Conv1d``/``2d``/``3d``), with bias, in eval mode."""
        weight, bias = self.folded_parameters(layer, scale, shift)
        kind = next(k for k in self.fold_kinds if isinstance(layer, k))
        conv = kind(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                    padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=True,
                    padding_mode=layer.padding_mode, device=layer.weight.device, dtype=layer.weight.dtype)
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
        return conv.train(False)
