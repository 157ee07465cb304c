"""``f_R`` as the sampling engine runs it, and the checks that its votes are i.i.d. draws of one base classifier.

:class:`PreparedClassifier` samples a private copy of the user's ``f_R``, taken at the start of a call whenever
``f_R`` changed (:meth:`PreparedClassifier.check_current`, by value: tensors, layers, hooks, replaced methods, plain
attributes), so the votes of a call come from ``f_R`` as it was when the call started; the user's modules are never
modified or run. Per ``(channels_last, pooled)`` layout it keeps a prepared module made from that copy — eval mode,
BatchNorm folded (:mod:`splitz_fast.sampling.folding`), on the device, channels_last for image latents, rearranged to cost less
where that was measured (:func:`_cheaper_chain`) — where ``f_R`` has no hooks or replaced methods (a rewrite would drop
or move them), else the copy exactly as it is. A second, fused copy (on CUDA convolution epilogues as single cuDNN
calls or Triton kernels, on the CPU a thin convolution + ReLU + pool as one C++ kernel;
:mod:`splitz_fast.sampling.epilogues`) is used per layout and batch where the engine measures it faster
and scoring alike to rounding (:meth:`PreparedClassifier.chosen`), and either copy runs through ``torch.compile`` at a
batch size where the engine's :class:`~splitz_fast.sampling.compiled.CompileChoice` says so
(:meth:`PreparedClassifier.compiled_if_chosen`). An ``f_R`` whose votes would depend on the batch is refused: from its
modules (:func:`check_batch_independent`) and by a probe at the first batch (:func:`probe_batch_independence`).
Every copy, graph and decision is kept per :class:`~splitz_fast.sampling.choices.Variant` (layout, copy, rows).
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable

import torch
import torch.nn as nn

from .._checks import report_fallback
from .casting import CastChoice, cast_copy
from .choices import Variant
from .compiled import CompiledOrEager
from .epilogues import ConvReLUMaxPool2, FusionChoice, fuse_conv_epilogues, has_fused_modules, with_sites_as
from .folding import folded_copy, unfolded_batchnorms
from .graphs import GraphedScores
from .pooling import MaxPool2x2
from .score_checks import MeasuredTolerances, score_gap
from ..model.layers import find_rule
from ..model.snapshot import ModuleSnapshot, hooked_modules, instance_overrides

# The batch-independence probe (probe_batch_independence): rows scored, and the largest score difference allowed
# between batchings, relative to the largest score of a class that is not constant (+1). The allowance covers
# kernels that round differently at another batch size (TF32 convolutions on CUDA, bf16 accumulation); batch statistics move scores by a
# sizeable fraction of their range.
PROBE_ROWS = 8
# Calls of one copy of f_R on the same batch before the probe compares its scores with the first call's: state that
# f_R keeps between calls and changes a little each time (a call counter in its forward) adds up to a difference the
# tolerance below sees.
PROBE_REPEATS = 16
PROBE_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1e-1, torch.float16: 5e-2}


class PreparedClassifier:
    """The user's ``f_R`` (``right``, kept as :attr:`source` and never modified or run) as sampled on ``device`` (where
    sampling runs), one prepared module per layout, all made from one private copy (:func:`sampled_copy`)."""

    def __init__(self, right: nn.Module, device: torch.device):
        self.source = right
        self.device = torch.device(device)
        # a variant without rows (compiled: the copy to compile) -> the prepared module
        self._prepared: dict[Variant, nn.Module] = {}
        self._graphs: dict[Variant, GraphedScores | None] = {}  # a variant at its rows -> its graph, None: eager
        self._fused: dict[Variant, nn.Module | None] = {}  # a plain variant -> its fused copy (sites decided), or None
        self._cast: dict[Variant, nn.Module | None] = {}  # a plain variant -> its cast copy, None: autocast
        # an eager variant -> the compiled copy that samples it, None: decided against it
        self._compiled: dict[Variant, CompiledOrEager | None] = {}
        self._probed: set[Variant] = set()  # plain variants (layouts) whose votes were checked batch-independent
        self.tolerances = MeasuredTolerances()  # what a graph, fused or compiled copy may differ by, per plain Variant
        self._snapshot: ModuleSnapshot | None = None
        self._base: nn.Module | None = None  # the private copy of f_R that every prepared module is made from
        self.rewritable = False  # whether the copies may rearrange f_R (sampled_copy)
        self._warned_as_is: set[tuple[str, ...]] = set()  # hooks and overrides already warned of
        self._unfolded: dict[str, str] | None = None  # f_R's BatchNorms that stay unfolded (name -> why)
        self._warned_unfolded: set[tuple[str, ...]] = set()

    def check_current(self) -> None:
        """Make the prepared copies anew if the user's ``f_R`` changed since they were made (anything
        :class:`~splitz_fast.model.snapshot.ModuleSnapshot` compares). Called once per certify/predict call. Every module the
        engine samples is made from one private copy of ``f_R`` taken here (eval mode), never the user's modules, so
        another thread's edits cannot reach the votes; the snapshot is of that copy, and the call's guard
        (:class:`~splitz_fast.certify.inputs.CallGuard`) stops the call when ``f_R`` no longer matches it."""
        if self._snapshot is None or not self._snapshot.matches(self.source):
            self._prepared.clear()
            self._graphs.clear()
            self._fused.clear()
            self._cast.clear()
            self._compiled.clear()
            self._probed.clear()
            self.tolerances.clear()
            self._unfolded = None
            self._base, self._snapshot, self.rewritable = sampled_copy(self.source)
            if not self.rewritable:
                _report_sampled_as_is(self._base, self._warned_as_is)

    @property
    def snapshot(self) -> ModuleSnapshot:
        """The snapshot of ``f_R`` that the prepared copies were made from, as of the last :meth:`check_current`."""
        if self._snapshot is None:
            raise RuntimeError("PreparedClassifier.check_current() has not run yet")
        return self._snapshot

    @property
    def unfolded_batchnorms(self) -> dict[str, str]:
        """The BatchNorm layers of ``f_R`` that the prepared copy keeps unfolded (qualified name → why; see
        :func:`~splitz_fast.sampling.folding.unfolded_batchnorms`), decided from the modules alone: empty when every BatchNorm
        folds or ``f_R`` has none."""
        if self._unfolded is None:
            self._unfolded = unfolded_batchnorms(self.source)
        return self._unfolded

    @property
    def batchnorm_folded(self) -> bool:
        """Whether ``f_R`` is sampled with every BatchNorm folded into the layer before it (also when it has none)."""
        return not self.unfolded_batchnorms

    def get(self, channels_last: bool, pooled: bool = False, fused: bool = False,
            for_compile: bool = False) -> nn.Module:
        """``f_R`` as sampled (without its leading max pool when ``pooled``): a prepared copy (eval mode, BatchNorm
        folded, on the device, channels_last for image latents, its convolution epilogues fused when ``fused``
        (:mod:`~splitz_fast.sampling.epilogues`)) where preparing changes something and f_R is :attr:`rewritable`, else the
        private copy of :meth:`check_current` itself (or its ``[1:]`` slice). With ``for_compile``, a copy of its own,
        shared by the compiled copies of every batch size."""
        key = Variant(channels_last=channels_last, pooled=pooled, fused=fused, compiled=for_compile)
        if self._base is None:
            self.check_current()
        if pooled and not self.rewritable:
            raise ValueError("f_R has hooks or replaced methods: its leading pool is not drawn with the noise")
        if key not in self._prepared:
            source = self._base[1:] if pooled else self._base
            needs_copy = self.rewritable and (for_compile or fused or (channels_last and _has_conv(source)) or any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in source.modules()))
            prepared = source
            if needs_copy:
                folded, unfolded = folded_copy(source)
                if not pooled:
                    self._unfolded = unfolded
                _warn_unfolded(unfolded, self._warned_unfolded)
                prepared = _cheaper_chain(folded.to(self.device), channels_last, device=self.device, fused=fused)
                if channels_last:
                    prepared = prepared.to(memory_format=torch.channels_last)
                if fused and self.device.type == "cuda":  # cuDNN's epilogues: on the CPU the bias is fused already
                    prepared = fuse_conv_epilogues(prepared)
            self._prepared[key] = prepared
        return self._prepared[key]

    def chosen(self, variant: Variant, fusion: FusionChoice,
               scores: Callable[[nn.Module, torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> tuple[nn.Module, Variant]:
        """The prepared module that samples ``variant`` (a plain eager variant at its rows), and the variant it
        samples as (``fused`` where it is the fused copy, with the sites that ``fusion`` decided fused): decided by
        ``fusion`` (:meth:`~splitz_fast.sampling.epilogues.FusionChoice.choose`, scoring ``example()`` through
        ``scores``) once per variant; the plain copy where fusing is not considered or would change nothing."""
        plain = self.get(*variant.layout)
        if not fusion.considered or not self.rewritable:
            return plain, variant
        if variant not in self._fused:  # decided once: the sampling loop asks again for every window
            fused = self.get(*variant.layout, fused=True)
            self._fused[variant] = fusion.choose(variant, lambda batch: scores(plain, batch), fused, scores, example,
                                                 tolerance) if has_fused_modules(fused) else None
        if self._fused[variant] is not None:
            return self._fused[variant], dataclasses.replace(variant, fused=True)
        return plain, variant

    def cast_if_chosen(self, net: nn.Module, variant: Variant, casting: CastChoice, dtype: torch.dtype,
                       scores: Callable[[nn.Module, torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
                       tolerance: Callable[[], float]) -> nn.Module:
        """``net`` (the prepared module of ``variant``, plain or fused) or its copy with the weights cast once to
        ``dtype`` (:func:`~splitz_fast.sampling.casting.cast_copy`), as ``casting`` decides once per variant; only where
        every layer is PyTorch's or this library's and cast computes what autocast does (:meth:`CastChoice.takes`)."""
        if not casting.considered or not self.rewritable:
            return net
        if variant not in self._cast:  # decided once per variant (the module walk too: the loop asks every window)
            self._cast[variant] = None
            if all(_library_module(m) and casting.takes(m) for m in net.modules()):
                cast = cast_copy(net, dtype)
                used = casting.choose(variant, lambda batch: scores(net, batch), lambda batch: scores(cast, batch),
                                      example, tolerance)
                self._cast[variant] = cast if used else None
        cast = self._cast[variant]
        return net if cast is None else cast

    def compiled_if_chosen(self, net: nn.Module, variant: Variant, due: bool,
                           decide: Callable[[nn.Module], CompiledOrEager | None]) -> nn.Module:
        """``net`` (the prepared module of the eager ``variant``) or the compiled copy that ``decide(copy to
        compile)`` returns (:meth:`~splitz_fast.sampling.compiled.CompileChoice.choose`) once it is ``due``: once per
        variant and prepared copy. Each batch size has a compiled copy (entry code object, dynamo cache and
        recompile limit) of its own. What the decision leaves unused is dropped: the eager copy's CUDA graph of that
        batch, or the compiled copy with its graph (and the copy compiled from, when no batch size uses it)."""
        if variant not in self._compiled:
            if not due or not self.rewritable:
                return net
            to_compile = self.get(*variant.layout, fused=variant.fused, for_compile=True)
            if variant.fused:  # the sites fused as decided for this batch (FusionChoice)
                to_compile = with_sites_as(to_compile, self._fused[dataclasses.replace(variant, fused=False)])
            self._compiled[variant] = decide(to_compile)
            used = self._compiled[variant] is not None
            self._graphs.pop(variant if used else dataclasses.replace(variant, compiled=True), None)
            shared = dataclasses.replace(variant, rows=None)
            if not any(dataclasses.replace(v, rows=None) == shared and c is not None
                       for v, c in self._compiled.items()):
                self._prepared.pop(dataclasses.replace(shared, compiled=True), None)
        return net if self._compiled[variant] is None else self._compiled[variant]

    def graphed(self, variant: Variant, capture: Callable[[], GraphedScores | None]) -> GraphedScores | None:
        """The CUDA graph of the prepared module of ``variant`` at its static batch of rows (``None``: that batch
        runs eagerly), made by ``capture`` the first time it is asked for and dropped with the prepared copies when
        ``f_R`` changes (the graph holds the addresses of the tensors it was captured from)."""
        if variant not in self._graphs:
            self._graphs[variant] = capture()
        return self._graphs[variant]

    def may_run_parallel(self, net: nn.Module) -> bool:
        """Whether ``net``'s batches may run on several worker threads (the engine's ``_execute``): on the CPU,
        through an eager prepared copy of ``f_R`` without hooks or replaced methods and made of PyTorch's and this
        library's modules only (a user's own module, or hook, need not be thread-safe)."""
        return (self.device.type == "cpu" and not isinstance(net, CompiledOrEager) and self.rewritable
                and self.is_copy(net) and all(_library_module(m) for m in net.modules()))

    def is_copy(self, net: nn.Module) -> bool:
        """Whether ``net`` owns its layers (a prepared copy) rather than sharing the user's."""
        return not any(p is q for p in net.parameters() for q in self.source.parameters())

    def probe_once(self, net: nn.Module, variant: Variant, scores: Callable, latent: torch.Tensor,
                   sigma: float, dtype: torch.dtype) -> None:
        """:func:`probe_batch_independence` of the prepared module of ``variant``'s layout, once per prepared copy."""
        plain = Variant(channels_last=variant.channels_last, pooled=variant.pooled)
        if plain not in self._probed:
            probe_batch_independence(net, scores, latent, sigma, dtype, *plain.layout)
            self._probed.add(plain)


