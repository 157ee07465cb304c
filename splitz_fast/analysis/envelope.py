"""Best-σ envelopes: how randomized-smoothing papers compare methods, and how SPLITZ must be compared with RS.

A smoothed classifier's σ trades clean accuracy for radius, so the field reports, at each radius ``r``, the best
certified accuracy over the σ values trained — the *envelope* ``E(r) = max_σ CA_σ(r)`` — and which σ reached it.
:func:`envelope_report` puts the envelopes of several methods (each a group of certification TSVs, one per σ) side by
side with published reference lines, the same-σ differences between the first two groups, every run's own line, and
a plot; ``splitz envelope`` is its command line.

σ of each run is read from its certification sidecar (``OUTFILE.json``, written by ``splitz certify``), never guessed
from a file name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .._checks import check_output_folder, read_settings_file
from ..kinds import NOT_A_CERTIFICATE
from .plots import certified_accuracy_curve, run_protocol
from .tables import (CertificationTable, acr, certified_accuracy, constant_note, input_sets, labelled, markdown_table,
                     read_certification, unfinished_note)

__all__ = ["Reference", "MNIST_REFERENCES", "SigmaRuns", "envelope", "load_group", "envelope_report"]


@dataclass(frozen=True)
class Reference:
    """A published certified-accuracy line: ``accuracy`` (%) at some radii, with where the numbers come from."""

    name: str
    source: str
    accuracy: Mapping[float, float]


#: Published MNIST certified-accuracy lines from the randomized-smoothing literature (LeNet, n = 10⁵, α = 0.001, the
#: full MNIST test set); each ``source`` says where its numbers come from.
MNIST_REFERENCES = (
    Reference("literature: RS envelope (Cohen-style Gaussian augmentation)",
              "public certification logs of Cohen et al.-style training, σ = 0.5 at ε = 1.5 and σ = 1.0 beyond",
              {1.5: 67.8, 2.0: 32.5, 2.5: 10.9}),
    Reference("literature: best trained RS (SmoothAdv + consistency, SmoothMix)",
              "the best published trained RS variants at σ ≤ 1.0", {1.5: 82.0, 2.0: 45.0, 2.5: 30.0}),
)

#: σ -> the certification table of the model trained and certified at that σ.
SigmaRuns = Mapping[float, CertificationTable]


def _sigma_of(path: Path) -> float:
    sidecar = Path(os.fspath(path) + ".json")
    try:
        settings = read_settings_file(sidecar)
    except ValueError as err:
        raise ValueError(f"{path}: its sidecar {err}; the envelope needs the one `splitz certify` wrote (it records "
                         "the run's σ)") from None
    try:
        return float(settings["sigma"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: its sidecar {sidecar} records no sigma; the envelope needs each run's σ") from None


def load_group(paths: Sequence[str | os.PathLike], name: str = "the group") -> dict[float, CertificationTable]:
    """``{σ: table}`` of certification TSVs, σ from each sidecar; two files of the same σ are an error, and so is a
    group that mixes certificates with estimates or runs over different inputs (:func:`envelope_report` refuses such
    groups too); ``name`` is how errors call the group."""
    runs: dict[float, CertificationTable] = {}
    for path in map(Path, paths):
        table = read_certification(path)  # first: a missing TSV is named as such, not as a missing sidecar
        sigma = _sigma_of(path)
        if sigma in runs:
            raise ValueError(f"two runs of σ = {sigma:g} in {name} ({path} is the second); give one per σ")
        runs[sigma] = table
    if not runs:
        raise ValueError(f"{name} needs at least one certification file")
    _check_group(name, runs)
    return dict(sorted(runs.items()))


def _run_name(sigma: float, table: CertificationTable) -> str:
    return f"σ={sigma:g}" + (f" ({table.path})" if table.path else "")


def _check_group(name: str, runs: SigmaRuns) -> None:
    """Refuse a group that mixes certificates with estimates (``--protocol paper|published-code``): its envelope would
    pass estimates off as certified wherever an estimate run reaches the maximum. Refuse a group whose runs hold
    different inputs (their ``idx`` sets): ``max_σ CA_σ(r)`` would then take each σ's accuracy on other inputs (a
    20-input σ = 0.75 run against a 6-input σ = 0.5 one), which is no envelope of one test set."""
    estimates = [_run_name(sigma, table) for sigma, table in runs.items() if table.is_estimate]
    if estimates and len(estimates) < len(runs):
        raise ValueError(f"{name} mixes certificates with estimates ({', '.join(estimates)}: {NOT_A_CERTIFICATE}); "
                         "give the estimates a group of their own")
    if len(input_sets(runs)) > 1:
        counts = "; ".join(f"{_run_name(sigma, table)}: {len(table)} inputs" for sigma, table in runs.items())
        raise ValueError(f"{name} mixes runs over different inputs ({counts}); a best-σ envelope takes every σ on the "
                         "same inputs: certify each σ with the same --split, --skip and --max (and let every run "
                         "finish)")


def _group_label(name: str, runs: SigmaRuns) -> str:
    """The group's name, marked when its runs are estimates, not certificates (a (nearly) constant run is marked
    where its values enter the envelope, :func:`_envelope_rows`)."""
    return f"{name} ({NOT_A_CERTIFICATE})" if next(iter(runs.values())).is_estimate else name


def envelope(runs: SigmaRuns, radii: Sequence[float]) -> tuple[np.ndarray, list[float]]:
    """``(E, argmax)``: the best certified accuracy over σ at each radius (fractions) and the σ reaching it (the
    smallest σ on ties)."""
    sigmas = sorted(runs)
    if not sigmas:
        raise ValueError("no runs for an envelope")
    _check_group("the runs", runs)
    table = np.stack([np.atleast_1d(certified_accuracy(runs[s], radii)) for s in sigmas])  # [σ, radius]
    best = table.argmax(axis=0)  # first maximum: the smallest σ
    return table.max(axis=0), [sigmas[i] for i in best]


def _envelope_rows(groups: Mapping[str, SigmaRuns], radii: Sequence[float],
                   references: Sequence[Reference]) -> list[str]:
    head = "| | " + " | ".join(f"ε={r:g}" for r in radii) + " |"
    lines = [head, "|---" + "|---:" * len(radii) + "|"]
    constant: list[str] = []
    unfinished: list[str] = []
    for name, runs in groups.items():
        values, sigmas = envelope(runs, radii)
        notes = {sigma: constant_note(table) for sigma, table in runs.items()}
        stopped = {sigma: unfinished_note(table) for sigma, table in runs.items()}
        cells = [f"{100 * v:.1f} (σ={s:g})" + ("*" if notes[s] else "") + ("†" if stopped[s] else "")
                 for v, s in zip(values, sigmas)]
        lines.append(f"| {_group_label(name, runs)} envelope | " + " | ".join(cells) + " |")
        constant += [f"{name} σ={sigma:g} {note}" for sigma, note in notes.items() if note and sigma in sigmas]
        unfinished += [f"{name} σ={sigma:g} {note}" for sigma, note in stopped.items() if note and sigma in sigmas]
    for ref in references:
        cells = [f"{ref.accuracy[r]:.1f}" if r in ref.accuracy else "—" for r in radii]
        lines.append(f"| {ref.name} | " + " | ".join(cells) + " |")
    if constant:
        lines += ["", "\\* from a run whose smoothed classifier is (nearly) constant — certifiably robust, but not a "
                  f"classifier anyone wants: {'; '.join(constant)}."]
    if unfinished:
        lines += ["", f"† from a run that stopped before its end (its inputs so far): {'; '.join(unfinished)}."]
    held = {name: next(iter(runs.values())) for name, runs in groups.items()}  # a group's runs hold the same inputs
    if len(input_sets(held)) > 1:
        counts = "; ".join(f"{name}: {len(table)} inputs" for name, table in held.items())
        lines += ["", f"The groups hold different inputs ({counts}): their envelopes are not of the same test set."]
    return lines


def _same_sigma_rows(groups: Mapping[str, SigmaRuns], radii: Sequence[float]) -> list[str]:
    (first, a), (second, b) = list(groups.items())[:2]
    shared = sorted(set(a) & set(b))
    if not shared:
        return [f"No σ was run by both {first} and {second}."]
    lines = ["| σ | " + " | ".join(f"ε={r:g}" for r in radii) + " | ACR |", "|---" + "|---:" * (len(radii) + 1) + "|"]
    for sigma in shared:
        if set(a[sigma].idx.tolist()) != set(b[sigma].idx.tolist()):  # a difference of two samples' statistics
            lines.append(f"| {sigma:g} | not compared: the runs hold different inputs ({len(a[sigma])} and "
                         f"{len(b[sigma])} rows) |" + " |" * len(radii))
            continue
        diff = 100 * (np.atleast_1d(certified_accuracy(b[sigma], radii))
                      - np.atleast_1d(certified_accuracy(a[sigma], radii)))
        cells = [f"{d:+.1f}" for d in diff] + [f"{acr(b[sigma]) - acr(a[sigma]):+.3f}"]
        lines.append(f"| {sigma:g} | " + " | ".join(cells) + " |")
    return lines


#: Line styles telling a group's σ apart in the plot and its legend (dotted, dash-dotted, dashed, ...).
_SIGMA_DASHES = [(0, (1, 1)), (0, (4, 1, 1, 1)), (0, (6, 2)), (0, (1, 3)), (0, (4, 1, 1, 1, 1, 1)), (0, (10, 3))]


def _plot_protocol(groups: Mapping[str, SigmaRuns]) -> str:
    """The runs' n, α and number of inputs (:func:`~splitz_fast.analysis.plots.run_protocol`): one for all, or each
    group's (its σ share their inputs, :func:`_check_group`; n or α may differ)."""
    protocols = {name: {run_protocol(table) for table in runs.values()} for name, runs in groups.items()}
    if len(set().union(*protocols.values())) == 1:
        return next(iter(protocols[next(iter(protocols))]))
    return "\n".join(f"{name}: {' / '.join(sorted(found))}" for name, found in protocols.items())


