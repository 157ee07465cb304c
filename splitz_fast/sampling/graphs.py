"""``f_R``'s forward at the engine's static batch, captured once as a CUDA graph and replayed for every batch.

Why: on CUDA a sampling batch is one kernel launch per layer of ``f_R`` (a ResNet-110: about 330), and with small or
fast layers the host cannot launch them as fast as the GPU runs them (measured on an H100: LeNet at batch 1024 spent
80 ms of host time per image for 56 ms of GPU time; ResNet-110 filled the launch queue). A replayed graph is one launch
per batch. The noise kernel writes each batch into the graph's input buffer and the votes are counted from its output
buffer, both outside the graph, on the same stream, so the order of work is what it was.

The base classifier does not change: the graph replays the kernels that the prepared ``f_R`` launched while it was
captured, on the same shapes. :func:`capture_scores` checks this on a noisy batch before the graph is used (its scores
against an eager forward of the same batch, to the rounding the eager forward makes: :mod:`~splitz_fast.sampling.score_checks`), and
:func:`graph_is_faster` times both at the static batch where the choice is left to measurement. Where capturing fails
(an ``f_R`` that synchronises with the host, data-dependent shapes, ...), or the check fails, the engine warns once and
samples eagerly.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .score_checks import score_gap

# Eager calls on a side stream before the capture: cuDNN's benchmark mode picks its algorithms, lazy initialisation
# (cuBLAS workspaces, autocast, compiled code) happens outside the graph.
WARMUP_CALLS = 2
# The timing that decides between the graph and eager (:func:`graph_is_faster`): calls of each until this much time
# has elapsed, the better of up to TIMING_ROUNDS rounds (one round where a round already takes TIMING_LONG_S: a batch
# that slow is not launch-bound, and the choice is not worth seconds of a run).
TIMING_MIN_S = 0.02
TIMING_ROUNDS = 3
TIMING_LONG_S = 0.1


class GraphCaptureError(RuntimeError):
    """``f_R`` could not be captured as a CUDA graph, or its replay did not score like the eager forward."""


@dataclass
class GraphedScores:
    """A captured forward: write a batch into :attr:`input` (its rows, dtype and memory format are fixed), call
    :meth:`replay`, read the scores from the tensor it returns (overwritten by the next replay)."""

    graph: torch.cuda.CUDAGraph
    input: torch.Tensor
    output: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output

    def score(self, batch: torch.Tensor) -> torch.Tensor:
        """The scores of ``batch`` (shaped like :attr:`input`): copied into the input, then replayed."""
        self.input.copy_(batch)
        return self.replay()


def capture_scores(scores: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor,
                   tolerance: Callable[[], float]) -> GraphedScores:
    """Capture ``scores`` (the engine's forward of the prepared ``f_R``, in its precision) on a static batch shaped
    like ``example`` (a batch of real noisy rows, in the layout the engine feeds) and check the graph: its scores for
    ``example`` must match an eager call's within ``tolerance()`` (:func:`~splitz_fast.sampling.score_checks.copy_tolerance`) relative to the largest score of a class that is not
    constant (+1; :func:`score_gap`). Raises :class:`GraphCaptureError` if capturing or the check fails.

    The capture only records the calling thread's work (``capture_error_mode="thread_local"``): the radius search of
    another group of inputs may run on a worker thread meanwhile."""
    if example.device.type != "cuda":
        raise GraphCaptureError(f"CUDA graphs need a CUDA device, f_R samples on {example.device}")
    static_input = example.clone(memory_format=torch.preserve_format)
    current = torch.cuda.current_stream(example.device)
    side = torch.cuda.Stream(example.device)
    try:
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                expected = scores(static_input)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = scores(static_input)
        graph.replay()
    except Exception as err:  # noqa: BLE001 — any failure to capture means: sample eagerly
        _release_default_generator(example.device)
        raise GraphCaptureError(f"{type(err).__name__}: {err}") from err
    gap, scale = score_gap(output, expected)
    if not gap <= tolerance() * scale:
        raise GraphCaptureError(f"the replayed graph's scores differ from the eager forward's by {gap:.3g} (scores up "
                                f"to {scale - 1:.3g})")
    return GraphedScores(graph, static_input, output)


def _release_default_generator(device: torch.device) -> None:
    """After a capture that failed part-way: the device's default generator, which the capture registered, set back
    to its own seed and offset outside any capture. PyTorch (2.11 measured on an H100) takes a generator out of
    capture mode only when the capture ends cleanly; left in it, every later random op of the process on that device
    (``torch.rand(..., device="cuda")``) raised "Offset increment outside graph capture". The generator is pointed at
    a copy of its state (same seed and offset, so the same draws follow)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())


