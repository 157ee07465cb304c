"""BatchNorm folded into the convolution or linear layer that feeds it, wherever the pair sits in ``f_R``.

In eval mode a BatchNorm is the per-channel affine map ``y = γ (x − mean)/√(var + ε) + β``; directly after a
convolution (or a linear layer) whose output nothing else reads, it folds into that layer's weights and bias: the same
real-valued function, one pass over the activations less. :func:`fold_batchnorm` does this module by module, so a
model that ``torch.fx`` cannot trace as a whole (``Sequential(Standardize, CifarResNet)``: the standardization
branches on ``x.ndim``) still has every BatchNorm folded that can be:

* an exact ``nn.Sequential`` is a chain by definition: a layer's output feeds the next layer only, so adjacent
  ``(Conv, BatchNorm)`` / ``(Linear, BatchNorm1d)`` children fold, and every child is folded in turn;
* any other module is traced with ``torch.fx``; in its graph a BatchNorm call whose only input is a convolution or
  linear call whose output nothing else reads folds (the folded layer is registered under a new name and only this
  call is redirected to it, so a layer called twice, or whose weights the forward also reads, keeps its other uses);
  the traced module (a ``GraphModule``) replaces the module;
* where tracing fails (control flow on tensors, no forward of its own) or the module has hooks (a traced graph would
  drop them), the module is kept and its children are folded instead.

Every module replaced computes the function of the one it replaces, so modules shared between several places of the
model stay correct everywhere. BatchNorms that stay (nothing foldable feeds them: after a ReLU, an addition or a
pool; a convolution whose output is read twice; an untraceable forward; no running statistics) are reported by
:func:`unfolded_batchnorms`, with the reason.
"""
from __future__ import annotations

import copy

import torch
import torch.fx
import torch.nn as nn

from ..model.layers import fold_batchnorm_into, folding_rule

_BatchNorm = nn.modules.batchnorm._BatchNorm
# The layer types a BatchNorm type folds into (exact types: subclasses may compute something else).
_FEEDS = {nn.BatchNorm1d: (nn.Conv1d, nn.Linear), nn.BatchNorm2d: (nn.Conv2d,), nn.BatchNorm3d: (nn.Conv3d,)}
NOT_AFTER_A_LAYER = "not directly after a convolution or linear layer it can fold into"


def fold_batchnorm(module: nn.Module) -> nn.Module:
    """A copy of ``module`` in eval mode with every BatchNorm that directly follows a convolution or linear layer
    folded into it, wherever it sits (see the module docstring); the same real-valued function, one pass less.
    The user's module is never changed. :func:`unfolded_batchnorms` says which BatchNorms a copy keeps, and why."""
    return folded_copy(module)[0]


def unfolded_batchnorms(module: nn.Module) -> dict[str, str]:
    """The BatchNorm layers that :func:`fold_batchnorm` leaves in ``module`` (qualified name → why); empty when every
    BatchNorm folds or there is none. Decided from the modules alone (nothing is run)."""
    if not any(isinstance(m, _BatchNorm) for m in module.modules()):
        return {}
    return folded_copy(module)[1]


def _remaining(folded: nn.Module, reasons: dict[int, str]) -> dict[str, str]:
    """The BatchNorm modules left in ``folded`` (qualified name → why, from ``reasons`` keyed by module id)."""
    return {name: reasons.get(id(m), NOT_AFTER_A_LAYER) for name, m in folded.named_modules()
            if isinstance(m, _BatchNorm)}


def folded_copy(module: nn.Module) -> tuple[nn.Module, dict[str, str]]:
    """:func:`fold_batchnorm` and :func:`unfolded_batchnorms` of ``module`` in one pass."""
    module = copy.deepcopy(module).eval()
    if not any(isinstance(m, _BatchNorm) for m in module.modules()):
        return module, {}
    reasons: dict[int, str] = {}
    folded = _Folder(reasons).fold(module).eval()  # containers a traced module adds are in training mode
    return folded, _remaining(folded, reasons)


