"""The sampling engine's measured choices: one mechanism for "a faster copy of ``f_R``, or what runs without it".

Three options of the engine each offer a faster way to score a static batch of noisy rows: a CUDA graph
(:mod:`~splitz_fast.sampling.graphs`, ``cuda_graphs``), ``torch.compile`` (:mod:`~splitz_fast.sampling.compiled`,
``compile``) and fused kernels (:mod:`~splitz_fast.sampling.epilogues`, ``fused_kernels``). Each is a
:class:`MeasuredChoice`: its setting (``None``: measure, ``True``: use it wherever it scores alike, ``False``: never),
and one :class:`Decision` per :class:`Variant` (how a batch is scored: layout, copy, rows). A decision is made once:
the candidate is prepared and run on a batch of real noisy rows, its scores must match what runs without it within
the rounding that copy makes (:func:`score_mismatch`, :func:`~splitz_fast.sampling.score_checks.copy_tolerance`), and
then, for ``None``, both are timed (:func:`seconds_per_call`) and the faster is used.

A measured verdict is remembered per machine and ``f_R`` structure (:data:`~splitz_fast.sampling.memory.VERDICTS`,
where the engine gives its :attr:`MeasuredChoice.memory_key`): a later engine with the same key skips the timing — it
does not prepare a candidate remembered as slower, and prepares and checks one remembered as faster before using it.

A candidate that fails on the way (it cannot be prepared, it fails when run, or its scores differ) is a fallback:
the engine keeps what it ran, which is always a correct base classifier, and says so once per choice through
:func:`~splitz_fast._checks.report_fallback` (an error under ``SPLITZ_STRICT=1``). A candidate measured slower is the
measurement working: recorded, not reported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Callable, ClassVar

import torch

from .._checks import report_fallback
from .memory import VERDICTS
from .score_checks import score_gap

# The timing of the two sides (:func:`seconds_per_call`): calls of each until this much time has elapsed, the better
# of up to TIMING_ROUNDS rounds (one round where a round already takes TIMING_LONG_S: a batch that slow is not
# launch-bound, and the choice is not worth seconds of a run).
TIMING_MIN_S = 0.02
TIMING_ROUNDS = 3
TIMING_LONG_S = 0.1


@dataclass(frozen=True, kw_only=True)
class Variant:
    """How the engine scores a batch: the layout (``channels_last`` image batches; ``pooled``: ``f_R``'s leading max
    pool drawn with the noise), the prepared copy (``fused`` epilogues, ``compiled`` through ``torch.compile``) and
    the static batch of ``rows`` (``None``: what every batch size of that copy shares, the prepared module itself).
    ``dataclasses.replace(variant, compiled=True)`` is the same variant through the compiled copy."""

    channels_last: bool
    pooled: bool
    fused: bool = False
    compiled: bool = False
    rows: int | None = None

    @property
    def layout(self) -> tuple[bool, bool]:
        """``(channels_last, pooled)``, the arguments of the prepared copy's layout."""
        return self.channels_last, self.pooled


@dataclass(frozen=True)
class Option:
    """One faster way of the engine: its setting (the engine's argument, e.g. ``cuda_graphs``) and the names of the
    two sides it measures (``baseline``: what runs without it; ``candidate``), with ``setup``, the name of the
    one-off cost measured on the way (``compile``), where there is one. The names label reasons and records."""

    setting: str
    baseline: str
    candidate: str
    setup: str | None = None


@dataclass(frozen=True)
class Decision:
    """Whether the engine scores one :class:`Variant` through its ``option``'s candidate (``used``) and why: the
    setting (``cuda_graphs=True``, ...), a failure (the candidate is not used), or the measurement.
    ``baseline_s`` / ``candidate_s``: seconds per batch of each side where measured; ``setup_s``: the option's
    one-off cost (the first compiled call) where measured. ``sites``: where the candidate is decided part by part
    (fused kernels, layer by layer), each part's decision by its name, the same fields for that part."""

    option: Option
    used: bool
    reason: str
    baseline_s: float | None = None
    candidate_s: float | None = None
    setup_s: float | None = None
    sites: tuple[tuple[str, "Decision"], ...] = ()

    def record(self, variant: Variant) -> dict:
        """The decision as a run record: the variant's fields (``rows`` as ``batch``), ``used``, ``reason`` and each
        measured time under its side's name (``eager_s``, ``graph_s``, ...; ``None`` where not measured), and ``sites``
        (each part's :meth:`part_record`) where decided part by part."""
        record = {f.name: getattr(variant, f.name) for f in fields(variant)}
        record["batch"] = record.pop("rows")
        record.update(self.part_record())
        if self.option.setup is not None:
            record[f"{self.option.setup}_s"] = self.setup_s
        if self.sites:
            record["sites"] = {name: site.part_record() for name, site in self.sites}
        return record

    def part_record(self) -> dict:
        """The decision of one part (:attr:`sites`) as a record: ``used``, ``reason`` and each measured time."""
        return {"used": self.used, "reason": self.reason, f"{self.option.baseline}_s": self.baseline_s,
                f"{self.option.candidate}_s": self.candidate_s}


