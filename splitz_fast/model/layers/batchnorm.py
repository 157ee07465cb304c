"""The one BatchNorm folder: ``bn ∘ layer`` in eval mode as one layer, computed in float64 and cast to the layer's
dtype once. ``f_L``'s stem (:func:`splitz_fast.zoo.models.fold_batchnorm`) and ``f_R``'s chains
(:mod:`splitz_fast.sampling.folding`) both fold through it."""
from __future__ import annotations

import torch
import torch.nn as nn

from .registry import folding_rule

_BatchNorm = nn.modules.batchnorm._BatchNorm


@torch.no_grad()
def batchnorm_scale_shift(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(s, t)`` with ``bn(x) = s·x + t`` per channel in eval mode: ``s = γ/√(var + ε)``,
    ``t = β − mean·s`` (``γ = 1``, ``β = 0`` without affine parameters)."""
    scale = torch.rsqrt(bn.running_var.double() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.double()
    return scale, shift


@torch.no_grad()
def fold_batchnorm_into(layer: nn.Module, bn: _BatchNorm) -> nn.Module:
    """A new module equal to ``bn ∘ layer`` when ``bn`` is in eval mode (running statistics): ``w' = s ⊙ w`` per
    output channel, ``b' = s ⊙ b + t`` (:func:`batchnorm_scale_shift`), in float64, then in the layer's dtype.
    A convolution gives a convolution with bias; a linear layer a
    :class:`~splitz_fast.model.layers.linear.LinearBatchNorm1d`. ``layer`` and ``bn`` are not changed."""
    rule = folding_rule(layer)
    if rule is None:
        raise TypeError(f"a BatchNorm folds into a convolution or nn.Linear, got {type(layer).__name__}")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("fold_batchnorm needs a BatchNorm with running statistics (track_running_stats=True)")
    outputs = rule.out_features(layer)
    if bn.num_features != outputs:
        raise ValueError(f"BatchNorm has {bn.num_features} features but the {rule.noun} has {outputs} outputs")
    return rule.fold_batchnorm(layer, *batchnorm_scale_shift(bn))
