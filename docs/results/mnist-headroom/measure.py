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
    ablation's own commands), and the time of the diagnostic on 500 test digits.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(ROOT / "runs" / "mnist-headroom"),
                        help="folder for the retrained checkpoint and its certification (not committed)")
    args = parser.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    train_x, train_y = load_mnist("train")
    test_x, test_y = load_mnist("test")
    parts = {"geometry.md": geometry(train_x, train_y, test_x, test_y),
             "hyperplanes.md": hyperplanes(train_x, train_y, test_x, test_y),
             "splitz-wins/agreement.md": splitz_wins(),
             "lenet-splitz-split1/agreement.md": lenet_split1(runs)}
    for name, text in parts.items():
        (HERE / name).parent.mkdir(parents=True, exist_ok=True)
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"## {name}\n{text}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
