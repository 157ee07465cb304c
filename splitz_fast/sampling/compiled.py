"""``torch.compile`` of the prepared ``f_R``, and when the sampling engine samples through it.

A compiled ``f_R`` fuses what eager PyTorch runs as separate passes over each activation (a convolution's bias, the
ReLU, a residual addition, a pool), but compiling costs seconds to minutes per static batch shape, paid once per
process. Whether it pays depends on the model, the card and how long the run is, so the engine decides at run time
(:class:`CompileChoice`, the engine's ``compile`` setting), per layout, copy (plain or fused) and batch size:

* ``compile=True``: compile at the first batch;
* ``compile=False``: never;
* ``compile=None`` (the default): on CUDA, compile once the engine has spent :data:`COMPILE_AFTER_S` seconds sampling
  eagerly at that batch size (full batches only, the ones a compiled copy would run). This is the ski-rental rule: a run that ends before then pays nothing, and a run that
  goes on pays for compiling at most about what it had already spent, so it is never more than about twice as slow
  as it would be had the best choice been known in advance (when compiling takes about :data:`COMPILE_AFTER_S`).
  Off CUDA, ``None`` stays eager: on the CPU the engine's prepared chain and worker threads are what was measured.

The compiled ``f_R`` is used only where it scores a batch of real noisy rows like the eager one, within the
rounding the eager copy makes (:func:`~splitz_fast.sampling.score_checks.copy_tolerance`: the same base classifier up to float
rounding, like the CUDA graph and the fused copy), and, for ``None``, only where the compiled copy (replayed as a CUDA graph where the engine's graph choice says
so) measures faster at the engine's batch than what the engine runs now (the eager copy, or its CUDA graph). Only full
batches run compiled: a shorter batch (the end of a window, a sequential test's few draws) runs the eager copy, so
nothing is padded and nothing recompiles. Each batch size gets a compiled copy of its own (its own dynamo cache and
recompile limit). A compile that fails warns once and sampling stays eager. The switch happens
between sampling calls, so one input's draws may be scored partly eagerly and partly compiled (as with the CUDA graph,
which replays full batches only): the votes are those of one base classifier up to float rounding.
"""
from __future__ import annotations

import contextlib
import time
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .graphs import GraphedScores, seconds_per_call, synchronize
from .score_checks import score_gap

# Seconds of eager sampling at one batch size after which an engine with compile=None compiles f_R for it (on CUDA).
# About what compiling a network of tens to a hundred layers takes (one static batch shape, cold caches): the
# ski-rental break-even.
COMPILE_AFTER_S = 60.0


def _forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x)


