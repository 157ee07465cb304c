"""The sampling engine: noise streams, batched passes of ``f_R`` over noisy latents, and votes counted on the device.

Design (SPEC §5): ``f_L(x)`` is computed once per input and noise is added after it; noise is drawn in float32 on the
device and the cast to ``f_R``'s precision happens after the sum; votes are counted on the device; ``f_R`` is a
prepared copy of the user's module (eval mode, BatchNorm folded, channels_last, optionally compiled), the user's model
is never changed. One ``f_R`` batch may carry the noise samples of several inputs (:class:`SamplingJob`), so an
input with fewer samples than a batch (the n0 selection draws, the tail of n, small models) does not leave the device
idle; each job's votes are counted separately.

**The noise an input sees depends only on its seed and the sample index** — not on the batch size, on how its samples
are packed with other inputs', or on whether it is certified alone: on the Philox stream (the Triton kernel on CUDA,
the native C++ kernel of ``csrc/`` on the CPU — one stream, kernels/noise.py) by construction (stream index =
sample index × D + element), and on the fallback path (``SPLITZ_BACKEND=reference``, or no Triton / no C++ compiler)
because :class:`NoiseStream` draws standard normals (``Tensor.normal_``) in fixed blocks of :data:`NOISE_BLOCK`
samples and hands them out in order. So a certificate is reproducible whatever batch size the engine picks, and
certifying a stream of inputs gives the results of certifying them one by one, up to ``f_R``'s float rounding (which
may depend on the batch size and, on CUDA, on the engine's measured choices and cuDNN's autotuned algorithms; it moves
a vote only where that sits on a class boundary).
Selection and estimation draws are consecutive, disjoint index ranges of one stream, hence independent.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn

from .folding import fold_batchnorm, unfolded_batchnorms
from ..kernels import select_backend
from ..kernels.noise import (
    noisy_latents_triton,
    noisy_latents_cuda,
    noisy_latents_maxpool2_native,
    noisy_latents_maxpool2_triton,
    noisy_latents_native,
)
from ..kernels.votes import count_votes_cuda, count_votes_reference, count_votes_triton
from .memory import remembered_batch
from .casting import CastChoice
from .choices import Variant, check_setting, synchronize
from .compiled import CompileChoice, CompiledOrEager
from ..cuda_math import cuda_math
from .epilogues import FusionChoice
from .graphs import GraphChoice, GraphedScores
from .prepared import PreparedClassifier, check_batch_independent, noisy_rows, starts_with_maxpool2

# Precision of f_R during sampling: the noisy latent is formed in float32 and cast to this dtype, and f_R runs under
# autocast. The base classifier of the smoothed classifier is then "f_R in this precision": the certificate holds for
# it as long as the same precision is used for PREDICT and CERTIFY (a Smoother applies it to both). "float32" is IEEE
# float32 throughout, also on CUDA (cuDNN's TF32 convolutions, on by default in PyTorch, are switched off while
# sampling); "tf32" is float32 storage with TF32 tensor-core convolutions and matmuls on CUDA (10-bit mantissa
# products), a different base classifier, labelled as such (on a CPU it computes what "float32" does).
PRECISIONS = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Samples per normal_ call on the fallback path (the unit that makes its stream batch-size independent).
NOISE_BLOCK = 64
# Batch sizes tried by the tuner (powers of two up to the cap), and its time budget per configuration (no measurement
# starts that is projected to end past it: _measure_batch_size).
TUNE_MIN_BATCH = 32
TUNE_MIN_SEARCH = 512  # sizes below this are always tried (small batches can look slow on a noisy machine)
TUNE_MIN_TIME_S = 0.15
TUNE_BUDGET_S = 8.0
TUNE_RECHECK = 3  # the fastest sizes of the sweep, timed once more (the better of two rates counts)
# Past TUNE_MIN_SEARCH the sweep also stops after two sizes in a row that beat the best rate by less than this: a
# doubling that gains under 5 % costs twice the working memory, a longer tail batch and, on CUDA, another round of
# cuDNN autotuning (seconds per size for a deep network at tens of thousands of samples) for nothing measurable.
TUNE_MIN_GAIN = 0.05
# On CUDA the tuner tries no batch whose working memory (the peak above what was allocated before, scaled from the
# last size measured) would pass this share of the card: the radius search, a CUDA graph's own memory pool and the
# user's other work need room beside it.
TUNE_MEMORY_FRACTION = 0.25
# Largest f_R batch the tuner tries by default (default_max_batch; an explicit batch size may be larger). On a CPU the
# fastest batches are cache-sized (64-256 samples for LeNet). On CUDA the tuner still gained at 4096 for LeNet and
# ResNet-110 on an H100 (it stopped at that cap), so it may go further there, within TUNE_MEMORY_FRACTION of the card.
DEFAULT_MAX_BATCH = 4096
DEFAULT_MAX_BATCH_CUDA = 32768
# Measured batch sizes, shared by every engine of the process: ((device, f_R's structure, latent shape, cap,
# precision, compile, pooled), threads) -> batch size.
_TUNED_BATCH: dict[tuple, int] = {}


def default_max_batch(device: torch.device) -> int:
    """The largest batch the tuner tries on ``device`` unless told otherwise."""
    return DEFAULT_MAX_BATCH_CUDA if torch.device(device).type == "cuda" else DEFAULT_MAX_BATCH


def check_engine_settings(precision: str, cuda_graphs: bool | None, fused_kernels: bool | None = None,
                          compile: bool | None = None) -> None:
    """Refuse a precision that is not a key of :data:`PRECISIONS` and a ``cuda_graphs``, ``fused_kernels`` or
    ``compile`` other than None/True/False."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    for name, value in (("compile", compile), ("cuda_graphs", cuda_graphs), ("fused_kernels", fused_kernels)):
        check_setting(name, value)


