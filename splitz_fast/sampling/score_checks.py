"""When two scorings of one batch by ``f_R`` count as the same base classifier: the gap between them, and the gap that
float rounding alone can make.

A CUDA graph, a fused copy and a compiled copy of the prepared ``f_R`` compute the same function as the eager copy, in
another order or with other kernels, so their scores differ from the eager ones by rounding only. How large rounding
can be depends on the precision and on the network: :func:`copy_tolerance` measures it, as the gap between the eager
copy's scores and the same copy evaluated in float64 (the function both should compute), and allows a copy
:data:`ACCEPT_FACTOR` times that (never less than :data:`ACCEPT_FACTOR` units of rounding of the precision, relative
to the scores' scale). A copy off by a fraction of a percent is refused in float32 (about 10⁴ times its rounding);
a refused copy is not used (the eager copy is always correct).
"""
from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Callable

import torch
import torch.nn as nn

from .._checks import report_fallback
from ..cuda_math import cuda_math

# The unit roundoff of each sampling precision (sampling.PRECISIONS): float32 24 significant bits, TF32 11, bfloat16 8,
# float16 11.
ROUNDING_UNIT = {"float32": 2.0 ** -24, "tf32": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# How many times the eager copy's measured rounding a copy may differ by: another summation order or kernel rounds
# differently but by amounts of the same size (two roundings at most add up; Winograd/FFT convolutions a few times more).
ACCEPT_FACTOR = 16
# Rows of the example batch evaluated in float64 (the rounding of a score does not depend on the batch's size).
REFERENCE_ROWS = 64


def score_gap(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """How far two scorings ``[rows, classes]`` of one batch lie apart, as ``(gap, scale)``: the largest difference
    over every score, where equal values (the same infinity, NaN in both) count as none and a NaN or infinity against
    anything else as an infinite one (an ``f_R`` that scores masked classes −inf is one function, whatever
    ``inf − inf`` says); ``scale`` is one plus the largest finite score of ``want`` in the classes that are not
    constant, which the checks' relative tolerances multiply. A constant class — the same value in every row of both
    scorings, such as a masked class at −1e6 — changes no vote and would otherwise widen the tolerance until a
    difference that does change votes passed."""
    got, want = got.float(), want.float()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    gap = torch.where(same, torch.zeros_like(want), (got - want).abs()).nan_to_num(nan=float("inf"))
    if want.ndim == 2 and want.shape[0]:
        constant = same.all(dim=0) & ((want == want[:1]) | (torch.isnan(want) & torch.isnan(want[:1]))).all(dim=0)
        varying = want[:, ~constant] if not constant.all() else want
    else:
        varying = want
    finite = varying[torch.isfinite(varying)]
    return (float(gap.max()) if gap.numel() else 0.0), (float(finite.abs().max()) if finite.numel() else 0.0) + 1.0


def float64_scores(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """``net``'s scores of ``batch`` computed in float64 (a float64 copy of ``net``; IEEE, no TF32 on CUDA)."""
    with torch.inference_mode(), cuda_math(batch.device, tf32=False):
        return copy.deepcopy(net).double()(batch.double())


def copy_tolerance(net: nn.Module, scores: Callable[[nn.Module, torch.Tensor], torch.Tensor], batch: torch.Tensor,
                   precision: str) -> tuple[float, str]:
    """The largest gap, relative to the scores' scale (:func:`score_gap`), by which a copy of ``net`` may score
    ``batch`` differently from ``scores(net, batch)`` (the engine's eager scores in ``precision``) and still count as
    the same base classifier: :data:`ACCEPT_FACTOR` × the larger of the eager scores' measured gap to float64 and one
    unit of rounding of ``precision``; with how it was found. A ``net`` that cannot compute in float64 (a custom module
    with float32 constants) gets the floor, :data:`ACCEPT_FACTOR` units of rounding."""
    unit = ROUNDING_UNIT[precision]
    rows = batch[:REFERENCE_ROWS]
    try:
        exact = float64_scores(net, rows)
    except RuntimeError as err:  # dtype mismatches inside a custom forward: no float64 reference
        how = f"{ACCEPT_FACTOR} units of {precision} rounding (no float64 reference: {type(err).__name__}: " \
              f"{str(err).strip()[:80]})"
        report_fallback(f"f_R does not run in float64, so a graph, fused or compiled copy of it is held to {how}")
        return ACCEPT_FACTOR * unit, how
    gap, scale = score_gap(scores(net, rows), exact)
    measured = gap / scale
    return ACCEPT_FACTOR * max(measured, unit), f"{ACCEPT_FACTOR} x the eager scores' rounding ({measured:.2g} of " \
                                                f"their scale against float64, at least one {precision} unit)"


class MeasuredTolerances:
    """:func:`copy_tolerance` per plain :class:`~splitz_fast.sampling.choices.Variant` (layout and rows; not fused,
    not compiled: the eager copy the others are checked against), measured the first time a graph, fused or compiled
    copy is checked against it, and kept until :meth:`clear` (``f_R`` changed)."""

    def __init__(self):
        self._measured: dict[Hashable, tuple[float, str]] = {}

    def clear(self) -> None:
        self._measured.clear()

    def lazy(self, key: Hashable, net: Callable[[], nn.Module],
             scores: Callable[[nn.Module, torch.Tensor], torch.Tensor],
             example: Callable[[], torch.Tensor], precision: str) -> Callable[[], float]:
        """The tolerance of ``key`` as a call that measures it when first made: ``copy_tolerance(net(), scores,
        example(), precision)``."""
        def measured() -> float:
            if key not in self._measured:
                self._measured[key] = copy_tolerance(net(), scores, example(), precision)
            return self._measured[key][0]
        return measured

    def records(self) -> dict[Hashable, str]:
        """Each measured tolerance and how it was found, for run records."""
        return {key: f"{value:.3g} ({how})" for key, (value, how) in self._measured.items()}
