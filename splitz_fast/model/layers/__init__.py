"""The supported affine layer kinds of ``f_L``, one rule object per kind (:mod:`.base`, :mod:`.conv2d`,
:mod:`.linear`, the registry :mod:`.registry`), and the one BatchNorm folder (:mod:`.batchnorm`)."""
from .base import LayerRule, replaces_methods
from .batchnorm import batchnorm_scale_shift, fold_batchnorm_into
from .conv2d import Conv2dRule
from .linear import LinearBatchNorm1d, LinearRule
from .registry import AFFINE_KINDS, RULES, find_rule, folding_rule, rule_for

__all__ = ["LayerRule", "replaces_methods", "batchnorm_scale_shift", "fold_batchnorm_into", "Conv2dRule",
           "LinearBatchNorm1d", "LinearRule", "AFFINE_KINDS", "RULES", "find_rule", "folding_rule", "rule_for"]
