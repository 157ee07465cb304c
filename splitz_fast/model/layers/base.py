"""What a supported affine layer kind of ``f_L`` provides: :class:`LayerRule`, one object per kind (:mod:`.conv2d`,
:mod:`.linear`), found by :func:`~splitz_fast.model.layers.registry.rule_for`.

A rule holds the linear algebra that depends on the kind — the functional forward ``latent_of`` computes, ``W h``
with a weight of the caller's choice (``|W|``, ``W²``), ``Wᵀ u``, the fused masked products, how a per-output
scale and shift fold into it — and the checks of the configurations the bounds describe. The bound files keep the
proofs and compose these operations; a new layer kind is one new file and one line in the registry.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn as nn


def replaces_methods(module: nn.Module, base: type, *methods: str) -> bool:
    """Whether ``module``'s class replaces any of ``base``'s ``methods`` (a subclass computing something else)."""
    return any(getattr(type(module), m) is not getattr(base, m) for m in methods)


class LayerRule(ABC):
    """One supported affine layer kind ``h ↦ W h + b`` of ``f_L``.

    Attributes:
        kind: the torch class (subclasses count when they only reparametrize the weight, :meth:`check`).
        computing_methods: the methods of ``kind`` that compute its output; a subclass replacing one is refused.
        flattens_input: whether the layer reads ``[B, F]``, an image input flattened first (as ``nn.Flatten``).
        channels_last: whether NHWC operands take a faster path through its products on the CPU.
        banded_gram: whether the Gram matrix of its masked operator is banded (one filter repeated over positions:
            :func:`~splitz_fast.bounds.gram.conv_gram`) rather than dense.
        masked_kernel: the ``kernels/`` op name (``select_backend``'s) of its fused masked products.
        noun: what error messages call it.
        fold_kinds: the layer classes whose following BatchNorm :meth:`fold_batchnorm` folds.
    """

    kind: ClassVar[type[nn.Module]]
    computing_methods: ClassVar[tuple[str, ...]] = ("forward",)
    flattens_input: ClassVar[bool]
    channels_last: ClassVar[bool]
    banded_gram: ClassVar[bool]
    masked_kernel: ClassVar[str]
    noun: ClassVar[str]
    fold_kinds: ClassVar[tuple[type[nn.Module], ...]]

    def check(self, layer: nn.Module) -> None:
        """Refuse a layer of this kind that the bounds would not describe: a subclass with a forward of its own (the
        bounds apply the weight themselves; one that only reparametrizes the weight, such as
        ``torch.nn.utils.parametrize``'s, is fine), or a configuration :meth:`check_configuration` refuses."""
        base = self.kind
        if replaces_methods(layer, base, *self.computing_methods):
            raise TypeError(f"f_L's {type(layer).__name__} overrides {base.__name__}.forward: the bounds would not "
                            f"describe it; use a plain nn.{base.__name__} or move the layer into f_R")
        self.check_configuration(layer)

    def check_configuration(self, layer: nn.Module) -> None:
        """Refuse settings of the layer the bounds do not model (none by default)."""

    def layer_input(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` reshaped for the layer: flattened to ``[B, F]`` before a kind that :attr:`flattens_input`."""
        return h.flatten(1) if self.flattens_input and h.ndim > 2 else h

    @abstractmethod
    def apply(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``W h + b`` from the layer's weight and bias, as one functional op (what ``latent_of`` computes)."""

    @abstractmethod
    def linear_part(self, layer: nn.Module, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``weight · h`` in the layer's geometry, no bias; ``weight`` is the layer's or a transform of it (``|W|``,
        ``W²``, another dtype), already in ``h``'s dtype."""

    @abstractmethod
    def adjoint(self, layer: nn.Module, u: torch.Tensor, weight: torch.Tensor, in_shape: tuple[int, ...]
                ) -> torch.Tensor:
        """``weightᵀ u`` for ``u: [B, *out_shape]`` as ``[B, *in_shape]``: the transpose of :meth:`linear_part`."""

    @abstractmethod
    def masked_apply(self, layer: nn.Module, v: torch.Tensor, weight: torch.Tensor, *, out_mask: torch.Tensor | None,
                     in_factor: torch.Tensor | None) -> torch.Tensor:
        """``m_out ⊙ (weight · (f ⊙ v))`` for ``v: [B, *in_shape]`` by the fused Triton op :attr:`masked_kernel`
        (``in_factor`` ``f``: ``[1 or B, *in_shape]``)."""

    @abstractmethod
    def masked_adjoint(self, layer: nn.Module, u: torch.Tensor, weight: torch.Tensor, *,
                       out_mask: torch.Tensor | None, in_factor: torch.Tensor | None, in_shape: tuple[int, ...]
                       ) -> torch.Tensor:
        """``f ⊙ (weightᵀ (m_out ⊙ u))`` for ``u: [B, *out_shape]`` → ``[B, *in_shape]``, the transpose of
        :meth:`masked_apply`, by the same fused Triton op."""

    @abstractmethod
    def out_features(self, layer: nn.Module) -> int:
        """The number of outputs per position: channels of a convolution, features of a linear layer."""

    @abstractmethod
    def fold_batchnorm(self, layer: nn.Module, scale: torch.Tensor, shift: torch.Tensor) -> nn.Module:
        """``y ↦ scale ⊙ y + shift`` (per output channel, float64) after ``layer``, as one module in the layer's
        dtype; :func:`~splitz_fast.model.layers.batchnorm.fold_batchnorm_into` checks the pair and computes
        ``scale``/``shift`` from the BatchNorm."""

    @staticmethod
    @torch.no_grad()
    def folded_parameters(layer: nn.Module, scale: torch.Tensor, shift: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 ``(w', b')`` of ``scale ⊙ (W h + b) + shift``: ``w' = scale ⊙ W`` row by row (dim 0 is the output
        channel of every kind), ``b' = scale ⊙ b + shift``; one rounding each, cast to the layer's dtype once."""
        weight = layer.weight.double() * scale.view(-1, *([1] * (layer.weight.ndim - 1)))
        bias = shift if layer.bias is None else shift + layer.bias.double() * scale
        return weight, bias