def graph_is_faster(scores: Callable[[torch.Tensor], torch.Tensor],
                    graphed: GraphedScores) -> tuple[bool, float, float]:
    """Whether replaying ``graphed`` scores its static batch faster than the eager ``scores``, measured here:
    ``(faster, eager seconds per batch, graph seconds per batch)``, each the better of up to :data:`TIMING_ROUNDS`
    rounds of at least :data:`TIMING_MIN_S` (:func:`seconds_per_call`). Noise and vote counting are the same either
    way and are not timed."""
    batch = graphed.input
    eager = seconds_per_call(lambda: scores(batch), batch.device)
    graph = seconds_per_call(graphed.replay, batch.device)
    return graph < eager, eager, graph


def seconds_per_call(call: Callable[[], object], device: torch.device) -> float:
    """Seconds per call of ``call`` on ``device``: the better of up to :data:`TIMING_ROUNDS` rounds of at least
    :data:`TIMING_MIN_S` (calls queued back to back, as the engine issues them: on CUDA the time is the host's or the
    GPU's, whichever is slower; a round of :data:`TIMING_LONG_S` or more is the last)."""
    best = float("inf")
    for _ in range(TIMING_ROUNDS):
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


def check_cuda_setting(option: str, setting: bool | None, device: torch.device) -> None:
    """Refuse ``option=True`` (a CUDA-only engine setting: CUDA graphs, fused kernels) for ``f_R`` off CUDA."""
    if setting and device.type != "cuda":
        raise ValueError(f"{option}=True needs f_R on a CUDA device (it is on {device}); move the model with .cuda(), "
                         f"or leave {option} unset")


@dataclass
class GraphDecision:
    """Whether the engine scores one static batch through a CUDA graph (``used``) and why: ``cuda_graphs=True``, the
    measurement (``eager_s`` / ``graph_s``: seconds per batch of each), or the capture's failure."""

    used: bool
    reason: str
    eager_s: float | None = None
    graph_s: float | None = None


class GraphChoice:
    """A sampling engine's use of CUDA graphs: its ``cuda_graphs`` setting (``None``: measure, ``True``, ``False``),
    and :attr:`decisions`, keyed by the engine's ``(channels_last, pooled, fused, compiled, rows)``. One warning for a capture that
    fails, however many batch shapes fail."""

    def __init__(self, setting: bool | None, device: torch.device):
        check_cuda_setting("cuda_graphs", setting, device)
        self.setting, self.device = setting, device
        self.decisions: dict[tuple, GraphDecision] = {}

    def choose(self, key: tuple, scores: Callable[[torch.Tensor], torch.Tensor], example: Callable[[], torch.Tensor],
               tolerance: Callable[[], float]) -> GraphedScores | None:
        """A checked graph of ``scores`` at the shape of ``example()`` (a batch of noisy rows), or ``None`` where the
        engine should stay eager: off CUDA, ``cuda_graphs=False``, a failed capture, or (by default) eager measured
        faster. Records the decision under ``key``."""
        if self.device.type != "cuda" or self.setting is False:
            return None
        try:
            graphed = capture_scores(scores, example(), tolerance)
        except GraphCaptureError as err:
            if not any(d.reason.startswith("capture failed") for d in self.decisions.values()):
                copy = "the compiled f_R" if key[-2] else "f_R"  # key: (..., compiled, rows)
                warnings.warn(f"{copy} could not run as a CUDA graph ({err}); sampling runs it without one",
                              stacklevel=2)
            self.decisions[key] = GraphDecision(False, f"capture failed: {err}")
            return None
        if self.setting:
            self.decisions[key] = GraphDecision(True, "cuda_graphs=True")
            return graphed
        faster, eager_s, graph_s = graph_is_faster(scores, graphed)
        self.decisions[key] = GraphDecision(faster, f"measured at batch {key[-1]}: eager {eager_s * 1e3:.3f} ms, "
                                                    f"graph {graph_s * 1e3:.3f} ms", eager_s, graph_s)
        return graphed if faster else None


__all__ = ["GraphCaptureError", "GraphChoice", "GraphDecision", "GraphedScores", "capture_scores", "graph_is_faster",
           "seconds_per_call", "synchronize"]
