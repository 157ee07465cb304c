"""Convolution epilogues fused into cuDNN calls on CUDA: ``relu(conv(x) + b)`` and ``relu(conv(x) + b + z)``.

In eager PyTorch a folded convolution followed by its ReLU (and, in a residual block, the shortcut's addition) runs as
up to four kernels over the full activation: the convolution, its bias add (cuDNN's convolution adds no bias),
the addition and the ReLU. ``torch.cudnn_convolution_relu`` and ``torch.cudnn_convolution_add_relu`` compute the same
function as one cuDNN call (a runtime-fused epilogue) whose output is written once: in a ResNet's basic block, five
activation passes instead of about thirteen.

:func:`fuse_conv_epilogues` rewrites a prepared ``f_R`` (a private copy: eval mode, BatchNorm folded, so the
convolutions carry the folded biases) in place:

* in every ``torch.fx.GraphModule`` inside it (what :mod:`splitz_fast.sampling.folding` makes of a ResNet, its blocks or the
  whole network), ``relu(add(conv(x), z))`` → :class:`ConvAddReLU` and ``relu(conv(x))`` → :class:`ConvReLU`, where
  the convolution's output and the sum have no other reader;
* in every exact ``nn.Sequential``, a ``Conv2d`` directly followed by an ``nn.ReLU`` → :class:`ConvReLU`.

Only exact ``nn.Conv2d`` with zero padding given as numbers and exact ``nn.ReLU`` / ``torch.relu`` / ``F.relu`` /
``Tensor.relu`` are rewritten (a subclass may compute something else). The function is the same: ReLU of the same
sum; on CUDA the fused call rounds as cuDNN's epilogue does (within the rounding of the unfused kernels,
:func:`~splitz_fast.sampling.score_checks.copy_tolerance`; tested), elsewhere the modules run the unfused operations, bitwise the unfused result.

A convolution followed by its ReLU and a 2x2 max pool (LeNet's layers) goes further: :class:`ConvReLUMaxPool2` runs
all three as one Triton kernel that writes only the pooled activation (:mod:`splitz_fast.kernels.conv_relu_pool`;
the prepared chain's rewrite, :func:`~splitz_fast.sampling.prepared.fused_conv_pools`).

Whether the sampling engine uses the fused copy of ``f_R`` is decided by measurement, at run time
(:class:`FusionChoice`, the engine's ``fused_kernels`` setting): on CUDA, per layout and batch, the fused copy must
score a noisy batch like the plain copy (within the plain copy's own rounding,
:func:`~splitz_fast.sampling.score_checks.copy_tolerance`) and take less time.
"""
from __future__ import annotations

import operator
import warnings
from typing import Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from .choices import CandidateFailed, MeasuredChoice, Option, Trial, Variant, score_mismatch
from .folding import free_submodule_name, has_forward_hooks
from ..cuda_math import convolutions_use_tf32
from ..kernels import conv_relu_pool

_RELU_FUNCTIONS = (torch.relu, torch.relu_, F.relu)
_RELU_METHODS = ("relu", "relu_")
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