def _plot(groups: Mapping[str, SigmaRuns], references: Sequence[Reference], stem: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    largest = max(float(np.max(t.radius, initial=0.0)) for runs in groups.values() for t in runs.values())
    max_radius = max(1.05 * largest, max((r for ref in references for r in ref.accuracy), default=0.0) + 0.25, 1.0)
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, runs in groups.items():
        # One grid for the group: the uniform one plus every run's drop points (so the maximum is exact).
        grid = np.unique(np.concatenate([certified_accuracy_curve(t, max_radius)[0] for t in runs.values()]))
        curves = np.stack([np.atleast_1d(certified_accuracy(t, grid)) for t in runs.values()])
        style = "--" if next(iter(runs.values())).is_estimate else "-"  # estimates dashed
        line, = ax.step(grid, 100 * curves.max(axis=0), where="pre", linewidth=2, linestyle=style,
                        label=f"{_group_label(name, runs)} envelope")
        for sigma, accuracy, dashes in zip(runs, curves, _SIGMA_DASHES * len(runs)):  # each σ thin, its own dashes
            ax.step(grid, 100 * accuracy, where="pre", linewidth=0.8, alpha=0.6, color=line.get_color(),
                    linestyle=dashes, label=f"{name} σ = {sigma:g}")
    for marker, ref in zip("so^v", references):
        radii = sorted(ref.accuracy)
        ax.plot(radii, [ref.accuracy[r] for r in radii], marker=marker, linestyle=":", color="black",
                label=ref.name)
    ax.set_xlim(0.0, max_radius)
    ax.set_ylim(0.0, 100.0)
    ax.set_xlabel("radius ε (l2, input units)")
    ax.set_ylabel("certified accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"best-σ envelope\n{_plot_protocol(groups)}", fontsize="medium")
    fig.savefig(stem.with_name(stem.name + ".png"), dpi=150)
    fig.savefig(stem.with_name(stem.name + ".pdf"), metadata={"CreationDate": None})


def envelope_report(groups: Mapping[str, SigmaRuns], radii: Sequence[float],
                    references: Sequence[Reference] = (), out_dir: str | os.PathLike | None = None) -> str:
    """Markdown: the envelopes with the σ reaching each value and the reference lines; with two or more groups the
    same-σ differences (second − first, points of certified accuracy and ACR); every run's own line. With
    ``out_dir``: ``envelope.md`` and ``envelope.png``/``.pdf`` (envelopes thick, each σ thin, references dotted)."""
    if out_dir is not None:
        check_output_folder("output folder", out_dir)
    if not groups:
        raise ValueError("no groups of runs to compare")
    for name, runs in groups.items():
        if not runs:
            raise ValueError(f"group {name} has no runs")
        _check_group(f"group {name}", runs)
    radii = [float(r) for r in radii]
    parts = ["Best-σ envelope: certified accuracy (%) at each ε, the σ reaching it in parentheses.", "",
             *_envelope_rows(groups, radii, references), ""]
    if len(groups) >= 2:
        first, second = list(groups)[:2]
        parts += [f"Same σ: {second} − {first} (points of certified accuracy; ACR in input units).", "",
                  *_same_sigma_rows(groups, radii), ""]
    per_run = {labelled(f"{name} σ={sigma:g}", table): table for name, runs in groups.items()
               for sigma, table in runs.items()}
    parts += ["Every run.", "", markdown_table(per_run, radii)]
    if references:
        parts += ["References: " + "; ".join(f"{ref.name}: {ref.source}" for ref in references) + "."]
    text = "\n".join(parts) + "\n"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "envelope.md").write_text(text, encoding="utf-8")
        _plot(groups, references, out / "envelope")
    return text