class CompiledOrEager(nn.Module):
    """``net`` through ``torch.compile`` with static shapes, falling back to ``net`` itself (with a warning through
    ``warn``: the engine's :meth:`CompileChoice.warn_once`) if compiling or a compiled call fails outside a CUDA graph
    capture — no compiler, an unsupported platform or model;
    eager is always a correct base classifier. :attr:`compiled` is ``None`` once it has fallen back.

    What is compiled is a copy of a one-line entry function with a code object of its own: dynamo keeps its compiled
    code, and its limit on recompiles (8), per code object, so compiling ``net`` itself would share one
    ``nn.Sequential.forward`` budget with every other ``nn.Sequential`` compiled in the process (the user's included),
    and past it would run eagerly without a word."""

    def __init__(self, net: nn.Module, warn: Callable[[str], None]):
        super().__init__()
        self.net, self._warn = net, warn
        self.compiled = None
        entry = types.FunctionType(_forward.__code__.replace(), _forward.__globals__, _forward.__name__)
        try:
            self.compiled = torch.compile(entry, dynamic=False)
        except Exception as err:  # noqa: BLE001
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        self._warn(f"torch.compile failed ({type(err).__name__}: {err}); sampling runs f_R eagerly")
        self.compiled = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            return self.net(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.compiled(self.net, x)  # a failure here fails the capture: no graph, compiled stays
        try:
            return self.compiled(self.net, x)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001
            self._give_up(err)
        return self.net(x)


@dataclass
class CompileDecision:
    """Whether the engine samples one layout, copy and batch through the compiled ``f_R`` (``used``) and why:
    ``compile=True``, a compile that failed or scored differently from eager, or the measurement. ``compile_s``: the
    first compiled call (compiling included); ``eager_s`` / ``compiled_s``: seconds per batch of what the engine ran
    before and of the compiled copy (each replayed as a CUDA graph where the engine uses one)."""

    used: bool
    reason: str
    compile_s: float | None = None
    eager_s: float | None = None
    compiled_s: float | None = None


class CompileChoice:
    """A sampling engine's use of a compiled ``f_R``: its ``compile`` setting (``None``: measure, ``True``,
    ``False``), the seconds it has sampled eagerly per ``(channels_last, pooled, fused, rows)``, and
    :attr:`decisions` under the same keys."""

    # Where compile=None compiles at all (once COMPILE_AFTER_S of eager sampling at a batch size has passed).
    AUTO_DEVICES = ("cuda",)

    def __init__(self, setting: bool | None, device: torch.device):
        check_compile_setting(setting)
        self.setting, self.device = setting, torch.device(device)
        self.eager_seconds: dict[tuple, float] = {}
        self.decisions: dict[tuple, CompileDecision] = {}
        # timed CUDA blocks not yet read: (key, share, start, end)
        self._pending: list[tuple[tuple, float, torch.cuda.Event, torch.cuda.Event]] = []
        self._warned = False

    def due(self, key: tuple) -> bool:
        """Whether the engine should decide about compiling for ``key`` now: from the start with ``compile=True``;
        with ``None`` on a device of :attr:`AUTO_DEVICES` once it has sampled ``key`` eagerly for
        :data:`COMPILE_AFTER_S` seconds (since the last decision for it)."""
        if self.setting is None:
            self._collect()
            return self._timing and self.eager_seconds.get(key, 0.0) >= COMPILE_AFTER_S
        return self.setting

    @property
    def _timing(self) -> bool:
        """Whether eager sampling time is counted: only where ``compile=None`` may compile."""
        return self.setting is None and self.device.type in self.AUTO_DEVICES

    def record_eager(self, key: tuple, seconds: float) -> None:
        """Add ``seconds`` of eager sampling of ``key``."""
        self.eager_seconds[key] = self.eager_seconds.get(key, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, key: tuple, share: float):
        """Count ``share`` (0 to 1: the block's eager full batches as a part of its rows) of the block's time as eager
        sampling of ``key``, where :attr:`_timing`. On CUDA the time between two events recorded on the sampling
        stream around the block, read once both have completed (``query``, no host synchronisation): the device's
        time for the block's batches; elsewhere the block's host time."""
        if not (share > 0 and self._timing):
            yield
        elif self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._pending.append((key, share, start, end))
            self._collect()  # the list holds only blocks still in flight
        else:
            began = time.perf_counter()
            yield
            self.record_eager(key, share * (time.perf_counter() - began))

    def _collect(self) -> None:
        """Add the times of the timed CUDA blocks that have completed."""
        while self._pending and self._pending[0][-1].query():
            key, share, start, end = self._pending.pop(0)
            self.record_eager(key, share * start.elapsed_time(end) / 1e3)

    def choose(self, key: tuple, current: Callable[[torch.Tensor], torch.Tensor], compiled: CompiledOrEager,
               scores: Callable[[nn.Module, torch.Tensor], torch.Tensor],
               graphed: Callable[[], GraphedScores | None], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> bool:
        """Whether to sample ``key`` through ``compiled`` rather than as now (``current(batch)``: the engine's scores
        of a full batch, through its CUDA graph where it uses one). ``compiled`` (the same prepared ``f_R``, scored by
        ``scores(net, batch)``) is called first on ``example()`` (compiling, outside any timing but its own), must not
        have fallen back to eager, and must score the batch within ``tolerance()`` × (largest non-constant score + 1) of
        ``current`` (:func:`~splitz_fast.sampling.score_checks.score_gap`); then, with ``compile=None``, the faster wins: ``current``
        against ``compiled`` through ``graphed()`` (its CUDA graph where the engine's graph choice makes one, else
        ``None``), each :func:`~splitz_fast.sampling.graphs.seconds_per_call`. A failure on the way (running out of device memory
        included) decides against ``compiled``, with one warning: the eager ``f_R`` is always correct. Records the
        decision under ``key``."""
        try:
            decision, warn = self._measure(key, current, compiled, scores, graphed, example, tolerance)
        except Exception as err:  # noqa: BLE001 — out of device memory included: the eager f_R is always correct
            decision, warn = CompileDecision(False, f"failed: {type(err).__name__}: {str(err).strip()[:160]}"), True
        if warn:
            self.warn_once(f"the compiled f_R is not used ({decision.reason}); sampling runs f_R eagerly")
        self.decisions[key] = decision
        self.eager_seconds[key] = 0.0  # a later decision for key (after an edit of f_R) waits its own time
        return decision.used

    def _measure(self, key: tuple, current: Callable[[torch.Tensor], torch.Tensor], compiled: CompiledOrEager,
                 scores: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 graphed: Callable[[], GraphedScores | None], example: Callable[[], torch.Tensor],
                 tolerance: Callable[[], float]) -> tuple[CompileDecision, bool]:
        """The steps of :meth:`choose`: its decision, and whether it deserves a warning."""
        batch = example()
        start = time.perf_counter()
        got = scores(compiled, batch)
        synchronize(batch.device)
        compile_s = time.perf_counter() - start
        if compiled.compiled is None:  # CompiledOrEager warned already
            return CompileDecision(False, "torch.compile failed", compile_s), False
        difference, scale = score_gap(got, current(batch))
        allowed = tolerance() * scale
        if not difference <= allowed:
            return CompileDecision(False, f"its scores differ from the eager f_R's by {difference:.3g} (allowed "
                                          f"{allowed:.3g})", compile_s), True
        if self.setting:
            return CompileDecision(True, "compile=True", compile_s), False
        graph = graphed()
        candidate = (lambda b: scores(compiled, b)) if graph is None else graph.score
        eager_s = seconds_per_call(lambda: current(batch), batch.device)
        compiled_s = seconds_per_call(lambda: candidate(batch), batch.device)
        if compiled.compiled is None:  # fell back to eager while measured: eager against eager
            return CompileDecision(False, "torch.compile failed", compile_s), False
        return CompileDecision(compiled_s < eager_s, f"measured at batch {key[-1]} after "
                               f"{self.eager_seconds.get(key, 0.0):.0f} s of eager sampling: eager "
                               f"{eager_s * 1e3:.3f} ms, compiled {compiled_s * 1e3:.3f} ms"
                               f"{' (graph)' if graph is not None else ''}; compiling took {compile_s:.1f} s",
                               compile_s, eager_s, compiled_s), False

    def warn_once(self, message: str) -> None:
        """One warning per engine about its compiled ``f_R`` (a failed compile at any batch size, or a compiled copy
        that is not used for a reason other than speed): one is enough to say that sampling runs eagerly."""
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=3)


def check_compile_setting(setting: object) -> None:
    """Refuse a ``compile`` other than ``None`` (measure), ``True`` or ``False``."""
    if setting not in (None, True, False) or not isinstance(setting, (bool, type(None))):
        raise ValueError(f"compile must be None (compile on CUDA once a run is long enough, where measured faster), "
                         f"True or False, got {setting!r}")


__all__ = ["COMPILE_AFTER_S", "CompileChoice", "CompileDecision", "CompiledOrEager", "check_compile_setting"]