def probe_batch_independence(net: nn.Module, scores: Callable, latent: torch.Tensor, sigma: float,
                             dtype: torch.dtype, channels_last: bool, pooled: bool) -> None:
    """Refuse an ``f_R`` whose scores for one noisy latent change with the other rows of its batch, or between two
    identical calls: its votes would not be i.i.d. draws of one base classifier (batch statistics, state kept
    between calls), and a certificate would not be a function of the input and its seed. The probe scores
    :data:`PROBE_ROWS` noisy copies of ``latent`` (their own generator: the inputs' noise streams are untouched) as one
    batch, in halves and one row alone, each time through a fresh copy of ``net`` (the probe never touches the user's
    modules or the prepared copy, and each variant starts from the same state), and the row alone
    :data:`PROBE_REPEATS` times through one copy (state kept between calls: the last call against the first);
    ``scores(net, batch)`` is how the engine scores a batch (its precision). All scores must agree to
    :data:`PROBE_TOLERANCE`, relative to the largest score of a class that is not constant (for the rounding
    differences of batch-size-dependent kernels; :func:`~splitz_fast.sampling.score_checks.score_gap`).

    It also refuses NaN scores: a NaN row has no class (``argmax`` would read the first NaN as the maximum, so an
    ``f_R`` with NaN weights would "certify" its first class with a large radius). Infinite scores are accepted
    (−inf for masked classes is common, and ``argmax`` orders them)."""
    def fresh_scores(*batches: torch.Tensor) -> torch.Tensor:
        fresh = copy.deepcopy(net)
        return torch.cat([scores(fresh, batch).float() for batch in batches])

    def first_and_last_of_calls(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = copy.deepcopy(net)
        first = scores(fresh, batch).float()
        for _ in range(PROBE_REPEATS - 2):
            scores(fresh, batch)
        return first, scores(fresh, batch).float()

    rows = noisy_rows(latent, sigma, dtype, PROBE_ROWS, channels_last, pooled)
    half = PROBE_ROWS // 2
    whole = fresh_scores(rows)
    nan_rows = int(whole.isnan().any(dim=1).sum())
    if nan_rows:
        raise ValueError(
            f"f_R returned NaN scores for {nan_rows} of {PROBE_ROWS} noisy copies of the input: the base classifier "
            "has no class there. Check the model's weights (a checkpoint or training run with NaN/Inf), the "
            "precision (float16 overflows above 65504) and f_R's forward")
    alone, alone_later = first_and_last_of_calls(rows[:1])  # one row: the repeats cost little with a large f_R
    comparisons = {f"batches of {half}": (fresh_scores(rows[:half], rows[half:]), whole),
                   "a batch of 1": (torch.cat([alone, whole[1:]]), whole),
                   f"the same row {PROBE_REPEATS - 1} calls later": (alone_later, alone)}
    for what, (other, reference) in comparisons.items():
        gap, scale = score_gap(other, reference)
        if not gap <= PROBE_TOLERANCE[dtype] * scale:
            raise ValueError(
                f"f_R's scores for an input change with the rest of its batch or between calls (max difference "
                f"{gap:.3g} against {what}, scores up to {scale - 1:.3g}): votes would not be i.i.d. draws of one "
                "base classifier. Put the model in eval mode (model.eval()), use BatchNorm with running "
                "statistics, and remove randomness or state from f_R's forward")


def noisy_rows(latent: torch.Tensor, sigma: float, dtype: torch.dtype, rows: int, channels_last: bool,
               pooled: bool) -> torch.Tensor:
    """``rows`` noisy copies ``latent + σz`` as the engine feeds them to ``f_R`` (cast to ``dtype``, max-pooled when
    ``pooled``, channels_last when asked), drawn from their own generator (seed 0): the inputs' noise streams are
    untouched. For the checks of a prepared ``f_R`` (the batch-independence probe, a CUDA graph's capture)."""
    gen = torch.Generator(device=latent.device).manual_seed(0)
    batch = torch.randn((rows, *latent.shape), generator=gen, device=latent.device)
    batch = (latent.float() + sigma * batch).to(dtype)
    if pooled:
        batch = torch.nn.functional.max_pool2d(batch, 2)
    if channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)
    return batch


