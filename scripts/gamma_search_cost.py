"""Radius gained and time spent by the γ searches, on the same certified images, in one process.

For every non-abstained row of a certification TSV (its latent radius ``R_latent`` fixes what sampling gave), run
the γ search of ``Smoother`` as ``bisection`` (2 and 4 candidates per batched bound pass) and ``one-step``
(interleaved, so all see the same machine load) and report the mean radius, the mean number of bound evaluations and
passes, and the mean search time per image.
Sampling is not repeated: it is identical for both searches and would only dilute the comparison.

    python scripts/gamma_search_cost.py CHECKPOINT TSV OUT.md [--dataset mnist] [--sigma 0.75] [--max 40]
                                        [--device cpu]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from splitz_fast import BoundOptions, Smoother
from splitz_fast.certify.inputs import prepare_input
from splitz_fast.analysis.tables import read_certification
from splitz_fast.checkpoints.splitz import load_model
from splitz_fast.data.datasets import get_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("tsv", help="certification TSV of that checkpoint (its R_latent column is used)")
    parser.add_argument("out", help="markdown table to write")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--sigma", type=float, default=0.75)
    parser.add_argument("--max", type=int, default=40, help="first MAX certified rows (default: 40)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model, _ = load_model(args.checkpoint, args.device)
    table = read_certification(args.tsv)
    if "R_latent" not in table.extra:
        raise SystemExit(f"{args.tsv} has no R_latent column (write it with `splitz certify`)")
    dataset = get_dataset(args.dataset, "test").dataset
    searches = {"bisection": Smoother(model, args.sigma),
                "bisection, 4 per pass": Smoother(model, args.sigma, bound_options=BoundOptions(gamma_batch=4)),
                "one-step": Smoother(model, args.sigma, bound_options=BoundOptions(gamma_search="one-step"))}
    stats = {name: {"radius": [], "evaluations": [], "passes": [], "seconds": []} for name in searches}
    for idx, r_latent in zip(table.idx, table.extra["R_latent"]):
        if not r_latent > 0:
            continue  # abstained: no search
        if len(stats["bisection"]["radius"]) >= args.max:
            break
        x = dataset[int(idx)][0].to(args.device)
        for name, smoother in searches.items():
            generator = torch.Generator(device=args.device).manual_seed(int(idx))
            start = time.perf_counter()
            best = smoother.radius_search.search(prepare_input(model, x).x, float(r_latent), generator)
            stats[name]["seconds"].append(time.perf_counter() - start)
            stats[name]["radius"].append(best.radius)
            stats[name]["evaluations"].append(best.evaluations)
            stats[name]["passes"].append(best.passes)
    images = len(stats["bisection"]["radius"])
    lines = [f"γ search on {images} certified images of `{args.tsv}` (same R_latent for both; search only, "
             f"no sampling), device {args.device}, torch threads {torch.get_num_threads()}", "",
             "| search | mean radius | mean L evaluations | mean bound passes | mean search time (ms) | "
             "radius vs bisection |",
             "|---|---:|---:|---:|---:|---:|"]
    base = sum(stats["bisection"]["radius"])
    for name, s in stats.items():
        mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
        lines.append(f"| {name} | {mean(s['radius']):.4f} | {mean(s['evaluations']):.1f} | {mean(s['passes']):.1f} | "
                     f"{1e3 * mean(s['seconds']):.1f} | {100 * sum(s['radius']) / base if base else math.nan:.2f} % |")
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
