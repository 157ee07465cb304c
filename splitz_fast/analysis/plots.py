"""Certified-accuracy plots of certification runs, and :func:`analyze`, the entry point behind ``splitz analyze``: it
reads several files and returns (and optionally writes) a markdown table, a LaTeX (booktabs) table and
certified-accuracy plots (the files, statistics and tables: :mod:`splitz_fast.analysis.tables`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from .._checks import check_output_folder
from .tables import (CertificationTable, PathLike, RunsArg, _check_named, _sidecar_settings, acr, certified_accuracy,
                     latex_table, load_runs, markdown_table, summary_markdown_table)

# --------------------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------------------

def certified_accuracy_curve(table: CertificationTable, max_radius: float, points: int = 1000
                             ) -> tuple[np.ndarray, np.ndarray]:
    """``(radii, accuracy)`` on ``[0, max_radius]``: a uniform grid of ``points`` radii plus each correct row's
    radius (sorted, no repeats).

    Certified accuracy is non-increasing and drops just *after* each row's radius (``radius_i ≥ r`` still
    holds at ``r = radius_i``); including those radii in the grid and drawing with ``step(where="pre")`` shows
    the drops at their exact positions.
    """
    grid = np.linspace(0.0, max_radius, points)
    certified = table.radius[table.correct]
    grid = np.union1d(grid, certified[certified <= max_radius])
    return grid, np.asarray(certified_accuracy(table, grid))


def run_protocol(table: CertificationTable) -> str:
    """How a run was sampled, for captions: ``"n = 10,000, α = 0.001, 30 inputs"``, read from the sidecar
    ``OUTFILE.json`` that ``splitz certify`` writes beside the TSV (the number of inputs is the file's rows). Margin
    certificates say that they draw no samples; without a sidecar (Cohen's files, tables built in memory) n and α are
    "not recorded"."""
    inputs = f"{len(table)} input{'s' * (len(table) != 1)}"
    settings = _sidecar_settings(table.path)
    if not {"n", "alpha"} <= set(settings):
        return f"n, α not recorded, {inputs}"
    if settings.get("certifier") == "margin":
        return f"margin certificates (no sampling), {inputs}"
    n = f"budget n = {settings['n']:,}" if settings.get("sequential") else f"n = {settings['n']:,}"
    return f"{n}, α = {settings['alpha']:g}, {inputs}"


def _caption(named_tables: Sequence[tuple[str, CertificationTable]]) -> tuple[str, dict[str, str]]:
    """``(title line, {run: legend suffix})``: the shared sampling protocol in the title, or, when the runs differ,
    a title that says so and each run's protocol in its legend entry."""
    protocols = {name: run_protocol(table) for name, table in named_tables}
    if len(set(protocols.values())) == 1:
        return next(iter(protocols.values())), {name: "" for name in protocols}
    return "runs differ in n, α or inputs (see legend)", {name: f"; {p}" for name, p in protocols.items()}


def plot_certified_accuracy(named_tables: Mapping[str, CertificationTable], out_path_stem: PathLike,
                            max_radius: float | None = None, title: str | None = None) -> list[Path]:
    """Plot certified accuracy (%) against l2 radius (input units), one line per run; save PNG and PDF.

    Args:
        named_tables: run name (legend label) -> table.
        out_path_stem: output path without suffix; writes ``<stem>.png`` and ``<stem>.pdf`` (parent folders
            are created).
        max_radius: right end of the radius axis; default 5 % beyond the largest certified radius of any run
            (1.0 when no run certifies a positive radius).
        title: optional figure title, put above the caption line: the runs' n, α and number of inputs
            (:func:`run_protocol`, from each TSV's sidecar), or, when they differ, a note and each run's in the legend.

    Returns:
        ``[png_path, pdf_path]``.

    Uses ``matplotlib.figure.Figure`` with the Agg canvas directly, so neither pyplot nor the user's selected
    backend is touched. Needs matplotlib (``pip install matplotlib``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from err

    items = _check_named(named_tables)
    if max_radius is None:
        largest = max(float(np.max(table.radius, initial=0.0)) for _, table in items)
        max_radius = 1.05 * largest if largest > 0 else 1.0
    if not (math.isfinite(max_radius) and max_radius > 0):
        raise ValueError(f"max_radius must be finite and > 0, got {max_radius!r}")

    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    caption, legend = _caption(items)
    for name, table in items:
        grid, accuracy = certified_accuracy_curve(table, max_radius)
        ax.step(grid, 100 * accuracy, where="pre", label=f"{name} (ACR {acr(table):.3f}{legend[name]})",
                linestyle="--" if table.is_estimate else "-")  # estimates: dashed, and named so by load_runs
    ax.set_xlim(0.0, max_radius)
    ax.set_ylim(0.0, 100.0)
    ax.set_xlabel("radius (l2, input units)")
    ax.set_ylabel("certified accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize="small" if any(legend.values()) else None)
    ax.set_title(f"{title}\n{caption}" if title else caption, fontsize="medium")

    stem = Path(out_path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")
    fig.savefig(png, dpi=150)
    fig.savefig(pdf, metadata={"CreationDate": None})  # no timestamp: same input, same bytes
    return [png, pdf]


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------

def analyze(paths_or_named: RunsArg, radii: Iterable[float], out_dir: PathLike | None = None,
            title: str | None = None) -> str:
    """Compare certification runs: returns markdown (certified-accuracy table, then a summary table).

    Args:
        paths_or_named: result TSV paths (runs named by file stem), or a mapping run name -> path or
            :class:`CertificationTable`.
        radii: l2 radii in input units at which to report certified accuracy.
        out_dir: when given (created if needed), writes ``table.md`` (the returned text), ``table.tex``
            (:func:`latex_table`) and ``certified_accuracy.png`` / ``.pdf`` (:func:`plot_certified_accuracy`).
        title: optional plot title.
    """
    if out_dir is not None:  # before reading anything, so a bad folder costs nothing and writes nothing
        check_output_folder("output folder", out_dir)
    radii = [float(r) for r in radii]
    runs = load_runs(paths_or_named)
    text = markdown_table(runs, radii) + "\n" + summary_markdown_table(runs)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(text, encoding="utf-8")
        (out / "table.tex").write_text(latex_table(runs, radii), encoding="utf-8")
        plot_certified_accuracy(runs, out / "certified_accuracy", title=title)
    return text


__all__ = ["analyze", "certified_accuracy_curve", "plot_certified_accuracy", "run_protocol"]
