"""How much room a SPLITZ model has above randomized smoothing, per input: the proposition of docs/splitz-vs-rs.md.

``f_L`` is piecewise affine; on the cell ``C(x)`` (the inputs with ``x``'s activation pattern) ``f_L(x') = A x' + c``.
With ``L̄`` the library's global bound (``L̄ ≥ ‖A_C‖`` for every cell) and ``s = σ/L̄``, the randomized base classifier
``F(x') = f_R(f_L(x') + η)``, ``η ~ N(0, σ²I − s²AAᵀ)``, smoothed at input noise ``s``, has every class probability
within ``e_s(x) = P(x + N(0, s²I) ∉ C(x))`` of SPLITZ's latent probabilities. So randomized smoothing (Cohen et al.;
valid for a randomized base classifier) certifies ``s·Φ⁻¹(p_lower − e_s)`` on ``F`` from SPLITZ's own votes, while
SPLITZ certifies at most ``σ Φ⁻¹(p_lower) / L(x, 0⁺)`` (its radius divides by ``L(x, γ*)``, and the library's bound
is computed on masks that only grow with γ). :func:`headroom` measures both, with

* **the exit bound** ``e_s(x) ≤ Σ_faces Φ(−dist/s)``: the cell is the set where every neuron keeps its state
  (inactive ``z ≤ 0``, active, saturated ``z ≥ θ``); given the states of the layers before it, a neuron's
  pre-activation is an affine function ``a_i·x' + b_i`` of the input, so the cell is an intersection of half-spaces,
  and ``x + δ`` leaves it only if ``a_i·δ`` crosses one of its faces ``a_i·x' + b_i = t`` (``t`` ∈ {0, θ}, the faces
  of the neuron's current state: 0 for an inactive neuron, θ for a saturated one, both for an active one). ``a_i·δ``
  is ``N(0, s²‖a_i‖²)``, so crossing that face has probability ``Φ(−dist/s)`` with ``dist = |a_i·x + b_i − t|/‖a_i‖``
  the l2 distance from ``x`` to the face; the union bound over faces gives the sum. First layer: ``a_i = w_i D``
  (``1/sd`` folded in), its norm over the filter taps inside the image (border-aware), so ``dist`` is exact. Deeper
  layer ``k``: ``‖a_i‖ ≤ ‖w_{k,i}‖₂ · Π_{j<k} ‖W_j‖`` (activity diagonals have norm ≤ 1; the product is the library's
  global bound of the first ``k − 1`` layers), a sound *lower* bound on ``dist``. Every ``|z − t|`` is reduced by the
  certificate's rounding margin (``ROUNDING_MARGIN`` times the magnitude of the sum that formed ``z``), so rounding
  never shortens a distance's bound. A max-pool inside ``f_L`` adds argmax faces this bound does not count: refused.
* **the Jacobian ratio** ``L̄ / L(x, 0⁺)``: SPLITZ's best case over RS on ``F`` at equal ``p_lower`` (∞ on a constant
  cell, where ``L(x, 0⁺) = 0`` and SPLITZ's radius is bounded by nothing here).

An input is one where SPLITZ *can beat RS at ε* when it is correctly classified, SPLITZ's best case reaches ε and RS on
``F`` does not. Where none can, SPLITZ's certified accuracy at ε is at most RS's on ``F``. ``splitz diagnose
--headroom`` is the command line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.stats import norm
from torch.utils.data import Dataset

from .._checks import check_output_folder, check_positive
from ..bounds.intervals import GAMMA_FLOOR, ROUNDING_MARGIN, affine, bias_magnitude, first_layer_row_norms, \
    input_scale, linear_part
from ..bounds.lipschitz import global_lipschitz_bound, lipschitz_bound
from ..model.modules import LeftHalf, SplitModel
from .tables import CertificationTable

__all__ = ["Headroom", "face_distances", "headroom", "headroom_of_run", "headroom_report"]

DEFAULT_HEADROOM_RADII = (0.5, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class Headroom:
    """Per input (``[B]`` arrays, ``[B, R]`` for the radii ``radii``): the bound on the exit probability ``e_s``, the
    number of faces within each radius (deeper layers: faces whose distance *bound* is within it, so at least the
    true count's faces are counted), ``L̄``, ``L(x, 0⁺)``, the radius RS certifies on ``F`` and SPLITZ's best case."""

    sigma: float
    radii: np.ndarray
    idx: np.ndarray
    correct: np.ndarray
    p_lower: np.ndarray
    exit_bound: np.ndarray
    faces_within: np.ndarray
    global_lipschitz: float
    local_lipschitz: np.ndarray
    rs_radius: np.ndarray
    splitz_radius_max: np.ndarray
    bound_kinds: str

    @property
    def input_sigma(self) -> float:
        """``s = σ / L̄``: the input noise RS uses on ``F``."""
        return self.sigma / self.global_lipschitz

    @property
    def jacobian_ratio(self) -> np.ndarray:
        """``L̄ / L(x, 0⁺)`` (∞ on a constant cell)."""
        with np.errstate(divide="ignore"):
            return np.where(self.local_lipschitz > 0, self.global_lipschitz / self.local_lipschitz, np.inf)

    def can_beat(self) -> np.ndarray:
        """``[B, R]`` bool: correct, SPLITZ's best case ≥ ε and RS on ``F`` < ε."""
        eps = self.radii[None, :]
        return self.correct[:, None] & (self.splitz_radius_max[:, None] >= eps) & (self.rs_radius[:, None] < eps)


def _no_pools(left: LeftHalf) -> None:
    if any(left.pool(k) is not None for k in range(left.depth)):
        raise ValueError("headroom: f_L has a max-pool between its layers, whose argmax faces the exit bound does not "
                         "count; split before the pool")


def _prefix_norms(left: LeftHalf, input_shape: tuple[int, ...]) -> list[float]:
    """``Π_{j<k} ‖W_j‖`` (the library's global bound of the first ``k`` layers) for every layer ``k ≥ 1``."""
    norms = [1.0]
    for k in range(1, left.depth):
        prefix = LeftHalf(left.layers[:k], [left.activation(j) for j in range(k)], left.standardize, input_shape)
        norms.append(float(global_lipschitz_bound(prefix, input_shape).value[0]))
    return norms


def _layer_faces(z: torch.Tensor, theta: torch.Tensor, slack: torch.Tensor, row_norm: torch.Tensor) -> torch.Tensor:
    """``[B, 2·neurons]`` distance bounds to the faces of each neuron's current state (∞ where a face is not one of
    its cell: the θ face of an inactive neuron, the 0 face of a saturated one; both where θ = 0 or the row is 0,
    a constant neuron)."""
    inf = torch.full_like(z, torch.inf)
    live = (theta > 0) & (row_norm > 0)
    to_zero = torch.where(live & (z < theta), (z.abs() - slack).clamp_min(0), inf)
    to_theta = torch.where(live & (z > 0), ((z - theta).abs() - slack).clamp_min(0), inf)
    scale = torch.where(row_norm > 0, row_norm * (1 + 1e-12), torch.ones_like(row_norm))
    return torch.cat([(to_zero / scale).flatten(1), (to_theta / scale).flatten(1)], 1)


@torch.no_grad()
def face_distances(left: LeftHalf, x: torch.Tensor, prefix_norms: list[float] | None = None) -> torch.Tensor:
    """``[B, faces]`` float64 lower bounds on the l2 distance from each input of ``x: [B, *input_shape]`` to the faces
    of its cell (two slots per clipped-ReLU neuron, ∞ where a slot is no face; see the module docstring). A layer
    without activation has no faces; an identity ``f_L`` (split 0) has none at all (``[B, 0]``)."""
    _no_pools(left)
    x64 = x.detach().to(torch.float64)
    prefix_norms = _prefix_norms(left, tuple(x.shape[1:])) if prefix_norms is None else prefix_norms
    h = x64
    if left.standardize is not None:
        mean, std = left.standardize.per_element(x64)
        h = (x64 - mean.to(torch.float64)) / std.to(torch.float64)
    faces = [x64.new_zeros(x64.shape[0], 0)]
    for k, layer in enumerate(left.layers):
        h = left.layer_input(layer, h)
        z = affine(layer, h)
        act = left.activation(k)
        if act is not None:
            theta = act.broadcast_threshold(z).to(torch.float64)
            abs_w = layer.weight.detach().to(torch.float64).abs()
            slack = ROUNDING_MARGIN * (linear_part(layer, h.abs(), weight=abs_w) + bias_magnitude(layer, z) + theta)
            if k == 0:
                rows = first_layer_row_norms(layer, input_scale(left, x64), x64)
            else:
                ones = torch.ones_like(h[:1])
                rows = linear_part(layer, ones, weight=abs_w.square()).clamp_min(0).sqrt() * prefix_norms[k]
            faces.append(_layer_faces(z, theta, slack, rows.expand_as(z)))
            z = torch.minimum(z.clamp_min(0), theta)
        h = z
    return torch.cat(faces, 1)


def headroom(left: LeftHalf, x: torch.Tensor, sigma: float, p_lower: np.ndarray, correct: np.ndarray,
             radii=DEFAULT_HEADROOM_RADII, idx: np.ndarray | None = None, batch: int = 64) -> Headroom:
    """The headroom of SPLITZ over RS on ``F`` for the inputs ``x: [B, *input_shape]`` (raw input units) certified at
    latent noise ``sigma`` with lower confidence bounds ``p_lower`` (``[B]``) on ``p_A`` and correctness ``correct``
    (``[B]`` bool); ``radii`` in input units. One global bound per model, one ``L(x, 0⁺)`` per input."""
    check_positive("sigma", sigma)
    radii = np.asarray(radii, dtype=np.float64).reshape(-1)
    if radii.size == 0 or not np.all(np.isfinite(radii) & (radii >= 0)):
        raise ValueError("radii must be finite and >= 0, at least one")
    p_lower = np.asarray(p_lower, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    if p_lower.shape != (x.shape[0],) or correct.shape != (x.shape[0],):
        raise ValueError(f"p_lower and correct need one value per input ({x.shape[0]})")
    if not np.all((p_lower >= 0) & (p_lower <= 1)):
        raise ValueError("p_lower must lie in [0, 1]")
    shape = tuple(x.shape[1:])
    identity = left.depth == 0
    if identity:
        global_bound, global_kind = 1.0, "identity"
    else:
        bound = global_lipschitz_bound(left, shape)
        global_bound, global_kind = float(bound.value[0]), bound.kind[0]
        if global_bound == 0:
            raise ValueError("f_L is constant (its global bound is 0): every input is certified at every radius")
    prefix = None if identity else _prefix_norms(left, shape)
    s = sigma / global_bound
    exits, within, local, kinds = [], [], [], {global_kind}
    for start in range(0, x.shape[0], batch):
        chunk = x[start:start + batch]
        if identity:
            local.append(np.ones(chunk.shape[0]))
            exits.append(np.zeros(chunk.shape[0]))
            within.append(np.zeros((chunk.shape[0], radii.size), dtype=np.int64))
            continue
        dist = face_distances(left, chunk, prefix)
        exits.append(torch.special.ndtr(-dist / s).sum(1).clamp_max(1).cpu().numpy())
        within.append(np.stack([(dist <= r).sum(1).cpu().numpy() for r in radii], 1))
        lb = lipschitz_bound(left, chunk, GAMMA_FLOOR)
        local.append(lb.value.cpu().numpy())
        kinds.update(lb.kind)
    exit_bound, local_l = np.concatenate(exits), np.concatenate(local)
    rs = _cohen_radius(s, p_lower - exit_bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        splitz = np.where(local_l > 0, _cohen_radius(sigma, p_lower) / local_l, np.inf)
    splitz = np.where(p_lower > 0.5, splitz, 0.0)
    return Headroom(sigma=float(sigma), radii=radii, idx=np.arange(x.shape[0]) if idx is None else np.asarray(idx),
                    correct=correct, p_lower=p_lower, exit_bound=exit_bound, faces_within=np.concatenate(within),
                    global_lipschitz=global_bound, local_lipschitz=local_l, rs_radius=rs, splitz_radius_max=splitz,
                    bound_kinds="/".join(sorted(kinds)))


def _cohen_radius(sigma: float, p: np.ndarray) -> np.ndarray:
    """``σ Φ⁻¹(p)`` where ``p > 1/2``, else 0 (abstain)."""
    return np.where(p > 0.5, sigma * norm.ppf(np.clip(p, 0.5, 1.0)), 0.0)


def headroom_of_run(model: SplitModel, dataset: Dataset, table: CertificationTable, sigma: float,
                    radii=DEFAULT_HEADROOM_RADII) -> Headroom:
    """:func:`headroom` of every row of a ``splitz certify`` run of ``model`` on ``dataset`` (its ``pA_lower`` column
    and its ``correct`` column)."""
    if "pA_lower" not in table.extra:
        raise ValueError("the certification file has no 'pA_lower' column: give a `splitz certify` TSV")
    device = next(model.parameters()).device
    x = torch.stack([dataset[int(i)][0] for i in table.idx]).to(device)
    return headroom(model.left, x, sigma, np.asarray(table.extra["pA_lower"], dtype=np.float64), table.correct,
                    radii, idx=table.idx)


def _share(mask: np.ndarray) -> str:
    return f"{100 * mask.mean():.1f}"


def headroom_report(result: Headroom, title: str, out_dir: str | os.PathLike | None = None) -> str:
    """Markdown: per radius ε the share of inputs where SPLITZ can beat RS on ``F``, with both sides' shares and the
    faces within ε; quantiles of ``e_s`` and ``L̄/L(x, 0⁺)``. With ``out_dir``: ``headroom.md`` and ``headroom.tsv``."""
    if out_dir is not None:
        check_output_folder("output folder", out_dir)
    beat = result.can_beat()
    ratio = result.jacobian_ratio
    finite = ratio[np.isfinite(ratio)]
    ratio_text = (f"median {np.median(finite):.4g}, max {finite.max():.4g}" if finite.size else "none finite")
    lines = [f"{title}: {result.idx.size} inputs, σ = {result.sigma:g}, L̄ = {result.global_lipschitz:.6g} "
             f"(bounds: {result.bound_kinds}), RS on F at s = σ/L̄ = {result.input_sigma:.4g}.",
             f"Exit bound e_s: median {np.median(result.exit_bound):.3g}, max {result.exit_bound.max():.3g}. "
             f"L̄/L(x, 0⁺): {ratio_text}; constant cells (∞): {int(np.isinf(ratio).sum())}.", "",
             "| ε | SPLITZ best case ≥ ε (%) | RS on F ≥ ε (%) | SPLITZ can beat RS (%) | median faces within ε |",
             "|---:|---:|---:|---:|---:|"]
    for j, eps in enumerate(result.radii):
        lines.append(f"| {eps:g} | {_share(result.correct & (result.splitz_radius_max >= eps))} | "
                     f"{_share(result.correct & (result.rs_radius >= eps))} | {_share(beat[:, j])} | "
                     f"{np.median(result.faces_within[:, j]):g} |")
    text = "\n".join(lines) + "\n"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "headroom.md").write_text(text, encoding="utf-8")
        names = [f"faces_within_{eps:g}" for eps in result.radii] + [f"can_beat_{eps:g}" for eps in result.radii]
        rows = ["\t".join(["idx", "correct", "pA_lower", "exit_bound", "L_local_0", "L_ratio", "rs_radius_F",
                           "splitz_radius_max", *names])]
        for b in range(result.idx.size):
            cells = [str(result.idx[b]), str(int(result.correct[b])), f"{result.p_lower[b]:.6g}",
                     f"{result.exit_bound[b]:.6g}", f"{result.local_lipschitz[b]:.6g}", f"{ratio[b]:.6g}",
                     f"{result.rs_radius[b]:.6g}", f"{result.splitz_radius_max[b]:.6g}"]
            cells += [str(int(c)) for c in result.faces_within[b]] + [str(int(c)) for c in beat[b]]
            rows.append("\t".join(cells))
        (out / "headroom.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return text