class _Folder:
    """One folding pass over a private copy (see the module docstring). ``reasons``: why a BatchNorm (by id) stays."""

    def __init__(self, reasons: dict[int, str]):
        self.reasons = reasons
        self.done: dict[int, nn.Module] = {}  # a module reached twice (shared) is folded once

    def fold(self, module: nn.Module) -> nn.Module:
        key = id(module)
        if key not in self.done:
            self.done[key] = self._fold(module)
        return self.done[key]

    def _fold(self, module: nn.Module) -> nn.Module:
        if isinstance(module, _BatchNorm) or not any(isinstance(m, _BatchNorm) for m in module.modules()):
            return module
        if type(module) is nn.Sequential:
            self._fold_children(module)
            self._fold_chain(module)
            return module
        hooked = next((name for name, m in module.named_modules() if has_forward_hooks(m)), None)
        if hooked is not None:
            why = f"in a module with hooks ({hooked or type(module).__name__}), which is not traced"
        else:
            try:
                traced = torch.fx.symbolic_trace(module)
            except Exception as err:  # noqa: BLE001 — untraceable forward: fold inside its children instead
                first_line = (str(err).strip().splitlines() or [""])[0][:120]
                why = f"in {type(module).__name__}, whose forward torch.fx cannot trace ({type(err).__name__}: " \
                      f"{first_line})"
            else:
                return self._fold_graph(traced) or module
        for child in module.children():
            if isinstance(child, _BatchNorm):
                self.reasons.setdefault(id(child), why)
        self._fold_children(module)
        return module

    def _fold_children(self, module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            folded = self.fold(child)
            if folded is not child:
                setattr(module, name, folded)  # the same function: right wherever the module is also used

    def _fold_chain(self, chain: nn.Sequential) -> None:
        """Fold adjacent ``(layer, BatchNorm)`` children of an exact ``nn.Sequential`` in place (keys kept)."""
        names = list(chain._modules)
        i = 1
        while i < len(names):
            layer, bn = chain._modules[names[i - 1]], chain._modules[names[i]]
            if isinstance(bn, _BatchNorm):
                why = _why_not(layer, bn)
                if why is None:
                    setattr(chain, names[i - 1], fold_batchnorm_into(layer, bn))
                    delattr(chain, names[i])
                    del names[i]
                    continue
                self.reasons.setdefault(id(bn), why)
            i += 1

    def _fold_graph(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
        """Fold the foldable ``layer → BatchNorm`` calls of a traced module; ``None`` if there are none."""
        modules = dict(gm.named_modules(remove_duplicate=False))
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module" or not isinstance(modules.get(node.target), _BatchNorm):
                continue
            bn = modules[node.target]
            src = node.args[0] if len(node.args) == 1 and not node.kwargs else None
            layer = modules.get(src.target) if isinstance(src, torch.fx.Node) and src.op == "call_module" else None
            why = _why_not(layer, bn)
            if why is None and len(src.users) > 1:
                why = f"the output of {src.target} is also read elsewhere"
            if why is not None:
                self.reasons.setdefault(id(bn), why)
                continue
            name = free_submodule_name(gm, f"{src.target}_folded")
            gm.add_submodule(name, fold_batchnorm_into(layer, bn))
            with gm.graph.inserting_before(src):
                new = gm.graph.call_module(name, src.args, src.kwargs)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            gm.graph.erase_node(src)
            changed = True
        if not changed:
            return None
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
        return gm


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks, which a rewrite of its call would lose."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def free_submodule_name(gm: nn.Module, name: str) -> str:
    """``name``, or ``name2``, ``name3``, ...: the first that names no submodule of ``gm`` yet."""
    taken = dict(gm.named_modules())
    candidate, k = name, 1
    while candidate in taken:
        k += 1
        candidate = f"{name}{k}"
    return candidate


def _why_not(layer: nn.Module | None, bn: _BatchNorm) -> str | None:
    """Why ``bn`` cannot fold into ``layer`` (its sole input), or ``None`` if it can."""
    if type(layer) not in _FEEDS.get(type(bn), ()):
        return NOT_AFTER_A_LAYER
    if has_forward_hooks(layer) or has_forward_hooks(bn):
        return "it or the layer before it has hooks"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "no running statistics (it normalizes with the batch's)"
    features = folding_rule(layer).out_features(layer)
    if bn.num_features != features:
        return f"{bn.num_features} features after a layer with {features} outputs"
    return None


__all__ = ["fold_batchnorm", "folded_copy", "unfolded_batchnorms"]
