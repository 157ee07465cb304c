"""Samples and certified accuracy: sequential certification vs Cohen's fixed n, on the same images and seeds.

For one checkpoint, certifies the selected test images twice into ``OUTDIR``:

- ``fixed.tsv``: ``Smoother.certify_many`` with ``n`` estimation samples per image (``splitz certify --N n``);
- ``sequential-B.tsv``: ``SequentialCertifier`` with ``--radii`` and each budget ``B`` (``splitz certify --sequential
  --radii ... --budget B``), plus ``sequential-B.samples.tsv`` with the estimation samples each image used (the
  certification TSV has no sample-count column).

Both go through :func:`splitz_fast.run_over_dataset` (resumable: rerun the same command to continue; ``--no-fixed``
runs only the sequential part, e.g. in a second process), then the script prints certified accuracy at every radius
(``mean(correct ∧ radius ≥ ε)``, abstentions count as wrong) and the mean estimation samples per image of each run,
over the images present in every file found (so a fixed run stopped early is compared on its finished images).
Selection draws (``n0``) are the same in both modes and not counted.
Usage::

    python scripts/sequential_vs_fixed.py runs/seq-rs/best.pt 0.5 docs/results/sequential/rs --skip 100 --max 50
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch

from splitz_fast import SequentialCertifier, Smoother, run_over_dataset
from splitz_fast.runs.tasks import CertifyRun
from splitz_fast.analysis.tables import read_certification
from splitz_fast.checkpoints.splitz import load_model
from splitz_fast.data.datasets import get_dataset
from splitz_fast.runs.loop import select_indices


def certify(certifier, dataset, out: Path, args, settings: dict, indices: list[int], n: int) -> None:
    samples_path = out.with_suffix(".samples.tsv")
    if not samples_path.exists():
        samples_path.write_text("idx\tn\tcount_a\tstop_reason\tdecisions\n")

    def record(idx, result):
        decisions = ",".join(d.value for d in getattr(result, "decisions", ()))
        with samples_path.open("a") as fh:
            fh.write(f"{idx}\t{result.n}\t{result.count_a}\t{getattr(result, 'stop_reason', 'fixed')}\t{decisions}\n")

    started = time.perf_counter()
    run_over_dataset(CertifyRun(certifier, args.n0, n, args.alpha, args.batch), dataset, out, settings=settings,
                     indices=indices, seed=args.seed, resume=True, checkpoint=args.checkpoint, on_row=record)
    print(f"{out.name}: {time.perf_counter() - started:.0f} s this call", flush=True)


def summary(name: str, tsv: Path, radii: list[float], images: set[int]) -> str:
    table = read_certification(tsv)
    keep = np.isin(table.idx, sorted(images))
    counts = np.loadtxt(tsv.with_suffix(".samples.tsv"), delimiter="\t", skiprows=1, usecols=(0, 1), ndmin=2)
    samples = counts[np.isin(counts[:, 0], sorted(images)), 1]
    accuracy = [100 * np.mean(table.correct[keep] & (table.radius[keep] >= r)) for r in radii]
    return (f"| {name} | {int(keep.sum())} | " + " | ".join(f"{a:.1f}" for a in accuracy)
            + f" | {samples.mean():,.0f} | {np.median(samples):,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("sigma", type=float)
    parser.add_argument("outdir")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--skip", type=int, default=100)
    parser.add_argument("--max", type=int, default=50)
    parser.add_argument("--n0", type=int, default=100)
    parser.add_argument("--n", type=int, default=100_000, help="fixed-n estimation samples")
    parser.add_argument("--budgets", type=int, nargs="+", default=[100_000], help="sequential budgets")
    parser.add_argument("--radii", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--alpha", type=float, default=0.001)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed", action=argparse.BooleanOptionalAction, default=True,
                        help="run (or continue) the fixed-n certification; its file is summarised whenever present")
    args = parser.parse_args()

    model, ckpt = load_model(args.checkpoint, "cpu")
    dataset = get_dataset(args.dataset, "test").dataset
    indices = select_indices(len(dataset), args.skip, args.max)
    smoother = Smoother(model, args.sigma)
    settings = {"dataset": args.dataset, "split": "test", "skip": args.skip, "max": args.max,
                "model_spec": ckpt.get("model_spec"), "bound": smoother.bound,
                "bound_method": smoother.bound_method, "gamma_search": smoother.gamma_search}
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads; "
          f"{len(indices)} images (skip {args.skip}), n0={args.n0}, α={args.alpha}, σ={args.sigma}", flush=True)
    runs = {f"fixed n={args.n:,}": out / "fixed.tsv"}
    if args.fixed:
        certify(smoother, dataset, runs[f"fixed n={args.n:,}"], args, settings, indices, args.n)
    for budget in args.budgets:
        name = f"sequential budget={budget:,}"
        runs[name] = out / f"sequential-{budget}.tsv"
        certifier = SequentialCertifier(smoother, args.radii)
        certify(certifier, dataset, runs[name], args,
                dict(settings, sequential=True, radii=args.radii, budget=budget), indices, budget)
    print("| run | images | " + " | ".join(f"ε={r:g}" for r in args.radii) + " | mean samples | median samples |")
    print("|---|---|" + "---|" * len(args.radii) + "---|---|")
    runs = {name: tsv for name, tsv in runs.items() if tsv.exists()}
    images = set.intersection(*(set(read_certification(tsv).idx.tolist()) for tsv in runs.values()))
    for name, tsv in runs.items():
        print(summary(name, tsv, args.radii, images))


if __name__ == "__main__":
    main()
