"""The supported affine layer kinds of ``f_L``, one :class:`~.base.LayerRule` each, and the look-ups by layer."""
from __future__ import annotations

import torch.nn as nn

from .base import LayerRule
from .conv2d import Conv2dRule
from .linear import LinearRule

RULES: tuple[LayerRule, ...] = (Conv2dRule(), LinearRule())
#: The torch classes ``f_L`` may hold as affine layers (subclasses included, see :meth:`LayerRule.check`).
AFFINE_KINDS: tuple[type[nn.Module], ...] = tuple(rule.kind for rule in RULES)


def find_rule(layer: nn.Module) -> LayerRule | None:
    """The rule of ``layer``'s kind, or ``None`` for a module of no supported kind (anywhere in ``f_R``)."""
    return next((rule for rule in RULES if isinstance(layer, rule.kind)), None)


def rule_for(layer: nn.Module) -> LayerRule:
    """The rule of ``layer``, a layer of ``f_L``; ``TypeError`` for a kind the bounds cannot read."""
    rule = find_rule(layer)
    if rule is None:
        kinds = " and ".join(f"nn.{kind.__name__}" for kind in AFFINE_KINDS)
        raise TypeError(f"f_L may hold only {kinds} layers, got {type(layer).__name__}; "
                        "move it into f_R (split earlier) or fold it into the neighbouring affine layer")
    return rule


def folding_rule(layer: nn.Module) -> LayerRule | None:
    """The rule that folds a following BatchNorm into ``layer`` (:attr:`LayerRule.fold_kinds`), or ``None``."""
    return next((rule for rule in RULES if isinstance(layer, rule.fold_kinds)), None)
