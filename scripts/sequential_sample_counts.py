"""How many samples does sequential certification need, compared with Cohen's fixed n? (A simulation.)

For every row of a certification TSV (``splitz certify`` output with its ``.json`` sidecar), the count ``n_A`` behind
the row's ``pA_lower`` is recovered by inverting the Clopper–Pearson bound at the run's ``n`` and ``α``, and
``p_A = n_A / n`` is taken as the truth. Bernoulli(p_A) draws then feed

- ``certify_sequential`` with the thresholds ``Φ(ε · L / σ)`` of the requested radii ε (``L`` from the row; rows that
  abstained have no ``L`` and get the file's largest one) and a budget of ``n`` by default, and
- Cohen's fixed-n CERTIFY on a fresh ``Binomial(n, p_A)`` count (same simulated truth, for an even comparison),

and certified accuracy at ε (``correct`` and certified) is reported for both, beside the TSV's own.

Caveats: ``L`` is the row's bound at its best γ, not ``L(x, ε)`` at each ε (exact for RS, where ``L = 1``); the ``n0``
selection draws are the same in both modes and are not counted. Usage::

    python scripts/sequential_sample_counts.py docs/results/mnist-n1e5/rs.tsv docs/results/mnist-n1e5/splitz.tsv
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

from splitz_fast.certify.sequential import Decision, certify_sequential, latent_thresholds
from splitz_fast.certify.stats import clopper_pearson_lower


def recover_count(p_lower: float, n: int, alpha: float) -> int:
    """The ``n_A`` whose Clopper–Pearson bound is closest to ``p_lower`` (the bound increases with ``n_A``)."""
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if clopper_pearson_lower(mid, n, alpha) <= p_lower:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda k: abs(clopper_pearson_lower(k, n, alpha) - p_lower))


def simulate(path: Path, radii: list[float], budget: int | None, seed: int, **driver):
    settings = json.loads(Path(str(path) + ".json").read_text())
    n, alpha, sigma = settings["n"], settings["alpha"], settings["sigma"]
    budget = budget or n
    with open(path, newline="") as f:
        rows = [row for row in csv.DictReader(f, delimiter="\t") if row["pA_lower"] != "nan"]
    lipschitz = [float(r["L"]) for r in rows]
    worst_l = max(v for v in lipschitz if not math.isnan(v))
    rng = np.random.default_rng(seed)
    samples, tsv_cert, fixed_cert, seq_cert = [], [], [], []
    for row, lip in zip(rows, lipschitz):
        p_a = recover_count(float(row["pA_lower"]), n, alpha) / n
        correct = row["correct"] == "1"
        thresholds = latent_thresholds([eps * (worst_l if math.isnan(lip) else lip) for eps in radii], sigma)
        result = certify_sequential(
            lambda num: rng.binomial(num, p_a), thresholds, alpha=alpha, budget=budget, **driver
        )
        fixed_lower = clopper_pearson_lower(int(rng.binomial(n, p_a)), n, alpha)
        samples.append(result.samples)
        tsv_cert.append([correct and float(row["radius"]) >= eps for eps in radii])
        fixed_cert.append([correct and fixed_lower >= p for p in thresholds])
        seq_cert.append([correct and d is Decision.CERTIFIED for d in result.decisions])
    return n, budget, np.asarray(samples), *(100 * np.mean(c, axis=0) for c in (tsv_cert, fixed_cert, seq_cert))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tsv", nargs="+", type=Path)
    parser.add_argument("--radii", nargs="+", type=float, default=[0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--budget", type=int, default=None, help="sequential budget (default: the run's n)")
    parser.add_argument("--first", type=int, default=256)
    parser.add_argument("--growth", type=float, default=1.3)
    parser.add_argument("--prior", nargs=2, type=float, default=[0.5, 0.5], metavar=("A", "B"))
    parser.add_argument("--give-up", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="simulations per input (seeds seed, seed + 1, ...)")
    args = parser.parse_args()
    driver = dict(first=args.first, growth=args.growth, prior=tuple(args.prior), give_up=args.give_up)
    for path in args.tsv:
        runs = [simulate(path, args.radii, args.budget, args.seed + r, **driver) for r in range(args.repeats)]
        n, budget = runs[0][:2]
        samples = np.concatenate([run[2] for run in runs])
        tsv_acc, fixed_acc, seq_acc = (np.mean([run[i] for run in runs], axis=0) for i in (3, 4, 5))
        print(f"{path}: {len(samples) // args.repeats} inputs x {args.repeats} simulations (seeds from {args.seed}), "
              f"fixed n = {n}, sequential budget = {budget}, {driver}")
        print(f"  sequential samples: mean {samples.mean():.0f}, median {np.median(samples):.0f}, "
              f"max {samples.max()}; {n / samples.mean():.1f}x fewer than fixed n on average")
        print("  eps    TSV fixed-n   sim. fixed-n   sequential   (certified accuracy, %)")
        for eps, a, b, c in zip(args.radii, tsv_acc, fixed_acc, seq_acc):
            print(f"  {eps:<5g}  {a:9.1f}    {b:11.1f}    {c:9.1f}")


if __name__ == "__main__":
    main()
