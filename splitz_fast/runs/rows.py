"""Rows of certification files in Cohen et al.'s format (reading and statistics: :mod:`splitz_fast.analysis.tables`).

A certification TSV starts with exactly Cohen's six columns ``idx label predict radius correct time``; SPLITZ's
columns follow: ``L gamma R_latent pA_lower bound failure_prob``.
"""
from __future__ import annotations

from typing import TextIO

from ..certify.outcomes import CertifyResult

COHEN_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time")
SPLITZ_COLUMNS = ("L", "gamma", "R_latent", "pA_lower", "bound", "failure_prob")
HEADER = "\t".join(COHEN_COLUMNS + SPLITZ_COLUMNS)


# Six significant digits are at most 5e-6 relative off; nudging by 1e-5 first puts the rounding on the safe side.
_NUDGE = 1e-5


def _never_above(value: float) -> str:
    """Six significant digits, never printing more than ``value`` (nudged down when plain rounding would)."""
    text = f"{value:.6g}"
    return text if not float(text) > value else f"{value * (1 - _NUDGE):.6g}"


def _never_below(value: float) -> str:
    text = f"{value:.6g}"
    return text if not float(text) < value else f"{value * (1 + _NUDGE):.6g}"


def format_row(idx: int, label: int, result: CertifyResult) -> str:
    """One TSV row. The promise in it is never rounded in the user's disfavour: the radius and ``pA_lower`` are never
    printed above their values, ``L`` and ``failure_prob`` never below."""
    correct = int(result.prediction == label)
    return "\t".join([
        str(idx), str(label), str(result.prediction), _never_above(result.radius), str(correct),
        f"{result.seconds:.4f}", _never_below(result.lipschitz), f"{result.gamma:.6g}",
        _never_above(result.latent_radius), _never_above(result.p_a_lower), result.bound_kind,
        _never_below(result.failure_prob),
    ])


def write_row(fh: TextIO, idx: int, label: int, result: CertifyResult) -> None:
    """Append one row and flush, so an interrupted run loses nothing already certified."""
    fh.write(format_row(idx, label, result) + "\n")
    fh.flush()


__all__ = ["COHEN_COLUMNS", "SPLITZ_COLUMNS", "HEADER", "format_row", "write_row"]
