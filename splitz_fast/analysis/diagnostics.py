"""What explains a SPLITZ model's certificates: ``L(x, γ*)``, ``p_A`` and the neurons of ``f_L`` constant on the ball.

Scaling ``f_L`` by ``c`` scales both ``L(x, γ)`` and the latent signal by ``c`` while the noise stays σ, so SPLITZ can
only certify more than randomized smoothing at ``σ/L`` through neurons that are constant on the ball ``B(x, γ*)`` —
inactive (pre-activation upper bound ≤ 0) or saturated (lower bound ≥ θ) — which the local bound masks out. This
module measures them at each certified input's ``γ*`` with the certificate's own bounds
(:func:`splitz_fast.bounds.intervals.ball_bounds`, float64 with its rounding margin), next to ``L(x, γ*)`` and ``p_A``'s lower
confidence bound from the certification TSV. For a one-layer ``f_L`` it also reports the spectral flatness
``‖A‖_F² / (n L(x, γ*)²)`` of the masked operator ``A`` on the ball (``n`` the input dimension): 1 when every one of
``A``'s ``n`` singular values reaches the certified bound, small when most directions pass far less signal than ``L``
assumes — latent noise σ acts as noise ``σ / s_j`` along the j-th singular direction while the radius divides by
``L``, so a low flatness is noise the certificate pays for without the signal to match. ``splitz diagnose`` is its
command line.

A run of an estimate protocol (``--protocol paper|published-code``) is diagnosed too, labelled as such everywhere: its
rows are inputs with a positive *estimated* radius, not certified inputs, and its ``L`` is an estimate, not an upper
bound; the spectral flatness is left out there (measured against an estimate it is no longer bounded by 1).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from .._checks import check_output_folder
from ..kinds import ESTIMATES
from .tables import CertificationTable, constant_note
from ..bounds.intervals import BallBounds, ball_bounds, masked_frobenius_sq
from ..model.modules import LeftHalf, SplitModel

__all__ = ["NeuronStates", "neuron_states", "CertificateDiagnostics", "diagnose", "diagnostics_report"]


@dataclass(frozen=True)
class NeuronStates:
    """Per input (``[B]`` float64 fractions over all clipped-ReLU neurons of ``f_L``): neurons inactive on the whole
    ball, saturated at θ on the whole ball, and varying (the local bound's mask). The three add up to 1.
    ``ever_awake`` (``[neurons]`` bool): the neurons not inactive on the ball of at least one input of the batch —
    the others are dead for every input (a switched-off channel: constant, but carrying no signal)."""

    inactive: np.ndarray
    saturated: np.ndarray
    varying: np.ndarray
    ever_awake: np.ndarray


@torch.no_grad()
def neuron_states(left: LeftHalf, x: torch.Tensor, gamma: torch.Tensor | float) -> NeuronStates:
    """How the clipped-ReLU neurons of ``f_L`` behave on ``B(x_b, γ_b)`` for a batch ``x`` (certificate bounds)."""
    return _states(left, ball_bounds(left, x, gamma))


def _states(left: LeftHalf, bounds: BallBounds) -> NeuronStates:
    inactive = saturated = varying = total = 0
    awake = []
    for k, (lower, upper, mask) in enumerate(zip(bounds.lower, bounds.upper, bounds.masks)):
        act = left.activation(k)
        if act is None:
            continue
        theta = act.broadcast_threshold(lower).to(lower.dtype)
        dead = (upper <= 0).flatten(1)
        stuck = ((lower >= theta) & (upper > 0)).flatten(1)
        inactive = inactive + dead.sum(1)
        saturated = saturated + stuck.sum(1)
        varying = varying + mask.flatten(1).sum(1)
        awake.append((~dead).any(0))
        total += dead.shape[1]
    if total == 0:
        raise ValueError("f_L has no clipped-ReLU neurons (split 0, or no activations): nothing to diagnose")
    as_fraction = lambda count: (count.double() / total).cpu().numpy()  # noqa: E731
    return NeuronStates(as_fraction(inactive), as_fraction(saturated), as_fraction(varying),
                        torch.cat(awake).cpu().numpy())


@dataclass(frozen=True)
class CertificateDiagnostics:
    """One row per certified input (correct, radius > 0): its ``idx``, ``L(x, γ*)``, ``γ*``, ``p_A``'s lower bound,
    the neuron states at ``γ*`` and, for a one-layer ``f_L``, the spectral flatness ``‖A‖_F² / (n L(x, γ*)²)`` of the
    masked operator on ``B(x, γ*)`` (``None`` for deeper ``f_L``). ``estimate``: the rows come from an estimate
    protocol's run — inputs with a positive estimated radius, ``lipschitz`` an estimate, no flatness."""

    idx: np.ndarray
    lipschitz: np.ndarray
    gamma: np.ndarray
    p_a_lower: np.ndarray
    states: NeuronStates
    flatness: np.ndarray | None = None
    estimate: bool = False
    constant: str | None = None  # analysis.constant_note of the run: its smoothed classifier is (nearly) constant


def diagnose(model: SplitModel, dataset: Dataset, table: CertificationTable, batch: int = 64, *,
             progress: bool = False) -> CertificateDiagnostics:
    """Diagnostics of the certified rows of ``table`` (written by ``splitz certify`` for ``model`` on ``dataset``);
    ``progress``: a progress bar on stderr (the command line's)."""
    for column in ("L", "gamma", "pA_lower"):
        if column not in table.extra:
            raise ValueError(f"the certification file has no {column!r} column: it is not a SPLITZ certify TSV")
    keep = table.correct & (table.radius > 0)
    idx = table.idx[keep]
    gamma = np.asarray(table.extra["gamma"], dtype=np.float64)[keep]
    if idx.size == 0:
        raise ValueError("no input was certified with a positive radius: nothing to diagnose")
    device = next(model.parameters()).device
    lipschitz = np.asarray(table.extra["L"], dtype=np.float64)[keep]
    left = model.left
    parts, frobenius2 = [], []
    with torch.no_grad(), tqdm(total=int(idx.size), desc="diagnose", unit="img", file=sys.stderr,
                               disable=not progress) as bar:
        for start in range(0, idx.size, batch):
            chunk = idx[start:start + batch]
            x = torch.stack([dataset[int(i)][0] for i in chunk]).to(device)
            g = torch.as_tensor(gamma[start:start + batch], dtype=torch.float64, device=device)
            bounds = ball_bounds(left, x, g)
            parts.append(_states(left, bounds))
            if left.depth == 1:
                frobenius2.append(masked_frobenius_sq(left.layers[0], bounds.masks[0], bounds.input_scale,
                                                      tuple(x.shape[1:])).double().cpu().numpy())
            bar.update(len(chunk))
    states = NeuronStates(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("inactive", "saturated",
                                                                                        "varying")),
                          np.logical_or.reduce([p.ever_awake for p in parts]))
    flatness = None
    if frobenius2 and not table.is_estimate:
        n = x[0].numel()  # the input dimension
        flatness = np.concatenate(frobenius2) / (n * np.square(lipschitz))
    return CertificateDiagnostics(idx=idx, lipschitz=lipschitz, gamma=gamma,
                                  p_a_lower=np.asarray(table.extra["pA_lower"], dtype=np.float64)[keep],
                                  states=states, flatness=flatness, estimate=table.is_estimate,
                                  constant=constant_note(table))