def pooled_noise_kernel(device: torch.device):
    """The kernel that draws the Philox noise and a 2x2 max pool in one pass on ``device`` (the native CPU kernel, or
    Triton where ``select_backend("noisy_latents_maxpool2")`` picks it), or ``None``: then the pool runs in ``f_R``.
    Only where the unfused noise is the same Philox stream, so fusing never changes which samples are drawn."""
    if select_backend("noisy_latents", device) not in ("native", "triton"):
        return None
    backend = select_backend("noisy_latents_maxpool2", device)
    if backend == "native" and device.type == "cpu":
        return noisy_latents_maxpool2_native
    return noisy_latents_maxpool2_triton if backend == "triton" else None


#: :attr:`NoiseStream.source` of the Philox stream that the Triton, CUDA and C++ noise kernels draw alike.
PHILOX_STREAM = "philox4x32-10"


class NoiseStream:
    """The noise of one input: sample ``k`` of the stream is a pure function of ``(seed, k)``.

    ``offset`` is the index of the next unused sample; every draw advances it, so no sample is used twice (selection
    draws ``[0, n0)``, estimation draws ``[n0, n0 + n)``). The Philox path (Triton on CUDA, the native kernel on the
    CPU) passes ``(seed, offset)`` to the kernel; the fallback path fills blocks of :data:`NOISE_BLOCK` samples with
    ``normal_`` from one ``torch.Generator`` seeded with ``seed`` and keeps the unused rest of the last block for the
    next draw. ``generator`` (seeded with ``seed``) also serves the radius search's random starts.
    """

    def __init__(self, seed: int, device: torch.device):
        self.seed = seed
        self.device = torch.device(device)
        self.offset = 0
        backend = select_backend("noisy_latents", self.device)
        native = noisy_latents_cuda if self.device.type == "cuda" else noisy_latents_native  # csrc/ kernels
        self._philox = {"triton": noisy_latents_triton, "native": native}.get(backend)
        self._pooled = pooled_noise_kernel(self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._spare: torch.Tensor | None = None  # fallback path: drawn, not yet used N(0, 1) rows

    @property
    def pools(self) -> bool:
        """Whether :meth:`noisy` can draw ``max_pool2d(latent + σz, 2)`` in one pass (``pool2=True``)."""
        return self._pooled is not None

    @property
    def source(self) -> str:
        """``philox4x32-10`` (the stream of kernels/noise.py, any device) or ``torch-<device>`` (the fallback's
        generator): with the seed, what a rerun needs to reproduce the draws."""
        return PHILOX_STREAM if self._philox is not None else f"torch-{self.device.type}"

    @property
    def addressable(self) -> bool:
        """Whether samples can be drawn at any reserved index (:meth:`reserve`, ``noisy(..., at=)``): the Philox
        stream, where sample ``k`` is computed from ``(seed, k)`` alone; the fallback generator draws in order only."""
        return self._philox is not None

    def reserve(self, num: int) -> int:
        """Reserve the next ``num`` sample indices (the stream advances past them) and return the first, for a later
        ``noisy(..., at=first)``: draws of several batches can then run in any order, on any thread, and still be
        the same samples (Philox streams only)."""
        if not self.addressable:
            raise ValueError("only the Philox stream can draw reserved samples out of order")
        first = self.offset
        self.offset += num
        return first

    def noisy(self, latent32: torch.Tensor, num: int, sigma: float, out_dtype: torch.dtype, channels_last: bool,
              out: torch.Tensor | None = None, pool2: bool = False, at: int | None = None) -> torch.Tensor:
        """The next ``num`` samples ``latent + σ z`` (``z`` float32, the sum float32, then cast to ``out_dtype``),
        written into ``out`` when given (``[num, *latent.shape]``, dense in the requested memory format). With
        ``pool2`` (only where :attr:`pools`; channels_last ``[C, H, W]`` latents, H and W even) the same samples after
        a 2x2 max pool of stride 2, ``[num, C, H/2, W/2]``, drawn in one pass. With ``at`` (a first index returned by
        :meth:`reserve`) the samples ``[at, at + num)`` instead of the next ones; the stream does not advance."""
        offset = self.offset if at is None else at
        if pool2:
            if not self.pools:
                raise ValueError("this noise stream cannot fuse the max pool (no noisy_latents_maxpool2 kernel selected "
                                 "for this device)")
            result = self._pooled(latent32, num, sigma, self.seed, offset, out_dtype, out=out)
        elif self._philox is not None:
            result = self._philox(latent32, num, sigma, self.seed, offset, out_dtype=out_dtype,
                                  channels_last=channels_last, out=out)
        elif at is not None:
            raise ValueError("only the Philox stream can draw reserved samples out of order")
        else:
            z = self._standard_normal(num, latent32.shape, channels_last)
            noisy = torch.add(latent32, z, alpha=sigma, out=z)  # latent + σz in float32, one pass
            if out is None:
                fmt = torch.channels_last if channels_last else torch.contiguous_format
                result = noisy.to(dtype=out_dtype, memory_format=fmt)
            else:
                result = out.copy_(noisy)
        if at is None:
            self.offset += num
        return result

    def _standard_normal(self, num: int, shape: torch.Size, channels_last: bool) -> torch.Tensor:
        have = 0 if self._spare is None else self._spare.shape[0]
        blocks = max(0, -(-(num - have) // NOISE_BLOCK))
        rows = torch.empty((have + blocks * NOISE_BLOCK, *_draw_shape(shape, channels_last)), dtype=torch.float32,
                           device=self.device)
        if have:
            rows[:have].copy_(self._spare)
        for b in range(blocks):
            start = have + b * NOISE_BLOCK
            rows[start:start + NOISE_BLOCK].normal_(generator=self.generator)  # in place: 1.6x randn(out=) here
        self._spare = rows[num:] if rows.shape[0] > num else None
        z = rows[:num]
        return z.permute(0, 3, 1, 2) if channels_last and len(shape) == 3 else z


def _draw_shape(shape: torch.Size, channels_last: bool) -> tuple[int, ...]:
    """Memory order of one sample's draws: NHWC for channels_last image latents, so the batch comes out channels_last
    without a copy."""
    if channels_last and len(shape) == 3:
        c, h, w = shape
        return (h, w, c)
    return tuple(shape)


@dataclass
class SamplingJob:
    """``num`` noise samples of one latent through ``f_R``; their class votes are added to ``counts`` (``[C]`` int64
    on the device)."""

    latent: torch.Tensor
    stream: NoiseStream
    num: int
    counts: torch.Tensor


class SamplingEngine:
    """Votes of ``f_R`` over noisy copies of latents, for one input or a stream of them.

    Args:
        right: ``f_R``, never modified or run: the engine samples prepared copies of it (:attr:`prepared`).
        num_classes: length of ``f_R``'s score vector.
        sigma: noise level σ > 0 in latent units.
        device: where sampling runs (``f_R``'s device).
        precision: a key of :data:`PRECISIONS` (the base classifier's precision, labelled in every result).
        compile: run ``f_R``'s full batches through ``torch.compile`` at their static shape: ``None`` (default) where
            it scores alike and measures faster, tried on CUDA only, after a minute of eager sampling at that batch;
            ``True``; ``False`` (:class:`~splitz_fast.sampling.compiled.CompileChoice`: ``compiling``).
        cuda_graphs: on CUDA, replay ``f_R`` as a CUDA graph captured at the batch size (shorter batches run eagerly):
            ``None`` (default) where measured faster than eager, ``True`` (needs CUDA), ``False``; a failed capture
            warns once and stays eager (:class:`~splitz_fast.sampling.graphs.GraphChoice`; its choices: ``graphs.decisions``).
        fused_kernels: sample through ``f_R``'s fused copy (:mod:`~splitz_fast.sampling.epilogues`: on CUDA cuDNN and
            Triton kernels, on the CPU a thin convolution + ReLU + 2x2 pool in C++): ``None`` (default) site by site
            where it scores like the plain copy and measures faster, ``True`` (needs CUDA; still checked),
            ``False`` (:class:`~splitz_fast.sampling.epilogues.FusionChoice`; its choices: ``fusion.decisions``).
    """

    def __init__(self, right: nn.Module, num_classes: int, sigma: float, device: torch.device,
                 precision: str = "float32", compile: bool | None = None, cuda_graphs: bool | None = None,
                 fused_kernels: bool | None = None):
        check_engine_settings(precision, cuda_graphs, fused_kernels, compile)
        self.num_classes, self.sigma, self.device, self.precision = num_classes, sigma, torch.device(device), precision
        self.dtype = PRECISIONS[precision]
        self.graphs = GraphChoice(cuda_graphs, self.device)
        self.fusion = FusionChoice(fused_kernels, self.device, compile=compile)
        self.compiling = CompileChoice(compile, self.device)
        self.casting = CastChoice(self.dtype, self.device, compile)  # bf16/fp16 weights cast once on the CPU
        self.prepared = PreparedClassifier(right, self.device)
        for choice in (self.graphs, self.fusion, self.compiling, self.casting):  # verdicts remembered (memory.py)
            choice.memory_key = lambda: (repr(self.source), self.precision)  # f_R's structure as it is now
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------ the prepared f_R
    @property
    def source(self) -> nn.Module:
        """The user's ``f_R``."""
        return self.prepared.source

    def pools_in_noise(self, latent_shape: torch.Size) -> bool:
        """Whether ``f_R``'s leading 2x2 max pool is drawn by the noise kernel (:meth:`NoiseStream.noisy` with
        ``pool2``): ``f_R`` is an ``nn.Sequential`` that starts with ``MaxPool2d(2)`` (stride 2, no padding or
        dilation, floor mode), the latent is ``[C, H, W]`` with H and W even, and a fused kernel is selected for the
        device (:func:`pooled_noise_kernel`). The same base classifier (bitwise the same pooled values, tested); on
        LeNet split 1 it removes the largest single cost of a sample (the full-size noisy batch and its pooling
        pass)."""
        return (len(latent_shape) == 3 and latent_shape[1] % 2 == 0 and latent_shape[2] % 2 == 0
                and starts_with_maxpool2(self.source) and self.prepared.rewritable
                and pooled_noise_kernel(self.device) is not None)

    def _scores(self, net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        # No autocast weight cache: it lives for one call here anyway, and a CUDA graph capture must not use it.
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32,
                                  cache_enabled=False)
        with autocast, cuda_math(self.device, tf32=self.precision == "tf32"):
            return _checked_scores(net(batch), self.num_classes)

    # ------------------------------------------------------------------ batch size
    def batch_size(self, latent_shape: torch.Size, cap: int) -> int:
        """The batch size with the most samples/s for latents of this shape, at most ``cap``: measured once per
        process, ``f_R`` architecture, device, threads, shape and cap (powers of two from 32, stopping when two sizes in
        a row gain less than :data:`TUNE_MIN_GAIN` over the best, memory runs out or the time budget is spent), and
        remembered across processes (:mod:`~splitz_fast.sampling.memory`; ``SPLITZ_MEMORY=0``: off)."""
        key = (str(self.device), repr(self.source), tuple(latent_shape), cap, self.precision, self.compiling.setting,
               self.pools_in_noise(latent_shape))
        if (key, torch.get_num_threads()) not in _TUNED_BATCH:
            _TUNED_BATCH[key, torch.get_num_threads()] = remembered_batch(
                key, self.device, lambda: _measure_batch_size(self, tuple(latent_shape), cap))
        return _TUNED_BATCH[key, torch.get_num_threads()]

    # ------------------------------------------------------------------ sampling
    @torch.inference_mode()
    def run(self, jobs: list[SamplingJob], batch_size: int) -> None:
        """Run every job's samples through ``f_R`` in batches of ``batch_size`` (a batch may hold samples of several
        consecutive jobs) and add each job's votes to its ``counts``. Jobs of one stream are served in list order,
        so their draws are consecutive ranges of that stream. No host synchronisation. An ``f_R`` whose votes would
        depend on the batch is refused (:func:`check_batch_independent`, then a probe at the first batch)."""
        if not jobs:
            return
        check_batch_independent(self.source)
        shape = jobs[0].latent.shape
        if any(job.latent.shape != shape for job in jobs):
            raise ValueError("all jobs of one run must have latents of the same shape")
        channels_last = len(shape) == 3  # image-shaped latents: NHWC batches for the convolutions of f_R
        pooled = self.pools_in_noise(shape)
        variant, latent = Variant(channels_last=channels_last, pooled=pooled, rows=batch_size), jobs[0].latent
        layout = variant.layout
        self.prepared.probe_once(self.prepared.get(*layout), variant, self._scores, latent, self.sigma, self.dtype)

        def example() -> torch.Tensor:  # a full batch of noisy rows, for the measured choices
            return noisy_rows(latent, self.sigma, self.dtype, batch_size, *layout)

        tolerance = self.prepared.tolerances.lazy(variant, lambda: self.prepared.get(*layout), self._scores, example,
                                                  self.precision)

        net, graph, variant = _sampled_net(self, variant, example, tolerance)
        plan = _plan(jobs, batch_size)
        # What counts towards compiling for this batch size: eager sampling of its full batches (a short batch never
        # runs compiled), as their share of the rows.
        rows = [_rows(segments) for segments in plan]
        full_rows = sum(r for r in rows if r == batch_size)
        eager_share = 0.0 if isinstance(net, CompiledOrEager) or not plan else full_rows / sum(rows)
        with self.compiling.timed(variant, eager_share):
            self._execute(net, plan, channels_last, pooled, batch_size, self.prepared.may_run_parallel(net), graph)

    def _execute(self, net, plan: list[list[tuple]], channels_last: bool, pooled: bool, batch_size: int,
                 parallel: bool, graph: GraphedScores | None = None) -> None:
        """Run the batches of ``plan`` (:func:`_plan`) and count their votes (the full ones through ``graph`` where one
        is given).

        With ``parallel`` and more than one torch thread, on Philox streams (every segment's samples reserved, so
        any thread draws them), the batches run on ``torch.get_num_threads()`` worker threads, each batch on one
        thread (intra-op threads 1): no fork/join barrier per operation, which at the cache-sized batches that are
        fastest here (LeNet: 64-256 samples, a few ms) left the second core mostly idle, and under a shared
        machine's load made every operation wait for the slower thread. The same batches and the same samples
        as sequentially; the votes are sums, so the order batches finish in does not matter. The caller's thread
        count is restored afterwards."""
        threads = torch.get_num_threads()
        workers = min(threads, len(plan)) if parallel else 1
        if workers <= 1 or any(first is None for segments in plan for _, _, first in segments):
            for segments in plan:
                self._count_segments(net, segments, channels_last, pooled, batch_size, graph)
            return

        @torch.inference_mode()
        def work(segments) -> None:
            self._count_segments(net, segments, channels_last, pooled, batch_size)

        try:
            with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                for _ in pool.map(work, plan):
                    pass
        finally:
            torch.set_num_threads(threads)  # the workers' call also changed the default of threads started later

    def _count_segments(self, net, segments: list[tuple[SamplingJob, int, int | None]], channels_last: bool,
                        pooled: bool, batch_size: int, graph: GraphedScores | None = None) -> None:
        if _rows(segments) < batch_size:
            # A short batch (the end of a window) runs eagerly: a graph and a compiled f_R take the full batch only
            # (padding would cost a full batch's work; another shape would recompile).
            graph = None
            net = net.net if isinstance(net, CompiledOrEager) else net
        batch = _noisy_batch(segments, self.sigma, self.dtype, channels_last, pooled,
                             None if graph is None else graph.input)
        logits = self._scores(net, batch) if graph is None else graph.replay()
        count = {"triton": count_votes_triton, "native": count_votes_cuda}.get(select_backend("count_votes", self.device),
                                                                       count_votes_reference)
        start = 0
        with self._count_lock:  # counts are shared by the batches of a job, which may run on several threads
            for job, take, _ in segments:
                count(logits[start:start + take], job.counts)
                start += take


def _sampled_net(engine: SamplingEngine, plain: Variant, example: Callable[[], torch.Tensor],
                 tolerance: Callable[[], float]) -> tuple[nn.Module, GraphedScores | None, Variant]:
    """How ``engine`` scores full batches of the ``plain`` variant (a layout at its rows): the prepared copy (fused
    where measured faster: :meth:`~splitz_fast.sampling.prepared.PreparedClassifier.chosen`), compiled where
    ``engine.compiling`` decides so, and its CUDA graph or ``None``; with the eager variant that the compile choice
    decides about (fused where the fused copy samples). ``example()`` is a full batch of noisy rows for the measured
    choices."""
    net, variant = engine.prepared.chosen(plain, engine.fusion, engine._scores, example, tolerance)
    net = engine.prepared.cast_if_chosen(net, variant, engine.casting, engine.dtype, engine._scores, example, tolerance)

    def graph_of(module: nn.Module) -> GraphedScores | None:
        return _graph_of(engine, module, variant, example, tolerance)

    def decide(copy: nn.Module) -> CompiledOrEager | None:
        # Measured against what the engine runs now: the eager copy's graph where it has one. compile=True only
        # checks the scores, against the eager copy (a graph of it would never be used).
        compiled = CompiledOrEager(copy, engine.compiling.report_once)
        graph = graph_of(net) if engine.compiling.setting is None else None
        current = functools.partial(engine._scores, net) if graph is None else graph.score
        used = engine.compiling.choose(variant, current, compiled, engine._scores, lambda: graph_of(compiled),
                                       example, tolerance)
        return compiled if used else None

    net = engine.prepared.compiled_if_chosen(net, variant, engine.compiling.due(variant), decide)
    return net, graph_of(net), variant


def _graph_of(engine: SamplingEngine, net: nn.Module, eager: Variant, example: Callable[[], torch.Tensor],
              tolerance: Callable[[], float]) -> GraphedScores | None:
    """The CUDA graph of ``net``'s full batches (the prepared copy of the ``eager`` variant, or its compiled copy),
    or None (eager): decided by ``engine.graphs`` once per prepared copy (plain or fused, eager or compiled) and
    batch."""
    variant = replace(eager, compiled=isinstance(net, CompiledOrEager))
    return engine.prepared.graphed(variant, lambda: engine.graphs.choose(
        variant, lambda batch: engine._scores(net, batch), example, tolerance))


def _checked_scores(logits, num_classes: int) -> torch.Tensor:
    """``f_R``'s output, refused (saying what to fix) unless it is a ``[batch, num_classes]`` tensor of scores."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"f_R returned a {type(logits).__name__}, expected a tensor of scores [batch, num_classes]; "
                        "wrap f_R so that it returns the logits alone")
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise ValueError(f"f_R returned scores of shape {tuple(logits.shape)}, expected [batch, num_classes="
                         f"{num_classes}]; fix num_classes of the SplitModel or the last layer of f_R")
    return logits


def _noisy_batch(segments: list[tuple[SamplingJob, int, int | None]], sigma: float, dtype: torch.dtype,
                 channels_last: bool, pooled: bool, out: torch.Tensor | None) -> torch.Tensor:
    """One ``f_R`` batch: the segments' noisy samples in order, written into ``out`` when given (a CUDA graph's
    input), else into a fresh tensor, or drawn directly by the stream where one segment fills the batch."""
    if out is None and len(segments) == 1:
        job, take, first = segments[0]
        return job.stream.noisy(job.latent, take, sigma, dtype, channels_last, pool2=pooled, at=first)
    if out is None:
        shape = segments[0][0].latent.shape
        if pooled:
            shape = (shape[0], shape[1] // 2, shape[2] // 2)
        out = torch.empty((sum(take for _, take, _ in segments), *shape), dtype=dtype,
                          device=segments[0][0].latent.device,
                          memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    start = 0
    for job, take, first in segments:
        job.stream.noisy(job.latent, take, sigma, dtype, channels_last, out=out[start:start + take], pool2=pooled,
                         at=first)
        start += take
    return out


def _rows(segments: list[tuple[SamplingJob, int, int | None]]) -> int:
    """The rows of one batch of a plan (:func:`_plan`)."""
    return sum(take for _, take, _ in segments)


def _segment(job: SamplingJob, take: int) -> tuple[SamplingJob, int, int | None]:
    """The next ``take`` samples of ``job`` as one segment of a batch: ``(job, take, first)`` with ``first`` the
    reserved first sample index on a Philox stream, ``None`` on the fallback generator (drawn in order)."""
    return job, take, job.stream.reserve(take) if job.stream.addressable else None


def _plan(jobs: list[SamplingJob], batch_size: int) -> list[list[tuple[SamplingJob, int, int | None]]]:
    """The batches of a run, in order: each ``batch_size`` samples (the last fewer) as segments (:func:`_segment`)
    of consecutive jobs; a job's segments are consecutive ranges of its stream."""
    plan = []
    pending = [(job, job.num) for job in jobs if job.num > 0]
    while pending:
        size = min(batch_size, sum(left for _, left in pending))
        segments, taken = [], 0
        while pending and taken < size:
            job, left = pending[0]
            take = min(left, size - taken)
            segments.append(_segment(job, take))
            taken += take
            if take == left:
                pending.pop(0)
            else:
                pending[0] = (job, left - take)
        plan.append(segments)
    return plan


@torch.inference_mode()
def _measure_batch_size(engine: "SamplingEngine", shape: tuple[int, ...], cap: int) -> int:
    """The fastest ``f_R`` batch of ``engine`` for latents of ``shape``, at most ``cap`` (:meth:`SamplingEngine.batch_size`).

    Its time is bounded by what it can save: every measurement (the sweep's and the second look's) starts only if it
    is projected to end within :data:`TUNE_BUDGET_S` of the tuner's start (the first size is always measured). A
    size's projected cost is the last measurement's time scaled by the batch ratio (a pass costs about in proportion
    to its rows); the second look's, its own first measurement's time. A measurement that would end later than that would pay for itself, even at the least
    gain that continues the sweep (:data:`TUNE_MIN_GAIN`), only in a run of over ``TUNE_BUDGET_S / TUNE_MIN_GAIN``
    (160 s) of sampling; without it a deep ``f_R`` on the CPU (ResNet-110) spent minutes here before its first
    input."""
    channels_last = len(shape) == 3
    pooled = engine.pools_in_noise(torch.Size(shape))
    # The eager copy: a static-shape compiled f_R would recompile for every size tried (seconds each); it is compiled
    # once, for the size chosen here.
    net = engine.prepared.get(channels_last, pooled)
    parallel = engine.prepared.may_run_parallel(net)
    net = copy.deepcopy(net)  # timing runs must not change the copy that samples (its modules may keep state)
    latent = torch.zeros(shape, device=engine.device)
    stream = NoiseStream(0, engine.device)
    counts = torch.zeros(engine.num_classes, dtype=torch.int64, device=engine.device)
    best_rate, best, b, flat = 0.0, min(cap, TUNE_MIN_BATCH), min(cap, TUNE_MIN_BATCH), 0
    rates: dict[int, float] = {}
    seconds: dict[int, float] = {}  # what each size's first measurement took
    deadline = time.perf_counter() + TUNE_BUDGET_S

    def fits(projected_s: float) -> bool:
        return time.perf_counter() + projected_s <= deadline

    memory = _BatchMemory(engine.device)
    while b <= cap and memory.allows(b) and (not seconds or fits(seconds[max(seconds)] * b / max(seconds))):
        began = time.perf_counter()
        try:
            with memory.measuring(b):
                rate = _samples_per_second(engine, net, SamplingJob(latent, stream, b, counts), channels_last, pooled,
                                           parallel)
        except torch.OutOfMemoryError:
            break
        rates[b], seconds[b] = rate, time.perf_counter() - began
        # Once past the cache-sized batches, stop after two sizes in a row that do not beat the best by
        # TUNE_MIN_GAIN: past the optimum (slower) or on a plateau.
        flat = flat + 1 if rate < (1 + TUNE_MIN_GAIN) * best_rate else 0
        if rate > best_rate:
            best_rate, best = rate, b
        if flat == 2 and b >= TUNE_MIN_SEARCH:
            break
        b = cap if b < cap < 2 * b else 2 * b
    # A second look at the leaders: on a shared machine one measurement of a size can be slowed by other jobs
    # (noise only ever slows), so each of the fastest TUNE_RECHECK sizes is timed again and keeps its better rate
    # (measured: batches of 4096 chosen under load, 2-5x slower than 64-256 on a quiet machine).
    for b in sorted(rates, key=rates.get, reverse=True)[:TUNE_RECHECK]:
        if not fits(seconds[b]):
            continue
        try:
            rates[b] = max(rates[b], _samples_per_second(engine, net, SamplingJob(latent, stream, b, counts),
                                                              channels_last, pooled, parallel))
        except torch.OutOfMemoryError:
            continue
    return max(rates, key=lambda b: (rates[b], -b)) if rates else best


class _BatchMemory:
    """The tuner's memory guard on CUDA (:data:`TUNE_MEMORY_FRACTION`): the working memory of each batch size it
    measures (peak allocated during the measurement, above what was allocated before it), and whether a larger size,
    scaled linearly from the last one, would stay within the share. Off CUDA every size is allowed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.limit = (TUNE_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
                      if self.cuda else float("inf"))
        self.per_sample = 0.0  # bytes per sample at the last size measured

    def allows(self, batch: int) -> bool:
        return batch * self.per_sample <= self.limit

    @contextlib.contextmanager
    def measuring(self, batch: int):
        if not self.cuda:
            yield
            return
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        self.per_sample = (torch.cuda.max_memory_allocated(self.device) - before) / batch


def _samples_per_second(engine: "SamplingEngine", net, job: SamplingJob, channels_last: bool, pooled: bool, parallel: bool) -> float:
    """Steady-state rate of one batch size: a warm-up pass (allocations, oneDNN/cuDNN algorithm choice), then
    passes until :data:`TUNE_MIN_TIME_S` has elapsed (a single short pass is mostly noise on a busy CPU). A pass
    is one batch per worker thread (:meth:`SamplingEngine._execute`), as a run would use them."""
    batches = torch.get_num_threads() if parallel else 1

    def one_pass() -> None:
        engine._execute(net, [[_segment(job, job.num)] for _ in range(batches)], channels_last, pooled, job.num,
                      parallel)
        synchronize(engine.device)

    one_pass()
    passes, start = 0, time.perf_counter()
    while passes < 2 or time.perf_counter() - start < TUNE_MIN_TIME_S:
        one_pass()
        passes += 1
    return passes * batches * job.num / (time.perf_counter() - start)


__all__ = ["NoiseStream", "SamplingEngine", "SamplingJob", "PRECISIONS", "NOISE_BLOCK",
           "fold_batchnorm", "unfolded_batchnorms"]
