"""``f_R``'s forward at the engine's static batch, captured once as a CUDA graph and replayed for every batch.

Why: on CUDA a sampling batch is one kernel launch per layer of ``f_R`` (a ResNet-110: about 330), and with small or
fast layers the host cannot launch them as fast as the GPU runs them (measured on an H100: LeNet at batch 1024 spent
80 ms of host time per image for 56 ms of GPU time; ResNet-110 filled the launch queue). A replayed graph is one launch
per batch. The noise kernel writes each batch into the graph's input buffer and the votes are counted from its output
buffer, both outside the graph, on the same stream, so the order of work is what it was.

The base classifier does not change: the graph replays the kernels that the prepared ``f_R`` launched while it was
captured, on the same shapes. :func:`capture_scores` checks this on a noisy batch before the graph is used (its scores
against an eager forward of the same batch, to the rounding the eager forward makes: :mod:`~splitz_fast.sampling.score_checks`), and
the engine's :class:`GraphChoice` (a :class:`~splitz_fast.sampling.choices.MeasuredChoice`) times both at the static
batch where the choice is left to measurement. Where capturing fails (an ``f_R`` that synchronises with the host,
data-dependent shapes, ...), or the check fails, the engine reports it once (an error under ``SPLITZ_STRICT=1``) and
samples without the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .choices import CandidateFailed, MeasuredChoice, Option, Trial, Variant, score_mismatch

# Eager calls on a side stream before the capture: cuDNN's benchmark mode picks its algorithms, lazy initialisation
# (cuBLAS workspaces, autocast, compiled code) happens outside the graph.
WARMUP_CALLS = 2


class GraphCaptureError(CandidateFailed):
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
    ``example`` must match an eager call's within ``tolerance()``
    (:func:`~splitz_fast.sampling.score_checks.copy_tolerance`) relative to the largest score of a class that is not
    constant (+1; :func:`~splitz_fast.sampling.choices.score_mismatch`). Raises :class:`GraphCaptureError` if
    capturing or the check fails.

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
    mismatch = score_mismatch(output, expected, tolerance(), "eager")
    if mismatch is not None:
        raise GraphCaptureError(f"the replayed graph: {mismatch}")
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


class GraphChoice(MeasuredChoice):
    """A sampling engine's use of CUDA graphs (its ``cuda_graphs`` setting), one decision per :class:`Variant` captured
    (plain or fused, eager or compiled copy, at its static batch of rows)."""

    OPTION = Option("cuda_graphs", "eager", "graph")

    def choose(self, variant: Variant, scores: Callable[[torch.Tensor], torch.Tensor],
               example: Callable[[], torch.Tensor], tolerance: Callable[[], float]) -> GraphedScores | None:
        """A checked graph of ``scores`` at the shape of ``example()`` (a batch of noisy rows), or ``None`` where the
        engine should stay eager: off CUDA, ``cuda_graphs=False``, a failed capture (reported once), or (by default)
        eager measured faster. Records the decision under ``variant``."""
        if not self.considered:
            return None

        def trial() -> Trial:
            try:
                graphed = capture_scores(scores, example(), tolerance)
            except GraphCaptureError as err:
                raise GraphCaptureError(f"capture failed: {err}") from err
            batch = graphed.input
            return Trial(lambda: scores(batch), graphed.replay, graphed)

        tried = self.decide(variant, trial)
        return None if tried is None else tried.made

    def fallback_message(self, variant: Variant, reason: str) -> str:
        copy = "the compiled f_R" if variant.compiled else "f_R"
        return f"{copy} could not run as a CUDA graph ({reason}); sampling runs it without one"


__all__ = ["GraphCaptureError", "GraphChoice", "GraphedScores", "capture_scores"]
