"""Result files in Cohen et al.'s format, and the two headline statistics of a certification run.

A certification TSV starts with exactly Cohen's six columns ``idx label predict radius correct time``; SPLITZ's
columns follow: ``L gamma R_latent pA_lower bound failure_prob``.
"""
from __future__ import annotations

from typing import Iterable, Sequence, TextIO

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


def certified_accuracy(rows: Sequence[tuple[float, int]], radius: float) -> float:
    """``mean(correct ∧ radius_i ≥ r)`` over **all** rows ``(radius_i, correct_i)``; abstentions count as wrong."""
    if not rows:
        raise ValueError("no certification rows to analyze")
    return sum(1 for r, c in rows if c and r >= radius) / len(rows)


def average_certified_radius(rows: Sequence[tuple[float, int]]) -> float:
    """ACR = ``mean(correct · radius)`` over all rows."""
    if not rows:
        raise ValueError("no certification rows to analyze")
    return sum(r * c for r, c in rows) / len(rows)


def markdown_table(named_rows: dict[str, Sequence[tuple[float, int]]], radii: Iterable[float]) -> str:
    """Certified accuracy (%) at each radius and ACR, one line per run."""
    radii = list(radii)
    head = "| run | " + " | ".join(f"r={r:g}" for r in radii) + " | ACR |"
    sep = "|---" * (len(radii) + 2) + "|"
    lines = [head, sep]
    for name, rows in named_rows.items():
        cells = [f"{100 * certified_accuracy(rows, r):.1f}" for r in radii]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {average_certified_radius(rows):.3f} |")
    return "\n".join(lines)


__all__ = ["COHEN_COLUMNS", "SPLITZ_COLUMNS", "HEADER", "format_row", "write_row", "certified_accuracy",
           "average_certified_radius", "markdown_table"]
