"""Displacement radius vs Theorem 1's Lipschitz radius on real MNIST test images (docs/results/displacement).

Usage: OMP_NUM_THREADS=1 python scripts/displacement_measure.py [--images 20] [--thetas 1.0] [--sigmas 0.5 0.75]
Model: LeNet split 1 (advertorch's clean-trained weights; --random-init for a fresh one) or, with --model mlp, a
random-init MLP whose f_L is Linear(784 → --hidden) + clipped ReLU; θ per --thetas. R = σ Φ⁻¹(p) for each σ; every 500th MNIST test image. Prints one markdown row per setting.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from scipy.stats import norm

import splitz_fast as sz
from splitz_fast.data.datasets import get_dataset
from splitz_fast.bounds.displacement import displacement_radius
from splitz_fast.bounds.radius import BoundOptions, RadiusSearch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--thetas", type=float, nargs="+", default=[1.0])
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--p", type=float, default=0.99)
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--model", default="lenet", choices=["lenet", "mlp"])
    ap.add_argument("--hidden", type=int, default=32, help="hidden width of --model mlp (random init)")
    args = ap.parse_args()
    data = get_dataset("mnist", "test").dataset
    stride = len(data) // args.images
    images = [data[i * stride][0] for i in range(args.images)]
    opts = BoundOptions(bound_method="exact")
    print("| θ | σ | R | mean Lipschitz radius | mean displacement radius | median gain | images improved | "
          "radius won by a clip candidate | best candidate counts | s/image (Lipschitz / displacement) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for theta in args.thetas:
        torch.manual_seed(0)
        extra = {} if args.random_init else {"pretrained": True}
        if args.model == "mlp":  # a narrow latent: Linear(784 → hidden) + clipped ReLU
            extra = {"in_features": 784, "num_classes": 10, "hidden": (args.hidden, args.hidden)}
        model = sz.build_model(args.model, split_index=1, threshold=theta, **extra)
        left = model.left.eval()
        for sigma in args.sigmas:
            r_latent = sigma * float(norm.ppf(args.p))
            base, disp, gains, counts, t_base, t_disp = [], [], [], {}, 0.0, 0.0
            for x in images:
                x = x.flatten() if args.model == "mlp" else x
                t0 = time.perf_counter()
                b = RadiusSearch.of_left(left, opts).search(x, r_latent, None)
                t1 = time.perf_counter()
                d = displacement_radius(left, x, r_latent, options=opts, baseline=b)
                t2 = time.perf_counter()
                t_base += t1 - t0
                t_disp += t2 - t1
                base.append(b.radius)
                disp.append(d.radius)
                gains.append(d.radius / b.radius if b.radius > 0 else float("nan"))
                counts[d.candidate] = counts.get(d.candidate, 0) + 1
            n = len(images)
            improved = sum(dr > br * (1 + 1e-9) for dr, br in zip(disp, base))
            by_clip = n - counts.get("baseline", 0) - counts.get("lipschitz", 0)
            print(f"| {theta:g} | {sigma:g} | {r_latent:.3f} | {statistics.mean(base):.4f} | {statistics.mean(disp):.4f}"
                  f" | {statistics.median(gains):.3f}x | {improved}/{n} | {by_clip}/{n} | "
                  f"{', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))} | "
                  f"{t_base / n:.2f} / {t_disp / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