class _FusedConv(nn.Module):
    """Shared parts of the fused modules: the convolution (its parameters shared, never copied) and the fallback
    switch, set (with one warning) the first time cuDNN refuses the fused call."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv
        self.fused = True

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # torch.cudnn_convolution_* are not on autocast's lists: cast as autocast would cast a convolution.
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        bias = self.conv.bias
        return x.to(dtype), self.conv.weight.to(dtype), None if bias is None else bias.to(dtype)

    def _uses_cudnn(self, x: torch.Tensor) -> bool:
        return self.fused and x.is_cuda and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled

    def _refused(self, err: RuntimeError) -> None:
        self.fused = False
        warnings.warn(f"cuDNN refused a fused convolution epilogue ({str(err).strip().splitlines()[0][:160]}); "
                      "that layer runs its convolution, bias, addition and ReLU unfused", stacklevel=3)

    def extra_repr(self) -> str:
        return f"fused={self.fused}"


class ConvReLU(_FusedConv):
    """``relu(conv(x))`` (the convolution's bias included): one ``torch.cudnn_convolution_relu`` call on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._uses_cudnn(x):
            x, weight, bias = self._operands(x)
            c = self.conv
            try:
                return torch.cudnn_convolution_relu(x, weight, bias, c.stride, c.padding, c.dilation, c.groups)
            except torch.OutOfMemoryError:
                raise  # not a refusal: the batch is too large (the batch tuner stops there)
            except RuntimeError as err:
                self._refused(err)
        return F.relu(self.conv(x))


class ConvAddReLU(_FusedConv):
    """``relu(conv(x) + z)`` (the convolution's bias included; ``z`` of the output's shape, e.g. a residual
    shortcut): one ``torch.cudnn_convolution_add_relu`` call on CUDA."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self._uses_cudnn(x):
            x, weight, bias = self._operands(x)
            c = self.conv
            try:
                return torch.cudnn_convolution_add_relu(x, weight, z.to(x.dtype), 1.0, bias, c.stride, c.padding,
                                                       c.dilation, c.groups)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:
                self._refused(err)
        return F.relu(self.conv(x) + z)


class ConvReLUMaxPool2(nn.Module):
    """``MaxPool2d(2)(relu(conv(x)))`` of a stride-1 ``Conv2d`` (its parameters shared) as one op,
    :func:`~splitz_fast.kernels.conv_relu_pool.conv_relu_maxpool2`: on CUDA one Triton kernel that writes only the
    pooled activation. Under autocast the operands are cast as autocast casts a convolution; float32 multiplies as
    TF32 exactly where cuDNN's convolutions would (:func:`~splitz_fast.cuda_math.convolutions_use_tf32`, which the
    sampling engine sets from its precision)."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        conv_relu_pool.check_geometry(conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups)
        self.conv = conv

    @staticmethod
    def takes(conv: nn.Module) -> bool:
        """Whether ``conv`` is a convolution the kernel computes: an exact ``nn.Conv2d`` with stride 1, dilation 1,
        groups 1 and numeric zero padding, without hooks."""
        return (_fusable_conv(conv) and conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        tf32 = x.is_cuda and convolutions_use_tf32()
        return conv_relu_pool.conv_relu_maxpool2(x, self.conv.weight, self.conv.bias, self.conv.padding, tf32)


FUSED_MODULES = (ConvReLU, ConvAddReLU, ConvReLUMaxPool2)


def has_fused_modules(module: nn.Module) -> bool:
    """Whether ``module`` holds any fused module (the fused copy of ``f_R`` differs from the plain one)."""
    return any(isinstance(m, FUSED_MODULES) for m in module.modules())


class FusionChoice(MeasuredChoice):
    """A sampling engine's use of the fused copy of ``f_R`` (its ``fused_kernels`` setting), one decision per
    :class:`~splitz_fast.sampling.choices.Variant` of the plain copy (layout and batch of rows). Off CUDA it is not
    considered: the CPU's convolutions add their bias already, and the fused modules would run their unfused
    reference there."""

    OPTION = Option("fused_kernels", "plain", "fused")

    def choose(self, variant: Variant, plain: Callable[[torch.Tensor], torch.Tensor],
               fused: Callable[[torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> bool:
        """Whether to sample through ``fused`` rather than ``plain`` (two scorers of the same ``f_R``) at the batch
        of ``example()``: both score it first (compiling and autotuning outside any timing), the fused scores must
        lie within ``tolerance()`` × (largest non-constant score + 1) of the plain ones
        (:func:`~splitz_fast.sampling.choices.score_mismatch`), then (by default) the faster wins. A fused copy that
        fails or scores differently is reported once. Records the decision under ``variant``."""
        def trial() -> Trial:
            batch = example()
            try:
                want, got = plain(batch), fused(batch)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 — a kernel that cannot run here: the plain f_R is always correct
                raise CandidateFailed(f"failed: {type(err).__name__}: {str(err).strip()[:160]}") from err
            mismatch = score_mismatch(got, want, tolerance(), "plain")
            if mismatch is not None:
                raise CandidateFailed(mismatch)
            return Trial(lambda: plain(batch), lambda: fused(batch))

        return self.decide(variant, trial) is not None

    def fallback_message(self, variant: Variant, reason: str) -> str:
        return f"f_R's fused kernels are not used ({reason}); sampling runs the plain f_R"


def fuse_conv_epilogues(module: nn.Module) -> nn.Module:
    """``module`` (a private prepared copy) with its convolution epilogues fused, rewritten in place (see the module
    docstring); returns it, or its replacement where ``module`` itself is a rewritten ``nn.Sequential`` chain."""
    for name, child in list(module.named_children()):
        fused = fuse_conv_epilogues(child)
        if fused is not child:
            setattr(module, name, fused)
    if isinstance(module, torch.fx.GraphModule):
        _fuse_graph(module)
    elif type(module) is nn.Sequential:
        return _fuse_chain(module)
    return module


def _fusable_conv(layer: nn.Module | None) -> bool:
    return (type(layer) is nn.Conv2d and layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
            and not has_forward_hooks(layer))


def _fuse_chain(chain: nn.Sequential) -> nn.Sequential:
    layers = list(chain)
    if not any(_fusable_conv(a) and type(b) is nn.ReLU for a, b in zip(layers, layers[1:])):
        return chain
    out: list[nn.Module] = []
    for layer in layers:
        if type(layer) is nn.ReLU and out and _fusable_conv(out[-1]):
            out[-1] = ConvReLU(out[-1])
        else:
            out.append(layer)
    return nn.Sequential(*out)


def _fuse_graph(gm: torch.fx.GraphModule) -> None:
    modules = dict(gm.named_modules())
    changed = False
    for node in list(gm.graph.nodes):
        if not _is_relu(node, modules):
            continue
        source = node.args[0]
        pattern = _conv_add(source, modules) or _lone_conv(source, modules)
        if pattern is None:
            continue
        conv_node, z = pattern
        fused_type = ConvReLU if z is None else ConvAddReLU
        name = free_submodule_name(gm, f"{conv_node.target.replace('.', '_')}_{fused_type.__name__.lower()}")
        gm.add_submodule(name, fused_type(modules[conv_node.target]))
        with gm.graph.inserting_before(node):
            args = conv_node.args if z is None else (*conv_node.args, z)
            fused = gm.graph.call_module(name, args)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        if source is not conv_node:
            gm.graph.erase_node(source)
        gm.graph.erase_node(conv_node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()


def _is_relu(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A ReLU of one tensor argument (``inplace`` allowed: the fused module writes a fresh output that no one else
    holds, and the rewritten input had no other reader)."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node) or len(node.args) > 1:
        return False
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS and set(node.kwargs) <= {"inplace"}
    return node.op == "call_method" and node.target in _RELU_METHODS and not node.kwargs


def _lone_conv(node: torch.fx.Node, modules) -> tuple[torch.fx.Node, None] | None:
    """``(node, None)`` if ``node`` is a fusable convolution of one input whose only reader is the ReLU."""
    if (node.op == "call_module" and _fusable_conv(modules.get(node.target)) and len(node.args) == 1
            and not node.kwargs and len(node.users) == 1):
        return node, None
    return None


def _conv_add(node: torch.fx.Node, modules) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(convolution node, z)`` if ``node`` is ``conv(x) + z`` or ``z + conv(x)`` (no ``alpha``), read only by the
    ReLU, with the convolution read only by the addition and ``z`` a tensor computed elsewhere."""
    if node.op != "call_function" or node.target not in _ADD_FUNCTIONS or node.kwargs or len(node.args) != 2 \
            or len(node.users) != 1:
        return None
    a, b = node.args
    # ``z += conv(x)`` would also change z for its other readers: only the convolution's output may be updated.
    for conv, z in ((a, b),) if node.target is operator.iadd else ((a, b), (b, a)):
        if isinstance(conv, torch.fx.Node) and isinstance(z, torch.fx.Node) and conv is not z \
                and _lone_conv(conv, modules) is not None:
            return conv, z
    return None


__all__ = ["ConvReLU", "ConvAddReLU", "ConvReLUMaxPool2", "FUSED_MODULES", "FusionChoice", "fuse_conv_epilogues",
           "has_fused_modules"]
