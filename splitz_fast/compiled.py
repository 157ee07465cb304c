"""``torch.compile`` of the prepared ``f_R``, and when the sampling engine samples through it.

A compiled ``f_R`` fuses what eager PyTorch runs as separate passes over each activation (a convolution's bias, the
ReLU, a residual addition, a pool), but compiling costs seconds to minutes per static batch shape, paid once per
process. Whether it pays depends on the model, the card and how long the run is, so the engine decides at run time
(:class:`CompileChoice`, the engine's ``compile`` setting):

* ``compile=True``: compile at the first batch;
* ``compile=False``: never;
* ``compile=None`` (the default): on CUDA, compile once the engine has spent :data:`COMPILE_AFTER_S` seconds sampling
  eagerly. This is the ski-rental rule: a run that ends before then pays nothing, and a run that goes on pays for
  compiling at most about what it had already spent, so it is never more than about twice as slow as it would be
  had the best choice been known in advance (when compiling takes about :data:`COMPILE_AFTER_S`). Off CUDA, ``None``
  stays eager: on the CPU the engine's prepared chain and worker threads are what was measured.

Either way, the compiled ``f_R`` is used only where it scores a batch of real noisy rows like the eager one, within
the batch-independence probe's tolerance (the same base classifier, up to float rounding, like the CUDA graph and the
fused copy), and, for ``None``, only where it also measures faster at the engine's batch. A compile that fails warns
once and sampling stays eager. The switch happens between sampling calls, before any vote of a call is counted.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .graphs import score_gap, seconds_per_call, synchronize

# Seconds of eager sampling after which an engine with compile=None compiles f_R (on CUDA). About what compiling a
# network of tens to a hundred layers takes (one static batch shape, cold caches): the ski-rental break-even.
COMPILE_AFTER_S = 60.0


class CompiledOrEager(nn.Module):
    """``torch.compile(net)`` with static shapes, falling back to ``net`` itself (with one warning) if compiling or
    the first compiled call fails — no compiler, an unsupported platform or model; eager is always a correct base
    classifier. :attr:`compiled` is ``None`` once it has fallen back."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.compiled = None
        try:
            self.compiled = torch.compile(net, dynamic=False)
        except Exception as err:  # noqa: BLE001
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {err}); sampling runs f_R eagerly", stacklevel=4)
        self.compiled = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(x)
            except Exception as err:  # noqa: BLE001
                self._give_up(err)
        return self.net(x)


@dataclass
class CompileDecision:
    """Whether the engine samples one layout and batch through the compiled ``f_R`` (``used``) and why:
    ``compile=True``, a compile that failed or scored differently from eager, or the measurement. ``compile_s``: the
    first compiled call (compiling included); ``eager_s`` / ``compiled_s``: seconds per batch of each."""

    used: bool
    reason: str
    compile_s: float | None = None
    eager_s: float | None = None
    compiled_s: float | None = None