class CandidateFailed(RuntimeError):
    """The candidate of a measured choice could not be prepared or run, or scored differently: it is not used."""


@dataclass
class Trial:
    """A candidate ready to be decided on: it ran once and scored like the baseline. ``baseline()`` and
    ``candidate()`` each score the same full batch (for timing); ``candidate`` raises :class:`CandidateFailed`
    where it stopped being the candidate while timed. ``made``: the candidate itself (a graph, a compiled copy), for
    the engine where it is used; ``setup_s``: the one-off cost measured while preparing it; ``note``: what the reason
    of a measured decision adds (what was compared, the setup's time)."""

    baseline: Callable[[], object]
    candidate: Callable[[], object]
    made: object = None
    setup_s: float | None = None
    note: str = ""


class MeasuredChoice:
    """One option of a sampling engine (:attr:`OPTION`): its setting (``None``: measure on :attr:`AUTO_DEVICES`,
    ``True``: use the candidate wherever it scores alike, ``False``: never), and :attr:`decisions`, one per
    :class:`Variant` decided. One report (:func:`~splitz_fast._checks.report_fallback`) for a candidate that fails,
    however many variants fail."""

    OPTION: ClassVar[Option]
    # Where setting=None measures (elsewhere it keeps the baseline and decides nothing).
    AUTO_DEVICES: ClassVar[tuple[str, ...]] = ("cuda",)
    # Where setting=True may be asked for (None: anywhere); elsewhere the engine refuses it at construction.
    FORCED_DEVICES: ClassVar[tuple[str, ...] | None] = ("cuda",)

    def __init__(self, setting: bool | None, device: torch.device):
        check_setting(self.OPTION.setting, setting)
        device = torch.device(device)
        if setting and self.FORCED_DEVICES is not None and device.type not in self.FORCED_DEVICES:
            raise ValueError(f"{self.OPTION.setting}=True needs f_R on a CUDA device (it is on {device}); move the "
                             f"model with .cuda(), or leave {self.OPTION.setting} unset")
        self.setting, self.device = setting, device
        self.decisions: dict[Variant, Decision] = {}
        self._reported = False
        # What the engine's verdicts are remembered under (f_R's structure, the precision), read at each decision;
        # None: nothing remembered or recalled.
        self.memory_key: Callable[[], tuple] | None = None

    @property
    def considered(self) -> bool:
        """Whether the choice is made at all: ``True``, or ``None`` on a device of :attr:`AUTO_DEVICES`."""
        return bool(self.setting) or (self.setting is None and self.device.type in self.AUTO_DEVICES)

    def decide(self, variant: Variant, trial: Callable[[], Trial]) -> Trial | None:
        """The candidate of ``variant`` where the engine should use it, else ``None``: ``trial()`` prepares it, runs it
        once and checks its scores (raising :class:`CandidateFailed` where it fails); with ``True`` it is used, with
        ``None`` the faster of its two sides (:func:`seconds_per_call`). Records the decision under ``variant``; a
        failure is reported once (:meth:`report_once`). With ``None``, a verdict remembered for ``variant``
        (:meth:`recall`) replaces the timing: remembered slower, ``trial`` is not even called."""
        key = self.verdict_key(variant)
        remembered = self.recall(key)
        if remembered is not None and not remembered.used:
            self.decisions[variant] = remembered
            return None
        try:
            tried = trial()
            if self.setting:
                decision = Decision(self.OPTION, True, f"{self.OPTION.setting}=True", setup_s=tried.setup_s)
            elif remembered is not None:
                decision = replace(remembered, setup_s=tried.setup_s)
            else:
                baseline_s = seconds_per_call(tried.baseline, self.device)
                candidate_s = seconds_per_call(tried.candidate, self.device)
                decision = Decision(self.OPTION, candidate_s < baseline_s,
                                    f"measured at batch {variant.rows}: {self.OPTION.baseline} {baseline_s * 1e3:.3f} "
                                    f"ms, {self.OPTION.candidate} {candidate_s * 1e3:.3f} ms{tried.note}",
                                    baseline_s, candidate_s, tried.setup_s)
                self.remember(key, decision)
        except CandidateFailed as err:
            self.fail(variant, str(err))
            return None
        self.decisions[variant] = decision
        return tried if decision.used else None

    def verdict_key(self, variant: Variant, *part: object) -> tuple | None:
        """What a measured verdict on ``variant`` (and ``part`` of it, e.g. a fused site) is remembered under:
        the option, the engine's :attr:`memory_key` and the variant's fields; ``None`` where nothing is remembered
        (no key given, or a setting other than ``None``: nothing is measured)."""
        if self.memory_key is None or self.setting is not None:
            return None
        return (self.OPTION.setting, *self.memory_key(), *(getattr(variant, f.name) for f in fields(variant)), *part)

    def recall(self, key: tuple | None) -> Decision | None:
        """The verdict remembered under ``key`` on this machine, as a decision whose reason says so."""
        found = None if key is None else VERDICTS.recall(key, self.device)
        if found is None:
            return None
        return Decision(self.OPTION, found["used"], f"remembered ({found['reason']})", found.get("baseline_s"),
                        found.get("candidate_s"))

    def remember(self, key: tuple | None, decision: Decision) -> None:
        """Remember a measured ``decision`` under ``key`` (nothing where ``key`` is ``None``)."""
        if key is not None:
            VERDICTS.remember(key, self.device, dict(used=decision.used, reason=decision.reason,
                                                     baseline_s=decision.baseline_s,
                                                     candidate_s=decision.candidate_s))

    def fail(self, variant: Variant, reason: str) -> None:
        """Record that ``variant`` keeps its baseline because its candidate failed (``reason``), and report it once."""
        self.decisions[variant] = Decision(self.OPTION, False, reason)
        self.report_once(self.fallback_message(variant, reason))

    def fallback_message(self, variant: Variant, reason: str) -> str:
        """What a failure of ``variant``'s candidate (``reason``) means for sampling, in one line."""
        return (f"the {self.OPTION.candidate} f_R is not used ({reason}); sampling runs the {self.OPTION.baseline} "
                "f_R")

    def report_once(self, message: str) -> None:
        """:func:`~splitz_fast._checks.report_fallback` of ``message``, once per choice (under ``SPLITZ_STRICT=1``
        every time: each raises)."""
        if not self._reported:
            report_fallback(message, stacklevel=4)
            self._reported = True

    def records(self) -> list[dict]:
        """Every decision as a run record (:meth:`Decision.record`), in the order made."""
        return [decision.record(variant) for variant, decision in self.decisions.items()]


