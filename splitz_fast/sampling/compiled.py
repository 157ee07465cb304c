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
recompile limit). A compile that fails, or a compiled copy that scores differently, is reported once (an error under
``SPLITZ_STRICT=1``) and sampling stays eager; one measured slower is simply not used. The switch happens
between sampling calls, so one input's draws may be scored partly eagerly and partly compiled (as with the CUDA graph,
which replays full batches only): the votes are those of one base classifier up to float rounding.
"""
from __future__ import annotations

import contextlib
import time
import types
from typing import Callable

import torch
import torch.nn as nn

from .choices import CandidateFailed, MeasuredChoice, Option, Trial, Variant, score_mismatch, synchronize
from .graphs import GraphedScores

# Seconds of eager sampling at one batch size after which an engine with compile=None compiles f_R for it (on CUDA).
# About what compiling a network of tens to a hundred layers takes (one static batch shape, cold caches): the
# ski-rental break-even.
COMPILE_AFTER_S = 60.0


def _forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x)


class CompiledOrEager(nn.Module):
    """``net`` through ``torch.compile`` with static shapes, falling back to ``net`` itself (reported through
    ``report``: the engine's :meth:`CompileChoice.report_once`) if compiling or a compiled call fails outside a CUDA
    graph capture — no compiler, an unsupported platform or model; eager is always a correct base classifier.
    :attr:`compiled` is ``None`` once it has fallen back.

    What is compiled is a copy of a one-line entry function with a code object of its own: dynamo keeps its compiled
    code, and its limit on recompiles (8), per code object, so compiling ``net`` itself would share one
    ``nn.Sequential.forward`` budget with every other ``nn.Sequential`` compiled in the process (the user's included),
    and past it would run eagerly without a word."""

    def __init__(self, net: nn.Module, report: Callable[[str], None]):
        super().__init__()
        self.net, self._report = net, report
        self.compiled = None
        entry = types.FunctionType(_forward.__code__.replace(), _forward.__globals__, _forward.__name__)
        try:
            self.compiled = torch.compile(entry, dynamic=False)
        except Exception as err:  # noqa: BLE001
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        self.compiled = None
        self._report(f"torch.compile failed ({type(err).__name__}: {_first_line(err)}); sampling runs f_R eagerly")

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


def _first_line(err: Exception) -> str:
    """The cause in ``err``'s message in one line: inductor's errors carry its whole dump (graph, traceback, advice)
    after it, and its first line may only introduce the next (``backend='inductor' raised:``)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = [f"{lines[0]} {lines[1]}"]
    return lines[0][:240] if lines else ""


class CompileChoice(MeasuredChoice):
    """A sampling engine's use of a compiled ``f_R`` (its ``compile`` setting; ``True`` also off CUDA), the seconds
    it has sampled eagerly per :class:`~splitz_fast.sampling.choices.Variant` (an eager copy at a batch of rows),
    and :attr:`decisions` under the same variants."""

    OPTION = Option("compile", "eager", "compiled", setup="compile")
    FORCED_DEVICES = None

    def __init__(self, setting: bool | None, device: torch.device):
        super().__init__(setting, device)
        self.eager_seconds: dict[Variant, float] = {}
        # timed CUDA blocks not yet read: (variant, share, start, end)
        self._pending: list[tuple[Variant, float, torch.cuda.Event, torch.cuda.Event]] = []

    def due(self, variant: Variant) -> bool:
        """Whether the engine should decide about compiling ``variant`` now: from the start with ``compile=True``;
        with ``None`` on a device of :attr:`AUTO_DEVICES` once it has sampled ``variant`` eagerly for
        :data:`COMPILE_AFTER_S` seconds (since the last decision for it)."""
        if self.setting is None:
            self._collect()
            return self._timing and self.eager_seconds.get(variant, 0.0) >= COMPILE_AFTER_S
        return self.setting

    @property
    def _timing(self) -> bool:
        """Whether eager sampling time is counted: only where ``compile=None`` may compile."""
        return self.setting is None and self.considered

    def record_eager(self, variant: Variant, seconds: float) -> None:
        """Add ``seconds`` of eager sampling of ``variant``."""
        self.eager_seconds[variant] = self.eager_seconds.get(variant, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, variant: Variant, share: float):
        """Count ``share`` (0 to 1: the block's eager full batches as a part of its rows) of the block's time as eager
        sampling of ``variant``, where :attr:`_timing`. On CUDA the time between two events recorded on the sampling
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
            self._pending.append((variant, share, start, end))
            self._collect()  # the list holds only blocks still in flight
        else:
            began = time.perf_counter()
            yield
            self.record_eager(variant, share * (time.perf_counter() - began))

    def _collect(self) -> None:
        """Add the times of the timed CUDA blocks that have completed."""
        while self._pending and self._pending[0][-1].query():
            variant, share, start, end = self._pending.pop(0)
            self.record_eager(variant, share * start.elapsed_time(end) / 1e3)

    def choose(self, variant: Variant, current: Callable[[torch.Tensor], torch.Tensor], compiled: CompiledOrEager,
               scores: Callable[[nn.Module, torch.Tensor], torch.Tensor],
               graphed: Callable[[], GraphedScores | None], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> bool:
        """Whether to sample ``variant`` through ``compiled`` rather than as now (``current(batch)``: the engine's
        scores of a full batch, through its CUDA graph where it uses one). ``compiled`` (the same prepared ``f_R``,
        scored by ``scores(net, batch)``) is called first on ``example()`` (compiling, outside any timing but its own),
        must not have fallen back to eager, and must score the batch like ``current`` within ``tolerance()``
        (:func:`~splitz_fast.sampling.choices.score_mismatch`); then, with ``compile=None``, the faster wins:
        ``current`` against ``compiled`` through ``graphed()`` (its CUDA graph where the engine's graph choice makes
        one, else ``None``), each :func:`~splitz_fast.sampling.choices.seconds_per_call`. A failure on the way
        (running out of device memory included) decides against ``compiled``, reported once: the eager ``f_R`` is
        always correct. Records the decision under ``variant``."""
        try:
            used = self.decide(variant, lambda: self._trial(variant, current, compiled, scores, graphed, example,
                                                            tolerance)) is not None
        except torch.OutOfMemoryError as err:  # the eager f_R, which runs now, is always correct
            self.fail(variant, f"failed: OutOfMemoryError: {str(err).strip()[:160]}")
            used = False
        self.eager_seconds[variant] = 0.0  # a later decision for variant (after an edit of f_R) waits its own time
        return used

    def _trial(self, variant: Variant, current: Callable[[torch.Tensor], torch.Tensor], compiled: CompiledOrEager,
               scores: Callable[[nn.Module, torch.Tensor], torch.Tensor],
               graphed: Callable[[], GraphedScores | None], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> Trial:
        """The steps of :meth:`choose` before the timing: the compiled copy's first call and its scores' check."""
        batch = example()
        start = time.perf_counter()
        got = scores(compiled, batch)
        synchronize(batch.device)
        compile_s = time.perf_counter() - start
        if compiled.compiled is None:  # CompiledOrEager reported why
            raise CandidateFailed("torch.compile failed")
        mismatch = score_mismatch(got, current(batch), tolerance(), "eager")
        if mismatch is not None:
            raise CandidateFailed(mismatch)
        graph = graphed() if self.setting is None else None
        candidate = (lambda b: scores(compiled, b)) if graph is None else graph.score

        def timed_candidate() -> None:
            candidate(batch)
            if compiled.compiled is None:  # fell back to eager while timed: eager against eager
                raise CandidateFailed("torch.compile failed")

        return Trial(lambda: current(batch), timed_candidate, compiled, compile_s,
                     f"{' (graph)' if graph is not None else ''} after {self.eager_seconds.get(variant, 0.0):.0f} s "
                     f"of eager sampling; compiling took {compile_s:.1f} s")

    def fallback_message(self, variant: Variant, reason: str) -> str:
        return f"the compiled f_R is not used ({reason}); sampling runs f_R eagerly"


__all__ = ["COMPILE_AFTER_S", "CompileChoice", "CompiledOrEager"]