class CompileChoice:
    """A sampling engine's use of a compiled ``f_R``: its ``compile`` setting (``None``: measure, ``True``,
    ``False``), the seconds it has sampled eagerly, and :attr:`decisions` keyed by the engine's
    ``(channels_last, pooled, fused, rows)``."""

    # Where compile=None compiles at all (once COMPILE_AFTER_S of eager sampling has passed).
    AUTO_DEVICES = ("cuda",)

    def __init__(self, setting: bool | None, device: torch.device):
        check_compile_setting(setting)
        self.setting, self.device = setting, torch.device(device)
        self.eager_seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # timed CUDA blocks not yet read
        self.decisions: dict[tuple, CompileDecision] = {}
        self._warned = False

    def due(self) -> bool:
        """Whether the engine should compile now (where it has not decided yet): from the start with
        ``compile=True``; with ``None`` on a device of :attr:`AUTO_DEVICES` once it has sampled eagerly for
        :data:`COMPILE_AFTER_S` seconds."""
        if self.setting is None:
            self._collect()
            return self._timing and self.eager_seconds >= COMPILE_AFTER_S
        return self.setting

    @property
    def _timing(self) -> bool:
        """Whether eager sampling time is counted: only where ``compile=None`` may compile."""
        return self.setting is None and self.device.type in self.AUTO_DEVICES

    def record_eager(self, seconds: float) -> None:
        """Add ``seconds`` of eager sampling."""
        self.eager_seconds += seconds

    @contextlib.contextmanager
    def timed(self, eager: bool):
        """Count the block's time as eager sampling where ``eager`` (and :attr:`_timing`). On CUDA the time between
        two events recorded on the sampling stream around the block, read once both have completed (``query``, no
        host synchronisation): the device's time for the block's batches; elsewhere the block's host time."""
        if not (eager and self._timing):
            yield
        elif self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._pending.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.record_eager(time.perf_counter() - began)

    def _collect(self) -> None:
        """Add the times of the timed CUDA blocks that have completed."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self.record_eager(start.elapsed_time(end) / 1e3)

    def choose(self, key: tuple, scores: Callable[[nn.Module, torch.Tensor], torch.Tensor], eager: nn.Module,
               compiled: CompiledOrEager, example: Callable[[], torch.Tensor], tolerance: float) -> bool:
        """Whether to sample through ``compiled`` rather than ``eager`` (the same prepared ``f_R``; ``scores(net,
        batch)`` is how the engine scores a batch) at the batch of ``example()``: ``compiled`` is called first
        (compiling, outside any timing but its own), must not have fallen back to eager, and must score the batch
        within ``tolerance`` × (largest non-constant score + 1) of ``eager`` (:func:`~splitz_fast.graphs.score_gap`);
        then, with ``compile=None``, the faster wins (:func:`~splitz_fast.graphs.seconds_per_call`). Records the
        decision under ``key``."""
        batch = example()
        start = time.perf_counter()
        try:
            got = scores(compiled, batch)
            synchronize(batch.device)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 — the eager f_R is always correct
            return self._refuse(key, f"failed: {type(err).__name__}: {str(err).strip()[:160]}")
        compile_s = time.perf_counter() - start
        if compiled.compiled is None:  # CompiledOrEager warned already
            self.decisions[key] = CompileDecision(False, "torch.compile failed", compile_s)
            return False
        difference, scale = score_gap(got, scores(eager, batch))
        allowed = tolerance * scale
        if not difference <= allowed:
            return self._refuse(key, f"its scores differ from the eager f_R's by {difference:.3g} (allowed "
                                     f"{allowed:.3g})", compile_s)
        if self.setting:
            self.decisions[key] = CompileDecision(True, "compile=True", compile_s)
            return True
        eager_s = seconds_per_call(lambda: scores(eager, batch), batch.device)
        compiled_s = seconds_per_call(lambda: scores(compiled, batch), batch.device)
        self.decisions[key] = CompileDecision(
            compiled_s < eager_s, f"measured at batch {key[-1]} after {self.eager_seconds:.0f} s of eager sampling: "
            f"eager {eager_s * 1e3:.3f} ms, compiled {compiled_s * 1e3:.3f} ms (compiling took {compile_s:.1f} s)",
            compile_s, eager_s, compiled_s)
        return compiled_s < eager_s

    def _refuse(self, key: tuple, reason: str, compile_s: float | None = None) -> bool:
        if not self._warned:
            self._warned = True
            warnings.warn(f"the compiled f_R is not used ({reason}); sampling runs f_R eagerly", stacklevel=4)
        self.decisions[key] = CompileDecision(False, reason, compile_s)
        return False


def check_compile_setting(setting: object) -> None:
    """Refuse a ``compile`` other than ``None`` (measure), ``True`` or ``False``."""
    if setting not in (None, True, False) or not isinstance(setting, (bool, type(None))):
        raise ValueError(f"compile must be None (compile on CUDA once a run is long enough, where measured faster), "
                         f"True or False, got {setting!r}")


__all__ = ["COMPILE_AFTER_S", "CompileChoice", "CompileDecision", "CompiledOrEager", "check_compile_setting"]