# Layers whose output is a fresh tensor or a view of their input only: in an nn.Sequential of these, the input of a
# ReLU is used by nothing else, so the ReLU may overwrite it (_cheaper_chain).
_CHAIN_LAYERS = (nn.Conv2d, nn.Linear, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.ReLU,
                 nn.Dropout, nn.BatchNorm1d, nn.BatchNorm2d)


def _cheaper_chain(module: nn.Module, channels_last: bool = False, *, device: torch.device,
                   fused: bool = False) -> nn.Module:
    """The prepared copy of a plain layer chain, rearranged to cost less for the same function:

    * every ``ReLU`` directly followed by a ``MaxPool2d`` runs after it: ``maxpool(relu(x)) = relu(maxpool(x))``
      because ReLU is monotone non-decreasing and elementwise (a window's max commutes with it; padding pads with
      -inf, which never wins a window holding a real value; NaN propagates through both), so ReLU touches 4x fewer
      values behind a 2x2 pool (LeNet at s = 0: the sampling engine 1.4x faster, the same votes);
    * the ReLUs run in place (one large allocation less per layer): in such a chain no ReLU input is used again;
    * on the CPU only (``device``, where the copy runs: :func:`_pools_as_strided_maxima`), every plain 2x2 max pool
      of stride 2 (:func:`_is_maxpool2`) runs as :class:`MaxPool2x2`: two elementwise maxima of strided views,
      bitwise the same values as ``F.max_pool2d`` (max is exact; NaN propagates through both), without its index
      bookkeeping, and written channels_last where the chain runs channels_last (NCHW where a plain Flatten follows,
      which then needs no copy). ATen's CPU max pool computes indices it then drops, and for a 1-channel input (LeNet at
      s = 0: oneDNN runs the first convolution in NCHW because a ``[B, 1, H, W]`` batch is also "contiguous") it runs
      its slow NCHW loop and hands the next convolution an NCHW activation (measured, one thread: the pool after
      LeNet's first convolution 105 → 8 us per sample in NCHW, 8.5 → 4.1 in channels_last). On CUDA ``nn.MaxPool2d``
      stays (measured on an H100: the two strided maxima cost 31 % of LeNet's GPU time);
    * in the fused copy (``fused``: where the engine measures it faster, site by site), every ``Conv2d`` + ``ReLU`` +
      ``MaxPool2d(2)`` is one :class:`~splitz_fast.sampling.epilogues.ConvReLUMaxPool2` (:func:`fused_conv_pools`): one kernel
      that writes only the pooled activation;
    * on CUDA only (:func:`_bias_after_pools`), a convolution's bias that reaches a ``MaxPool2d`` directly is added
      after the pool (:class:`_ChannelBias`), to its 4x fewer values: ``maxpool(conv(x) + b) = maxpool(conv(x)) + b``
      for a bias constant over each channel, exactly also in floating point — rounding ``fl(v + b)`` is monotone
      non-decreasing in ``v``, so the largest rounded sum is the rounded sum of the largest ``v`` (padding is -inf,
      which stays -inf; NaN propagates through both). cuDNN's convolution adds its bias in a separate pass over the
      full output (measured on an H100: 23 % of LeNet's GPU time at s = 0).
    * in a chain that runs channels_last, a ``Flatten`` directly followed by a ``Linear`` reads the activation in its
      storage order (:class:`_FlattenLinear`, rewritten first, so the pool or fused site before it writes
      channels_last): flattening a channels_last activation in NCHW order is a copy of it, in (h, w, c) order a view,
      and the linear layer's columns are permuted to match (:func:`_flatten_in_storage_order`).

    Only for an ``nn.Sequential`` whose layers are all exactly of the types in :data:`_CHAIN_LAYERS` (subclasses may
    return aliases or compute something else); other modules are returned as they are."""
    if not isinstance(module, nn.Sequential) or not all(type(m) in _CHAIN_LAYERS for m in module):
        return module
    layers = list(module)
    if channels_last and _flatten_in_storage_order(device):  # first: the sites and pools below see where it reads
        layers = _flatten_linears_in_storage_order(layers)
    if fused:
        layers = fused_conv_pools(layers)
    for i in range(len(layers) - 1):
        if type(layers[i]) is nn.ReLU and type(layers[i + 1]) is nn.MaxPool2d and not layers[i + 1].return_indices:
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    for layer in layers:
        if isinstance(layer, nn.ReLU):
            layer.inplace = True
    if _bias_after_pools(device):
        layers = _move_biases_after_pools(layers)
    for i, layer in enumerate(layers):
        if _is_maxpool2(layer) and _pools_as_strided_maxima(device):
            # a pool that feeds a Flatten (through in-place ReLUs) writes NCHW: the Flatten is then a view, not a copy
            rest = [m for m in layers[i + 1:] if type(m) is not nn.ReLU]
            layers[i] = MaxPool2x2(channels_last and not (rest and type(rest[0]) is nn.Flatten))
    return nn.Sequential(*layers)