class CopyChoice(MeasuredChoice):
    """A measured choice between two scorers of the same ``f_R`` as a whole (a cast copy against autocast, ...)."""

    def choose(self, variant: Variant, baseline: Callable[[torch.Tensor], torch.Tensor],
               candidate: Callable[[torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> bool:
        """Whether to sample through ``candidate`` rather than ``baseline`` at the batch of ``example()``: both score
        it first (outside any timing), the candidate's scores must lie within ``tolerance()`` × (largest non-constant
        score + 1) of the baseline's (:func:`score_mismatch`), then (by default) the faster wins. A candidate that
        fails or scores differently is reported once. Records the decision under ``variant``."""
        def trial() -> Trial:
            batch = example()
            try:
                want, got = baseline(batch), candidate(batch)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 — a copy that cannot run here: the baseline is always correct
                raise CandidateFailed(f"failed: {type(err).__name__}: {str(err).strip()[:160]}") from err
            mismatch = score_mismatch(got, want, tolerance(), self.OPTION.baseline)
            if mismatch is not None:
                raise CandidateFailed(mismatch)
            return Trial(lambda: baseline(batch), lambda: candidate(batch))

        return self.decide(variant, trial) is not None


def check_setting(option: str, setting: object) -> None:
    """Refuse an ``option`` setting other than ``None`` (measure), ``True`` or ``False``."""
    if not isinstance(setting, (bool, type(None))):
        raise ValueError(f"{option} must be None (measure), True or False, got {setting!r}")


def score_mismatch(got: torch.Tensor, want: torch.Tensor, tolerance: float, baseline: str) -> str | None:
    """Why ``got`` (a candidate's scores of a batch) is not ``want`` (the ``baseline`` copy's) up to rounding, or
    ``None`` where it is: the largest difference (:func:`~splitz_fast.sampling.score_checks.score_gap`) must be at
    most ``tolerance`` × (the largest score of a class that is not constant + 1)."""
    gap, scale = score_gap(got, want)
    allowed = tolerance * scale
    if gap <= allowed:
        return None
    return f"its scores differ from the {baseline} f_R's by {gap:.3g} (allowed {allowed:.3g})"


def seconds_per_call(call: Callable[[], object], device: torch.device, rounds: int = TIMING_ROUNDS) -> float:
    """Seconds per call of ``call`` on ``device``: the better of up to ``rounds`` rounds of at least
    :data:`TIMING_MIN_S` (calls queued back to back, as the engine issues them: on CUDA the time is the host's or the
    GPU's, whichever is slower; a round of :data:`TIMING_LONG_S` or more is the last)."""
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        calls, start = 0, time.perf_counter()
        while calls < 2 or time.perf_counter() - start < TIMING_MIN_S:
            call()
            calls += 1
        synchronize(device)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed / calls)
        if elapsed >= TIMING_LONG_S:
            break
    return best


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; elsewhere the work is done when the call returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["CandidateFailed", "CopyChoice", "Decision", "MeasuredChoice", "Option", "Trial", "Variant", "check_setting",
           "score_mismatch", "seconds_per_call", "synchronize"]
