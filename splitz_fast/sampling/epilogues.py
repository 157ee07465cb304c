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
all three as one kernel that writes only the pooled activation (:mod:`splitz_fast.kernels.conv_relu_pool`: Triton on
CUDA, C++ on the CPU; the prepared chain's rewrite, :func:`~splitz_fast.sampling.prepared.fused_conv_pools`). It is
the only fused site of a copy prepared for the CPU, where oneDNN's convolutions add their bias already and a cuDNN
epilogue has nothing to fuse.

Each fused module is a *site* that runs either its fused form or the unfused operations it replaces (``fused``).
Which sites the sampling engine runs fused is decided by measurement, at run time, site by site (:class:`FusionChoice`,
the engine's ``fused_kernels`` setting): on CUDA, and on the CPU where the C++ kernel is built, per layout and batch,
a site's fused form must compute what its unfused operations compute on the activation it sees (within the plain
copy's own rounding, :func:`~splitz_fast.sampling.score_checks.copy_tolerance`) and take less time, and the copy with
the chosen sites fused must score a noisy batch like the plain copy. One slow or failing site leaves the others fused.
"""
from __future__ import annotations

import copy
import itertools
import operator
from typing import Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from . import choices
from .choices import CandidateFailed, Decision, MeasuredChoice, Option, Variant, score_mismatch
from .folding import free_submodule_name, has_forward_hooks
from .pooling import max_pool2x2
from .score_checks import score_gap
from ..cuda_math import convolutions_use_tf32
from ..kernels import conv_relu_pool, select_backend

_RELU_FUNCTIONS = (torch.relu, torch.relu_, F.relu)
_RELU_METHODS = ("relu", "relu_")
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
# Timing rounds of each side of one site (choices.seconds_per_call): a model has tens of sites, decided per batch
# size, so each side gets one round of at least TIMING_MIN_S rather than the best of three.
SITE_ROUNDS = 1


class _FusedSite(nn.Module):
    """One fused site of a prepared ``f_R``: the convolution (its parameters shared, never copied) and ``fused``,
    whether the site runs its fused form (:meth:`fused_forward`) or the unfused operations it replaces
    (:meth:`unfused_forward`, the same function). The sampling engine sets ``fused`` per site, by measurement
    (:class:`FusionChoice`); a fused form that fails raises (the engine's measurement catches it and keeps that site
    unfused, reported once)."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv
        self.fused = True

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fused_forward(*args) if self.fused else self.unfused_forward(*args)

    def fused_forward(self, *args: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def unfused_forward(self, *args: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"fused={self.fused}"


class _CudnnEpilogue(_FusedSite):
    """A site whose fused form is one cuDNN call on CUDA (elsewhere it runs the unfused operations)."""

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # torch.cudnn_convolution_* are not on autocast's lists: cast as autocast would cast a convolution.
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        bias = self.conv.bias
        return x.to(dtype), self.conv.weight.to(dtype), None if bias is None else bias.to(dtype)

    @staticmethod
    def _uses_cudnn(x: torch.Tensor) -> bool:
        return x.is_cuda and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled


class ConvReLU(_CudnnEpilogue):
    """``relu(conv(x))`` (the convolution's bias included): one ``torch.cudnn_convolution_relu`` call on CUDA."""

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._uses_cudnn(x):
            return self.unfused_forward(x)
        x, weight, bias = self._operands(x)
        c = self.conv
        return torch.cudnn_convolution_relu(x, weight, bias, c.stride, c.padding, c.dilation, c.groups)

    def unfused_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class ConvAddReLU(_CudnnEpilogue):
    """``relu(conv(x) + z)`` (the convolution's bias included; ``z`` of the output's shape, e.g. a residual
    shortcut): one ``torch.cudnn_convolution_add_relu`` call on CUDA."""

    def fused_forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self._uses_cudnn(x):
            return self.unfused_forward(x, z)
        x, weight, bias = self._operands(x)
        c = self.conv
        return torch.cudnn_convolution_add_relu(x, weight, z.to(x.dtype), 1.0, bias, c.stride, c.padding,
                                               c.dilation, c.groups)

    def unfused_forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x) + z)


class ConvReLUMaxPool2(_FusedSite):
    """``MaxPool2d(2)(relu(conv(x)))`` of a stride-1 ``Conv2d`` (its parameters shared) as one op,
    :func:`~splitz_fast.kernels.conv_relu_pool.conv_relu_maxpool2`: on CUDA one Triton kernel, on the CPU one C++
    kernel, each writing only the pooled activation (channels_last). Under autocast the operands are cast as autocast
    casts a convolution; float32 multiplies as TF32 exactly where cuDNN's convolutions would
    (:func:`~splitz_fast.cuda_math.convolutions_use_tf32`, which the sampling engine sets from its precision). The
    unfused form pools as the plain prepared chain does on that device (on the CPU:
    :func:`~splitz_fast.sampling.pooling.max_pool2x2`), so a site left unfused costs what the plain chain costs."""

    def __init__(self, conv: nn.Conv2d, *, unfused_channels_last: bool = True):
        conv_relu_pool.check_geometry(conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups)
        super().__init__(conv)
        # the layout the unfused form's CPU pool writes: NCHW before a plain Flatten, which then needs no copy (as
        # the plain chain's pool there, prepared._cheaper_chain), else channels_last
        self.unfused_channels_last = unfused_channels_last

    @staticmethod
    def takes(conv: nn.Module) -> bool:
        """Whether ``conv`` is a convolution the kernel computes: an exact ``nn.Conv2d`` with stride 1, dilation 1,
        groups 1 and numeric zero padding, without hooks."""
        return (_fusable_conv(conv) and conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1)

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        tf32 = x.is_cuda and convolutions_use_tf32()
        return conv_relu_pool.conv_relu_maxpool2(x, self.conv.weight, self.conv.bias, self.conv.padding, tf32)

    def unfused_forward(self, x: torch.Tensor) -> torch.Tensor:
        # max pool and ReLU commute (prepared._cheaper_chain): the pool first touches 4x fewer values with the ReLU
        y = self.conv(x)
        if y.device.type == "cpu":  # the pool's fresh output: nobody else reads it
            return F.relu(max_pool2x2(y, self.unfused_channels_last), inplace=True)
        return F.relu(F.max_pool2d(y, 2))


FUSED_MODULES = (ConvReLU, ConvAddReLU, ConvReLUMaxPool2)


def has_fused_modules(module: nn.Module) -> bool:
    """Whether ``module`` holds any fused module (the fused copy of ``f_R`` differs from the plain one)."""
    return any(isinstance(m, FUSED_MODULES) for m in module.modules())


def fused_sites(module: nn.Module) -> dict[str, _FusedSite]:
    """Every fused site of ``module`` by its qualified name, in the order of ``named_modules``."""
    return {name: m for name, m in module.named_modules() if isinstance(m, _FusedSite)}


def sharing_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s modules that shares its parameters and buffers (no tensor copied): a fused copy whose
    sites may be switched apart from ``module``'s."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def with_sites_as(module: nn.Module, like: nn.Module) -> nn.Module:
    """A :func:`sharing_copy` of ``module`` (a fused copy of the same ``f_R`` as ``like``) whose sites run fused
    exactly where ``like``'s of the same name do (e.g. the copy that ``torch.compile`` compiles, for a batch whose
    sites :class:`FusionChoice` decided)."""
    copied, decided = sharing_copy(module), fused_sites(like)
    for name, site in fused_sites(copied).items():
        site.fused = decided[name].fused
    return copied


class FusionChoice(MeasuredChoice):
    """A sampling engine's use of ``f_R``'s fused sites (its ``fused_kernels`` setting), one decision per
    :class:`~splitz_fast.sampling.choices.Variant` of the plain copy (layout and batch of rows), made site by site:
    one slow, failing or differing site stays unfused while the others run fused. On the CPU it is considered where
    the C++ convolution + ReLU + pool kernel is built (:func:`cpu_sites_have_a_kernel`), for those sites only, unless
    ``f_R`` runs compiled (``compile=True``: the compiled copy is made from the plain one, whose pools the compiler
    fuses itself, and the C++ kernel would break its graph); there ``fused_kernels=True`` is refused (a site's fused
    form is a measured choice on the CPU)."""

    OPTION = Option("fused_kernels", "plain", "fused")
    AUTO_DEVICES = ("cuda", "cpu")

    def __init__(self, setting: bool | None, device: torch.device, *, compile: bool | None = None):
        super().__init__(setting, device)
        self.compile = compile

    @property
    def considered(self) -> bool:
        if self.device.type == "cpu":
            return self.setting is None and not self.compile and cpu_sites_have_a_kernel()
        return super().considered

    def choose(self, variant: Variant, plain: Callable[[torch.Tensor], torch.Tensor], fused: nn.Module,
               scores: Callable[[nn.Module, torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> nn.Module | None:
        """The module to sample ``variant`` through instead of ``plain`` (the plain copy's scorer): a
        :func:`sharing_copy` of ``fused`` (the fused copy of the same ``f_R``) with each site fused or not, or
        ``None`` (no site fused, or the copy failed). One pass of ``scores(copy, example())`` with every site unfused
        decides each site on the activation it sees there, inside the engine's precision: its fused form must run and
        lie within ``tolerance()`` × (largest non-constant value + 1) of the unfused one
        (:func:`~splitz_fast.sampling.score_checks.score_gap`), then (by default) the faster form of that site is used
        (:func:`~splitz_fast.sampling.choices.seconds_per_call`). The copy so switched must then score the batch like
        the plain copy (:func:`~splitz_fast.sampling.choices.score_mismatch`). A site or copy that fails or differs
        is reported once; each site's decision is kept in the variant's (:attr:`Decision.sites`)."""
        batch, allowed = example(), tolerance()  # the tolerance first: it scores batches of its own
        net = sharing_copy(fused)
        sites = fused_sites(net)
        try:
            decided, failures = self._decide_sites(variant, net, sites, scores, batch, allowed)
        except CandidateFailed as err:
            self.fail(variant, str(err))
            return None
        if failures:
            first = next(iter(failures.values()))
            self.report_once(f"f_R's fused kernels are not used at {', '.join(failures)} ({first}); those layers run "
                             "unfused")
        used = [name for name, decision in decided.items() if decision.used]
        plain_s = sum(d.baseline_s for d in decided.values() if d.baseline_s is not None)
        chosen_s = sum(min(d.baseline_s, d.candidate_s) for d in decided.values() if d.candidate_s is not None)
        timed = plain_s > 0 or chosen_s > 0
        summary = f"{len(used)} of {len(sites)} sites fused"
        if timed:
            summary += f" at batch {variant.rows}: plain {plain_s * 1e3:.3f} ms, chosen {chosen_s * 1e3:.3f} ms"
        site_decisions = tuple(decided.items())
        if not used:
            self.decisions[variant] = Decision(self.OPTION, False, summary, plain_s if timed else None,
                                               chosen_s if timed else None, sites=site_decisions)
            return None
        for name, site in sites.items():
            site.fused = name in used
        try:
            mismatch = score_mismatch(scores(net, batch), plain(batch), allowed, "plain")
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 — sites that ran alone failing together: the plain f_R is correct
            mismatch = _failure(err)
        if mismatch is not None:
            self.fail(variant, mismatch)
            return None
        reason = f"{self.OPTION.setting}=True" if self.setting else summary
        self.decisions[variant] = Decision(self.OPTION, True, reason, plain_s if timed else None,
                                           chosen_s if timed else None, sites=site_decisions)
        return net

    def _decide_sites(self, variant: Variant, net: nn.Module, sites: dict[str, _FusedSite], scores,
                      batch: torch.Tensor, allowed: float) -> tuple[dict[str, Decision], dict[str, str]]:
        """Each site's decision from one pass of ``scores(net, batch)`` that runs every site unfused (so each sees
        the plain activations), and the reasons of the sites whose fused form failed or differed; raises
        :class:`~splitz_fast.sampling.choices.CandidateFailed` where the pass itself fails."""
        decided: dict[str, Decision] = {}
        failures: dict[str, str] = {}

        def hook_of(name: str):
            def decide_site(site: _FusedSite, args: tuple, output: torch.Tensor) -> None:
                try:
                    decided[name] = self._site_decision(site, args, output, allowed, self.verdict_key(variant, name))
                except CandidateFailed as err:
                    decided[name] = Decision(self.OPTION, False, str(err))
                    failures[name] = str(err)
            return decide_site

        handles = [site.register_forward_hook(hook_of(name)) for name, site in sites.items()]
        for site in sites.values():
            site.fused = False
        try:
            scores(net, batch)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 — the copy fails with every site unfused: the plain f_R is correct
            raise CandidateFailed(_failure(err)) from err
        finally:
            for handle in handles:
                handle.remove()
        for name in sites.keys() - decided.keys():
            decided[name] = Decision(self.OPTION, False, "not run by f_R's forward")
        return {name: decided[name] for name in sites}, failures

    def _site_decision(self, site: _FusedSite, args: tuple, unfused: torch.Tensor, allowed: float,
                       key: tuple | None) -> Decision:
        """Whether ``site`` runs fused, from its input ``args`` and ``unfused`` output in the pass; raises
        :class:`~splitz_fast.sampling.choices.CandidateFailed` where its fused form fails or differs. A verdict
        remembered under ``key`` replaces the timing (remembered slower: the fused form is not even built)."""
        remembered = self.recall(key)
        if remembered is not None and not remembered.used:
            return remembered
        try:
            got = site.fused_forward(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 — a kernel that cannot run here: the unfused ops are always correct
            raise CandidateFailed(_failure(err)) from err
        gap, scale = score_gap(got.flatten(1), unfused.flatten(1))
        if gap > allowed * scale:
            raise CandidateFailed(f"its output differs from the unfused layer's by {gap:.3g} (allowed "
                                  f"{allowed * scale:.3g})")
        if self.setting:
            return Decision(self.OPTION, True, f"{self.OPTION.setting}=True")
        if remembered is not None:
            return remembered
        shape, device = "x".join(map(str, args[0].shape)), args[0].device  # where the site's work is queued
        plain_s = choices.seconds_per_call(lambda: site.unfused_forward(*args), device, rounds=SITE_ROUNDS)
        try:
            fused_s = choices.seconds_per_call(lambda: site.fused_forward(*args), device, rounds=SITE_ROUNDS)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 — as above, where it fails only when repeated
            raise CandidateFailed(_failure(err)) from err
        decision = Decision(self.OPTION, fused_s < plain_s, f"measured on {shape}: plain {plain_s * 1e3:.3f} ms, "
                            f"fused {fused_s * 1e3:.3f} ms", plain_s, fused_s)
        self.remember(key, decision)
        return decision

    def fallback_message(self, variant: Variant, reason: str) -> str:
        return f"f_R's fused kernels are not used ({reason}); sampling runs the plain f_R"


def cpu_sites_have_a_kernel() -> bool:
    """Whether a fused site of a copy prepared for the CPU (:class:`ConvReLUMaxPool2`) has a fused form there: the
    C++ kernel of :func:`~splitz_fast.kernels.conv_relu_pool.conv_relu_maxpool2` is selected and built. Without it
    the fused form would be the reference, and the engine neither builds the fused copy nor measures it."""
    return select_backend(conv_relu_pool.OP_NAME, torch.device("cpu")) == "native"


def _failure(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {str(err).strip()[:160]}"


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


__all__ = ["ConvReLU", "ConvAddReLU", "ConvReLUMaxPool2", "FUSED_MODULES", "FusionChoice", "cpu_sites_have_a_kernel",
           "fuse_conv_epilogues", "fused_sites", "has_fused_modules", "sharing_copy", "with_sites_as"]