def fused_conv_pools(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with every ``Conv2d`` that the kernel takes (:meth:`~splitz_fast.sampling.epilogues.ConvReLUMaxPool2.takes`)
    directly followed by an ``nn.ReLU`` and an ``nn.MaxPool2d(2)`` (:func:`_is_maxpool2`), in either order, replaced
    by one :class:`~splitz_fast.sampling.epilogues.ConvReLUMaxPool2` (the convolution's parameters shared): the same
    function, since ReLU and a max pool commute (:func:`_cheaper_chain`)."""
    out: list[nn.Module] = []
    i = 0
    while i < len(layers):
        layer, pair = layers[i], layers[i + 1:i + 3]
        if (type(layer) is nn.Conv2d and len(pair) == 2 and {type(m) for m in pair} == {nn.ReLU, nn.MaxPool2d}
                and all(_is_maxpool2(m) for m in pair if type(m) is nn.MaxPool2d) and ConvReLUMaxPool2.takes(layer)):
            rest = [m for m in layers[i + 3:] if type(m) is not nn.ReLU]
            out.append(ConvReLUMaxPool2(layer, unfused_channels_last=not (rest and type(rest[0]) is nn.Flatten)))
            i += 3
            continue
        out.append(layer)
        i += 1
    return out


def _pools_as_strided_maxima(device: torch.device) -> bool:
    """Whether a prepared chain on ``device`` runs its plain 2x2 max pools as :class:`MaxPool2x2`: on the CPU only,
    where it was measured to win (:func:`_cheaper_chain`). On CUDA the pooling kernel stays: measured on an H100, the
    two strided maxima (two ``aten::maximum`` kernels) cost 31 % of LeNet's GPU time."""
    return torch.device(device).type == "cpu"


def _bias_after_pools(device: torch.device) -> bool:
    """Whether a prepared chain on ``device`` adds a convolution's bias after the max pool that follows it: on CUDA,
    where cuDNN adds it in a pass of its own (:func:`_cheaper_chain`). On the CPU oneDNN adds it inside the
    convolution, so it stays there."""
    return torch.device(device).type == "cuda"


def _move_biases_after_pools(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with every ``Conv2d(bias=b)`` that is directly followed by a ``MaxPool2d`` (no indices) replaced
    by ``Conv2d(bias=None), MaxPool2d, _ChannelBias(b)``; the convolution is copied, its weight shared."""
    out = []
    for i, layer in enumerate(layers):
        out.append(layer)
        previous = layers[i - 1] if i else None
        if (type(layer) is nn.MaxPool2d and not layer.return_indices and type(previous) is nn.Conv2d
                and previous.bias is not None):
            conv = copy.copy(previous)  # the same weight, its own parameter table (a chain may use a layer twice)
            conv._parameters = dict(previous._parameters, bias=None)
            out[-2] = conv
            out.append(_ChannelBias(previous.bias))
    return out


def _flatten_in_storage_order(device: torch.device) -> bool:
    """Whether a channels_last chain on ``device`` flattens into its linear layer in storage order
    (:class:`_FlattenLinear`): on CUDA and on the CPU, where the pool before the ``Flatten`` then writes channels_last
    too. Measured on the CPU, one thread, LeNet's last pool ([512, 64, 14, 14]): 3.2 us per sample written
    channels_last against 6.8 written NCHW for a plain ``Flatten`` (bf16; 3.9 against 7.3 in fp32)."""
    return torch.device(device).type in ("cuda", "cpu")


def _flatten_linears_in_storage_order(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with every default ``nn.Flatten`` directly followed by an ``nn.Linear`` replaced by one
    :class:`_FlattenLinear`, where the channels of the activation it flattens are known: those of the last
    convolution before it (its ``out_channels``)."""
    out: list[nn.Module] = []
    channels = None
    i = 0
    while i < len(layers):
        layer = layers[i]
        conv = layer.conv if isinstance(layer, ConvReLUMaxPool2) else layer
        if type(conv) is nn.Conv2d:
            channels = conv.out_channels
        following = layers[i + 1] if i + 1 < len(layers) else None
        if (type(layer) is nn.Flatten and (layer.start_dim, layer.end_dim) == (1, -1) and type(following) is nn.Linear
                and channels and following.in_features % channels == 0):
            out.append(_FlattenLinear(following, channels))
            i += 2
            continue
        out.append(layer)
        i += 1
    return out


class _FlattenLinear(nn.Module):
    """``linear(flatten(x))`` (a default ``nn.Flatten``, then ``linear``, its parameters shared) that reads a
    channels_last ``[B, C, H, W]`` activation in its storage order: ``x.permute(0, 2, 3, 1).flatten(1)`` is a view
    of it, where ``x.flatten(1)`` would copy it into NCHW order, and a copy of the weight with its columns permuted
    the same way, ``W'[:, s·C + c] = W[:, c·S + s]`` for the ``S = H·W`` pixels ``s``, makes each output the same sum
    over the same products (the GEMM may add them in another order). Any other input runs ``linear(flatten(x))``."""

    def __init__(self, linear: nn.Linear, channels: int):
        super().__init__()
        self.linear, self.channels = linear, channels
        weight = linear.weight.detach()
        # a buffer: it moves and casts with the prepared copy; the copy is rebuilt whenever f_R changes
        self.register_buffer("storage_order_weight", weight.view(weight.shape[0], channels, -1).transpose(1, 2)
                             .reshape(weight.shape[0], -1).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.ndim == 4 and x.shape[1] == self.channels and not x.is_contiguous()
                and x.is_contiguous(memory_format=torch.channels_last)):
            return nn.functional.linear(x.permute(0, 2, 3, 1).flatten(1), self.storage_order_weight, self.linear.bias)
        return self.linear(x.flatten(1))

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


class _ChannelBias(nn.Module):
    """Adds a per-channel bias to a ``[B, C, H, W]`` activation in place (it is the fresh output of a pool), in the
    activation's dtype (as the convolution's own bias add would be under autocast)."""

    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype).view(1, -1, 1, 1)
        return x.add_(bias) if not (x.requires_grad and torch.is_grad_enabled()) else x + bias


def check_batch_independent(module: nn.Module) -> None:
    """Refuse (one line saying how to fix it) an ``f_R`` whose votes would depend on the batch they are drawn in: a
    module in training mode (batch statistics, dropout) or a BatchNorm without running statistics (it normalizes
    with the batch's statistics even in eval mode). Votes must be i.i.d. draws of one base classifier, whatever the
    batch size the engine picks. What these checks cannot see is probed at the first batch
    (:func:`probe_batch_independence`)."""
    for name, m in module.named_modules():
        where = f"f_R's {type(m).__name__}" + (f" ({name})" if name else "")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (not m.track_running_stats or m.running_mean is None):
            raise ValueError(f"{where} has no running statistics (track_running_stats=False): it normalizes with "
                             "the batch's statistics, so votes would depend on the batch; train it with running "
                             "statistics (or use GroupNorm/LayerNorm) and call model.eval()")
        if m.training:
            raise ValueError(f"{where} is in training mode: votes would depend on the batch (batch statistics, "
                             "dropout); call model.eval() before sampling")


def starts_with_maxpool2(module: nn.Module) -> bool:
    """``module`` is an ``nn.Sequential`` whose first layer is ``MaxPool2d(2)``: kernel 2, stride 2, no padding,
    no dilation, floor mode, no indices."""
    return isinstance(module, nn.Sequential) and len(module) >= 2 and _is_maxpool2(module[0])


def _is_maxpool2(pool: nn.Module) -> bool:
    """``pool`` is exactly ``nn.MaxPool2d(2)``: kernel 2, stride 2, no padding, no dilation, floor mode, no indices."""
    if type(pool) is not nn.MaxPool2d:
        return False

    def pair(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)

    return (pair(pool.kernel_size) == (2, 2) and pair(pool.stride if pool.stride is not None else 2) == (2, 2)
            and pair(pool.padding) == (0, 0) and pair(pool.dilation) == (1, 1) and not pool.ceil_mode
            and not pool.return_indices)


def _warn_unfolded(unfolded: dict[str, str], warned: set[tuple[str, ...]]) -> None:
    """Warn once per engine (``warned``: its sets of layers warned of) that the prepared ``f_R`` keeps BatchNorm layers
    unfolded."""
    if not unfolded or tuple(unfolded) in warned:
        return
    warned.add(tuple(unfolded))
    shown = [f"{name or 'f_R'} ({why})" for name, why in unfolded.items()]
    if len(shown) > 5:
        shown = shown[:5] + [f"and {len(shown) - 5} more"]
    warnings.warn(f"f_R keeps {len(unfolded)} BatchNorm layer{'s' if len(unfolded) != 1 else ''} unfolded: "
                  f"{'; '.join(shown)}. Each costs a pass over its activations per sample; the votes are those "
                  "of the model as it is", stacklevel=6)


def _report_sampled_as_is(base: nn.Module, warned: set[tuple[str, ...]]) -> None:
    """Once per engine and set of hooks and overrides: ``f_R`` is sampled without its rewrites
    (:func:`~splitz_fast._checks.report_fallback`: an error under ``SPLITZ_STRICT=1``)."""
    found = tuple([f"a hook on {name or 'f_R'}" for name in hooked_modules(base)] + instance_overrides(base))
    if found not in warned:
        warned.add(found)
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        report_fallback(f"f_R has {shown}: it is sampled as it is, without BatchNorm folding, the cheaper chain, fused "
                        "kernels, torch.compile or its pool drawn with the noise (each would drop or move them)",
                        stacklevel=6)


def sampled_copy(source: nn.Module) -> tuple[nn.Module, ModuleSnapshot, bool]:
    """The private copy of ``source`` that a call samples (:func:`private_copy`), its snapshot, and whether it may be
    rewritten: not when a module has forward hooks or a method replaced on the instance, which a rewrite (folding,
    reordering, fusing, compiling, pooling in the noise) would drop or move."""
    base = private_copy(source)
    snapshot = ModuleSnapshot(base)
    if not snapshot.matches(source):
        raise ValueError("f_R's copy.deepcopy does not compute with what f_R does (a __deepcopy__ that drops or "
                         "changes state): sampling runs a private copy of f_R, so make its copy complete")
    return base, snapshot, not hooked_modules(base) and not instance_overrides(base)


def private_copy(module: nn.Module) -> nn.Module:
    """A ``copy.deepcopy`` of ``module`` in eval mode, or a one-line error saying why ``f_R`` cannot be copied."""
    try:
        return copy.deepcopy(module).eval()
    except (TypeError, RuntimeError, copy.Error) as err:
        raise ValueError(f"f_R cannot be copied ({type(err).__name__}: {str(err).strip()[:120]}): sampling runs a "
                         "private copy of f_R, so that edits while a call runs cannot mix its votes; keep only "
                         "copyable state (tensors, numbers, modules) on f_R's modules") from None


def _library_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is PyTorch's or this library's (their forwards keep no state between calls)."""
    return type(module).__module__.split(".")[0] in ("torch", "splitz_fast")


def _has_conv(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer whose kind runs faster on channels-last operands (a convolution)."""
    return any(rule.channels_last for rule in map(find_rule, module.modules()) if rule is not None)


__all__ = ["PreparedClassifier", "check_batch_independent", "probe_batch_independence", "noisy_rows", "PROBE_ROWS",
           "PROBE_TOLERANCE"]
