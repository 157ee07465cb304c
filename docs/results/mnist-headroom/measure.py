"""The numbers of docs/results/mnist-headroom/README.md, from one command (a few CPU minutes on one core, plus the
retraining and certification of the one MNIST model that is cheap to rebuild):

    OMP_NUM_THREADS=1 .venv/bin/python docs/results/mnist-headroom/measure.py [--runs runs/mnist-headroom]

(a) geometry: for every 5th test digit (2,000) the l2 distance to the nearest training digit of another class among
    all 60,000 (pixels in [0, 1], pixel/255);
(b) ten one-vs-rest hyperplanes (unit-normalised, trained by a hinge at margin 2 with torch) and the share of test
    digits on which each — and all ten together — is constant on B(x, 2);
(c) `splitz diagnose --headroom`'s table (splitz_fast.analysis.headroom) for the models of docs/results that can be
    rebuilt cheaply: the constructed example of docs/results/splitz-wins (hand-set weights, its committed TSV) and
    the split-1 `lenet-splitz` of the split ablation (4 epochs × 40 batches, retrained and certified here with the
    ablation's own commands), and the time of the diagnostic on 500 test digits;
(d) 7×7 convolution detectors (unit filter u, threshold t, "same" zero padding): for every 10th test digit (1,000)
    whether some informative channel (its sign is not the same at all 784 positions) is constant on B(x, γ) at all
    positions, γ ∈ {1, 1.5, 2}, and the largest step of u·patch between adjacent positions.

`--only detectors` (or geometry, hyperplanes, splitz-wins, lenet) runs one part alone.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import splitz_fast as sz
from splitz_fast.analysis.headroom import headroom, headroom_of_run, headroom_report
from splitz_fast.analysis.tables import certified_accuracy, read_certification
from splitz_fast.data.packages import load_mnist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RADII = (0.5, 1.0, 1.5, 2.0)
SPLITZ = [str(ROOT / ".venv" / "bin" / "splitz")]


def geometry(train_x, train_y, test_x, test_y) -> str:
    """(a): nearest other-class training digit of every 5th test digit."""
    queries, labels = test_x[::5].flatten(1).double(), test_y[::5]
    base = train_x.flatten(1).double()
    base_sq = base.square().sum(1)
    nearest = torch.empty(len(queries), dtype=torch.float64)
    for start in range(0, len(queries), 100):
        q = queries[start:start + 100]
        d2 = q.square().sum(1, keepdim=True) + base_sq[None, :] - 2 * q @ base.T
        d2[labels[start:start + 100, None] == train_y[None, :]] = torch.inf
        nearest[start:start + 100] = d2.min(1).values.clamp_min(0).sqrt()
    d = nearest.numpy()
    return (f"{len(d)} test digits (every 5th); l2 distance to the nearest other-class training digit (60,000): "
            f"≥ 2: {100 * (d >= 2).mean():.1f} %, ≥ 4: {100 * (d >= 4).mean():.1f} %, median {np.median(d):.3f}, "
            f"min {d.min():.3f}\n")


def hyperplanes(train_x, train_y, test_x, test_y, steps: int = 300) -> str:
    """(b): ten one-vs-rest hyperplanes trained by a hinge at unit-normalised margin 2 (full batch, Adam)."""
    torch.manual_seed(0)
    x, xt = train_x.flatten(1), test_x.flatten(1)
    y = torch.where(train_y[:, None] == torch.arange(10)[None, :], 1.0, -1.0)
    w = torch.zeros(10, 784, requires_grad=True)
    b = torch.zeros(10, requires_grad=True)
    with torch.no_grad():
        w.normal_(0, 0.01)
    opt = torch.optim.Adam([w, b], lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        margin = y * (x @ w.T + b) / w.norm(dim=1)
        loss = torch.relu(2.0 - margin).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        signed = (xt @ w.T + b) / w.norm(dim=1)
        yt = torch.where(test_y[:, None] == torch.arange(10)[None, :], 1.0, -1.0)
        constant = signed.abs() >= 2
        right = (yt * signed) >= 2
        accuracy = (signed.argmax(1) == test_y).double().mean()
    lines = [f"Ten one-vs-rest hyperplanes, hinge at margin 2 in l2 units ({steps} full-batch Adam steps, lr 0.01), "
             f"10,000 test digits; argmax accuracy {100 * accuracy:.1f} %.", "",
             "| class | constant on B(x, 2) (%) | … on the correct side (%) |", "|---:|---:|---:|"]
    for c in range(10):
        lines.append(f"| {c} | {100 * constant[:, c].double().mean():.1f} | {100 * right[:, c].double().mean():.1f} |")
    lines.append(f"| all ten | {100 * constant.all(1).double().mean():.1f} | {100 * right.all(1).double().mean():.1f} |")
    return "\n".join(lines) + "\n"


def _on_same_inputs(rs, table, eps: float) -> float:
    """Certified accuracy of the run ``rs`` at ``eps`` over the inputs of ``table`` only."""
    rows = np.isin(rs.idx, table.idx)
    if rows.sum() != len(table):
        raise ValueError(f"{rs.path} does not hold every input of {table.path}")
    return float((rs.correct & (rs.radius >= eps))[rows].mean())


def _agreement(result, table, rs_tables: dict) -> str:
    """Whether the certificates agree with the diagnostic: no SPLITZ radius above its best case, and SPLITZ's
    certified accuracy against RS on F and the trained RS runs at each ε."""
    slack = 1e-6 * np.maximum(1.0, result.splitz_radius_max)
    above = int((table.radius > result.splitz_radius_max + slack).sum())
    lines = [f"SPLITZ radii above the diagnostic's best case: {above} of {len(table)}.", "",
             "| ε | SPLITZ certified (%) | RS on F (%) | can beat RS on F (%) | "
             + " | ".join(f"{name}, same inputs (%)" for name in rs_tables) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(rs_tables)]
    beat = result.can_beat()
    for j, eps in enumerate(result.radii):
        cells = [f"{100 * float(certified_accuracy(table, eps)):.1f}",
                 f"{100 * (result.correct & (result.rs_radius >= eps)).mean():.1f}", f"{100 * beat[:, j].mean():.1f}"]
        cells += [f"{100 * _on_same_inputs(t, table, eps):.1f}" for t in rs_tables.values()]
        lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def splitz_wins() -> str:
    """(c) on the constructed example: its hand-set model and committed SPLITZ TSV."""
    spec = importlib.util.spec_from_file_location("splitz_wins_example", ROOT / "scripts" / "splitz_wins_example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    x, _ = example.box_data(64, 50)
    model, _ = example.models(64)
    folder = ROOT / "docs" / "results" / "splitz-wins"
    table = read_certification(folder / "splitz.tsv")
    radii = (0.5, 0.75, 0.9, 1.0, 1.1)
    result = headroom(model.left, x[table.idx], example.SIGMA_LATENT, table["pA_lower"], table.correct, radii,
                      idx=table.idx)
    rs = {f"RS σ={s:g}": read_certification(folder / f"rs-{s:g}.tsv") for s in example.RS_SIGMAS}
    return headroom_report(result, "splitz-wins (d = 64)", HERE / "splitz-wins") + "\n" + _agreement(result, table, rs)


def lenet_split1(runs: Path) -> str:
    """(c) on the split ablation's split-1 model: retrained and certified with the ablation's commands if absent."""
    run, tsv = runs / "lenet-splitz-split1", runs / "lenet-splitz-split1.tsv"
    if not (run / "best.pt").exists():
        subprocess.run(SPLITZ + ["train", "mnist", "lenet-splitz", str(run), "--split-index", "1", "--theta-lip", "0.5",
                                 "--gamma-train", "0.1", "--sigma", "0.75", "--epochs", "4", "--batch", "256",
                                 "--lr-schedule", "none", "--lambda-start", "0.8", "--lambda-end", "0.4",
                                 "--power-iters", "5", "--max-batches", "40", "--resume"], check=True)
    subprocess.run(SPLITZ + ["certify", "mnist", str(run / "best.pt"), "0.75", str(tsv), "--skip", "200", "--N0", "100",
                             "--N", "10000", "--alpha", "0.001", "--batch", "100", "--resume"], check=True)
    out = HERE / "lenet-splitz-split1"
    subprocess.run(SPLITZ + ["diagnose", str(run / "best.pt"), str(tsv), "--headroom", "--radii", *map(str, RADII),
                             "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    table = read_certification(tsv)
    model = sz.load_checkpoint(run / "best.pt").model
    test_x, test_y = load_mnist("test")
    result = headroom_of_run(model, torch.utils.data.TensorDataset(test_x, test_y), table, 0.75, RADII)
    (out / "certify.tsv").write_text(tsv.read_text())
    (out / "certify.tsv.json").write_text(Path(f"{tsv}.json").read_text())
    rs = {"RS, 15 epochs (docs/results/mnist)": read_certification(ROOT / "docs" / "results" / "mnist" / "rs.tsv")}
    start = time.perf_counter()
    headroom(model.left, test_x[:500], 0.75, np.full(500, 0.99), np.ones(500, dtype=bool), RADII)
    seconds = time.perf_counter() - start
    return (_agreement(result, table, rs) + f"\nDiagnostic time, 500 test digits, this one-layer f_L: {seconds:.1f} s "
            f"({torch.get_num_threads()} thread(s)).\n")


def _directions(train_x, count: int = 16) -> tuple[torch.Tensor, list[str]]:
    """The 37 unit 7×7 directions of (d): the top ``count`` eigenvectors of the training patches' covariance,
    ``count`` normalised patches cut at high-ink locations of training digits, and five simple filters."""
    digits = train_x[::60]  # 1,000 training digits
    patches = torch.nn.functional.unfold(digits.double(), 7, padding=3).transpose(1, 2).reshape(-1, 49)
    centred = patches - patches.mean(0)
    eigenvalues, eigenvectors = torch.linalg.eigh(centred.T @ centred / len(patches))
    eigen = eigenvectors[:, eigenvalues.argsort(descending=True)[:count]].T
    generator = torch.Generator().manual_seed(0)
    picked = train_x[torch.randperm(len(train_x), generator=generator)[:count]].double()
    ink = torch.nn.functional.conv2d(picked, torch.ones(1, 1, 7, 7, dtype=torch.float64), padding=3).flatten(1)
    per_digit = torch.nn.functional.unfold(picked, 7, padding=3).transpose(1, 2)  # [count, 784, 49]
    strokes = per_digit[torch.arange(count), ink.argmax(1)]
    bar = torch.zeros(7, 7, dtype=torch.float64)
    horizontal, vertical = bar.clone(), bar.clone()
    horizontal[3], vertical[:, 3] = 1.0, 1.0
    simple = torch.stack([torch.ones(7, 7, dtype=torch.float64), horizontal, vertical,
                          torch.eye(7, dtype=torch.float64), torch.eye(7, dtype=torch.float64).flip(1)]).flatten(1)
    directions = torch.cat([eigen, strokes, simple])
    names = ([f"eigenvector {k + 1}" for k in range(count)] + [f"stroke {k + 1}" for k in range(count)]
             + ["uniform blob", "horizontal bar", "vertical bar", "diagonal", "anti-diagonal"])
    return directions / directions.norm(dim=1, keepdim=True), names


def detectors(train_x, test_x, gammas=(1.0, 1.5, 2.0), n_thresholds: int = 49) -> str:
    """(d): can an informative 7×7 detector channel be constant on B(x, γ) at all 784 positions of a digit?"""
    conv = torch.nn.functional.conv2d
    directions, names = _directions(train_x)
    filters = directions.view(-1, 1, 7, 7)
    train_values = conv(train_x[::60].double(), filters, padding=3).transpose(0, 1).flatten(1)  # [37, 784,000]
    levels = torch.linspace(0.01, 0.99, n_thresholds, dtype=torch.float64)
    low, high = (torch.quantile(train_values[:, ::8], q, dim=1) for q in (0.01, 0.99))
    thresholds = low[:, None] + (high - low)[:, None] * levels[None, :]  # [37, 49], evenly from q1 % to q99 %
    x = test_x[::10].double()
    values = conv(x, filters, padding=3)  # [1000, 37, 28, 28]: every u·patch_p(x)
    flat = values.flatten(2)
    found = {g: torch.zeros(len(x), dtype=torch.bool) for g in gammas}
    coverage = {g: torch.zeros(len(x), dtype=torch.float64) for g in gammas}  # best share of constant positions
    informative_share = torch.zeros((), dtype=torch.float64)
    for k in range(n_thresholds):
        d = flat - thresholds[None, :, k, None]
        informative = (d > 0).any(2) & (d <= 0).any(2)  # [1000, 37]
        informative_share += informative.double().mean() / n_thresholds
        for g in gammas:
            constant = d.abs() >= g
            found[g] |= (informative & constant.all(2)).any(1)
            share = torch.where(informative, constant.double().mean(2), 0.0).max(1).values
            coverage[g] = torch.maximum(coverage[g], share)
    steps = torch.maximum((values[..., 1:] - values[..., :-1]).abs().flatten(2).max(2).values,
                          (values[..., 1:, :] - values[..., :-1, :]).abs().flatten(2).max(2).values)  # [1000, 37]
    per_direction = steps.max(0).values
    largest = int(per_direction.argmax())
    padded = torch.nn.functional.pad(x, (3, 3, 3, 3))
    box = torch.ones(1, 1, 7, 7, dtype=torch.float64)
    across = conv((padded[..., :, 1:] - padded[..., :, :-1]).square(), box)  # ‖patch_p − patch_q‖², horizontal
    down = conv((padded[..., 1:, :] - padded[..., :-1, :]).square(), box)
    bound = max(float(across.max()), float(down.max())) ** 0.5
    lines = [f"{len(x)} test digits (every 10th); {len(directions)} unit 7×7 directions × {n_thresholds} thresholds "
             f"(evenly from the 1 % to the 99 % quantile of u·patch on 1,000 training digits, all positions, zero "
             f"padding); informative channels: {100 * informative_share:.1f} % of (image, detector) pairs.", "",
             "| γ | images with an informative channel constant at all 784 positions (%) | "
             "best share of positions constant, informative channel, median image (%) | "
             "images with a step ≥ 2γ in some direction (%) |", "|---:|---:|---:|---:|"]
    for g in gammas:
        lines.append(f"| {g:g} | {100 * found[g].double().mean():.1f} | {100 * coverage[g].median():.1f} | "
                     f"{100 * (steps >= 2 * g).any(1).double().mean():.1f} |")
    families = {"eigenvectors": per_direction[:16], "strokes": per_direction[16:32], "simple": per_direction[32:]}
    lines += ["", f"Largest step |u·patch_p − u·patch_q| between adjacent positions, over the images and directions: "
              f"{float(per_direction.max()):.3f} ({names[largest]}); by family: "
              + ", ".join(f"{name} {float(v.max()):.3f}" for name, v in families.items())
              + f"; median over images of the largest step, all directions: {float(steps.max(1).values.median()):.3f}.",
              f"Bound for every unit 7×7 filter (largest ‖patch_p − patch_q‖₂ between adjacent positions): "
              f"{bound:.3f}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(ROOT / "runs" / "mnist-headroom"),
                        help="folder for the retrained checkpoint and its certification (not committed)")
    parser.add_argument("--only", choices=("all", "geometry", "hyperplanes", "splitz-wins", "lenet", "detectors"),
                        default="all", help="run one part alone (default: all)")
    args = parser.parse_args()
    runs = Path(args.runs)
    train_x, train_y = load_mnist("train")
    test_x, test_y = load_mnist("test")
    jobs = {"geometry": ("geometry.md", lambda: geometry(train_x, train_y, test_x, test_y)),
            "hyperplanes": ("hyperplanes.md", lambda: hyperplanes(train_x, train_y, test_x, test_y)),
            "splitz-wins": ("splitz-wins/agreement.md", splitz_wins),
            "lenet": ("lenet-splitz-split1/agreement.md", lambda: lenet_split1(runs)),
            "detectors": ("detectors.md", lambda: detectors(train_x, test_x))}
    if args.only in ("all", "lenet"):
        runs.mkdir(parents=True, exist_ok=True)
    parts = {}
    for key, (name, job) in jobs.items():
        if args.only in ("all", key):
            start = time.perf_counter()
            parts[name] = job()
            print(f"{key}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for name, text in parts.items():
        (HERE / name).parent.mkdir(parents=True, exist_ok=True)
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"## {name}\n{text}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
