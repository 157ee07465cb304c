"""Rows of certification files in Cohen et al.'s format (reading and statistics: :mod:`splitz_fast.analysis`).

A certification TSV starts with exactly Cohen's six columns ``idx label predict radius correct time``; SPLITZ's
columns follow: ``L gamma R_latent pA_lower bound failure_prob``.
"""
from __future__ import annotations

from typing import TextIO

from .smoothing import CertifyResult

COHEN_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time")
SPLITZ_COLUMNS = ("L", "gamma", "R_latent", "pA_lower", "bound", "failure_prob")
HEADER = "\t".join(COHEN_COLUMNS + SPLITZ_COLUMNS)


def format_row(idx: int, label: int, result: CertifyResult) -> str:
    correct = int(result.prediction == label)
    return "\t".join([
        str(idx), str(label), str(result.prediction), f"{result.radius:.6g}", str(correct), f"{result.seconds:.4f}",
        f"{result.lipschitz:.6g}", f"{result.gamma:.6g}", f"{result.latent_radius:.6g}", f"{result.p_a_lower:.6g}",
        result.bound_kind, f"{result.failure_prob:.3g}",
    ])


def write_row(fh: TextIO, idx: int, label: int, result: CertifyResult) -> None:
    """Append one row and flush, so an interrupted run loses nothing already certified."""
    fh.write(format_row(idx, label, result) + "\n")
    fh.flush()


__all__ = ["COHEN_COLUMNS", "SPLITZ_COLUMNS", "HEADER", "format_row", "write_row"]