_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


def diagnostics_report(diag: CertificateDiagnostics, title: str, out_dir: str | os.PathLike | None = None) -> str:
    """Markdown: quantiles of each quantity over the certified inputs; with ``out_dir``, ``diagnostics.md``, the rows
    as ``diagnostics.tsv`` and histograms of ``L(x, γ*)`` and the constant fraction (``diagnostics.png``/``.pdf``)."""
    if out_dir is not None:
        check_output_folder("output folder", out_dir)
    constant = diag.states.inactive + diag.states.saturated
    words = _Words.of(diag)
    columns = {words.lipschitz: diag.lipschitz, "γ*": diag.gamma, "p_A lower bound": diag.p_a_lower,
               "constant neurons (%)": 100 * constant, "inactive (%)": 100 * diag.states.inactive,
               "saturated at θ (%)": 100 * diag.states.saturated}
    if diag.flatness is not None:
        columns["spectral flatness ‖A‖_F²/(n L²)"] = diag.flatness
    head = "| quantity | " + " | ".join("min" if q == 0 else "max" if q == 1 else f"q{int(100 * q)}"
                                        for q in _QUANTILES) + " | mean |"
    dead = 100 * (1 - diag.states.ever_awake.mean())
    lines = [f"{title}: {diag.idx.size} {words.inputs} (correct, radius > 0).{words.warning} {dead:.1f} % of f_L's "
             "neurons are inactive on the ball of every one of them (dead: constant, but carrying no signal to f_R; "
             "the constant neurons that buy radius are the others)." + (
                 f" DEGENERATE: the smoothed classifier {diag.constant}; a constant classifier is certifiably robust "
                 "everywhere, so these radii say nothing about robustness." if diag.constant else ""), "",
             head, "|---" + "|---:" * (len(_QUANTILES) + 1) + "|"]
    for name, values in columns.items():
        cells = [f"{v:.4g}" for v in np.quantile(values, _QUANTILES)] + [f"{values.mean():.4g}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diagnostics.md").write_text(text, encoding="utf-8")
        flat = diag.flatness is not None
        rows = [f"idx\t{words.lipschitz_column}\tgamma\tpA_lower\tinactive\tsaturated\tvarying"
                + ("\tflatness" if flat else "")]
        rows += [f"{i}\t{l:.6g}\t{g:.6g}\t{p:.6g}\t{a:.6g}\t{s:.6g}\t{v:.6g}" + (f"\t{f:.6g}" if flat else "")
                 for i, l, g, p, a, s, v, f in zip(
                     diag.idx, diag.lipschitz, diag.gamma, diag.p_a_lower, diag.states.inactive,
                     diag.states.saturated, diag.states.varying,
                     diag.flatness if flat else np.zeros_like(diag.lipschitz))]
        (out / "diagnostics.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
        _plot(diag, constant, title, words, out / "diagnostics")
    return text


@dataclass(frozen=True)
class _Words:
    """How the report names its rows and ``L``: certified inputs and a proven bound, or an estimate run's."""

    inputs: str
    lipschitz: str
    lipschitz_column: str
    warning: str

    @classmethod
    def of(cls, diag: CertificateDiagnostics) -> "_Words":
        if not diag.estimate:
            return cls("certified inputs", "L(x, γ*)", "L", "")
        return cls("inputs with a positive estimated radius", "estimated L(x, γ*) (not an upper bound)",
                   "L_estimate", " ESTIMATES, NOT CERTIFICATES: the run's protocol estimates L, so none of these "
                   "radii is certified and no spectral flatness is reported.")


def _plot(diag: CertificateDiagnostics, constant: np.ndarray, title: str, words: _Words, stem: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.hist(diag.lipschitz, bins=30)
    left.set_xlabel(words.lipschitz)
    left.set_ylabel(words.inputs)
    right.hist(100 * constant, bins=30)
    right.set_xlabel("neurons of f_L constant on B(x, γ*) (%)")
    for ax in (left, right):  # at most 6 ticks: matplotlib's default 9 collide where the labels are long (L ≥ 10⁵)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    fig.suptitle(f"{title} ({ESTIMATES})" if diag.estimate else title)
    fig.savefig(stem.with_name(stem.name + ".png"), dpi=150)
    fig.savefig(stem.with_name(stem.name + ".pdf"), metadata={"CreationDate": None})

