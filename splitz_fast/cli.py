"""The ``splitz`` command line. For now: ``splitz demo``, the README's main job (see ``splitz demo --help``)."""
from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import __version__
from .data import DatasetUnavailableError, load_mnist
from .lipschitz import global_lipschitz_bound
from .modules import split_sequential
from .results import HEADER, markdown_table, write_row
from .smoothing import Smoother
from .stats import max_latent_radius
from .zoo import pretrained_lenet5


def _certify_run(name, smoother, images, labels, indices, args, out_path: Path):
    rows = []
    with out_path.open("w") as fh:
        fh.write(HEADER + "\n")
        for idx in tqdm(indices, desc=name, unit="img", file=sys.stderr):
            result = smoother.certify(images[idx], args.n0, args.n, args.alpha, batch_size=args.batch,
                                      seed=args.seed + idx)
            write_row(fh, idx, int(labels[idx]), result)
            rows.append((result.radius, int(result.prediction == int(labels[idx])), result))
    return rows


def demo(args: argparse.Namespace) -> int:
    """Certify advertorch's pretrained LeNet-5 on real MNIST, as plain RS (s = 0) and as SPLITZ (s = 1)."""
    torch.manual_seed(args.seed)
    images, labels = load_mnist("test")
    net = pretrained_lenet5()
    indices = list(range(0, len(images), args.skip))[: args.num_images]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rs = split_sequential(net, 0, num_classes=10, input_shape=(1, 28, 28))
    splitz = split_sequential(net, 1, num_classes=10, input_shape=(1, 28, 28), threshold=args.threshold)
    runs = {
        f"RS (s=0, σ={args.sigma})": Smoother(rs, args.sigma),
        f"SPLITZ (s=1, θ={args.threshold}, σ={args.sigma})": Smoother(splitz, args.sigma, gamma_search="bisection"),
    }
    print(f"splitz_fast {__version__} demo: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"data: MNIST test images {indices[0]}, {indices[0] + args.skip}, ... ({len(indices)} images); "
          f"model: advertorch LeNet-5 (clean-trained, not noise-trained); n0={args.n0}, n={args.n}, "
          f"alpha={args.alpha}")
    global_l = global_lipschitz_bound(splitz.left, (1, 28, 28))
    print(f"SPLITZ f_L = conv1 + clipped ReLU(θ={args.threshold}); global bound ‖W1‖ = {float(global_l.value[0]):.4f} "
          f"({global_l.kind[0]})")
    results = {}
    start_all = time.perf_counter()
    for (name, smoother), fname in zip(runs.items(), ("rs.tsv", "splitz.tsv")):
        start = time.perf_counter()
        rows = _certify_run(name, smoother, images, labels, indices, args, out / fname)
        results[name] = rows
        wall = time.perf_counter() - start
        kinds = sorted({r[2].bound_kind for r in rows})
        lips = [r[2].lipschitz for r in rows if not math.isnan(r[2].lipschitz)]
        print(f"{name}: {wall:.1f} s ({wall / len(rows):.2f} s/image), bound kinds {kinds}"
              + (f", mean L(x, γ*) {sum(lips) / len(lips):.3f}" if lips else "") + f" → {out / fname}")
    radii = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5]
    print()
    print("Certified accuracy (%) on real MNIST (radius in raw [0,1] pixel units, l2):")
    print(markdown_table({k: [(r, c) for r, c, _ in v] for k, v in results.items()}, radii))
    print(f"\nlargest latent radius possible at n={args.n}, alpha={args.alpha}: "
          f"{max_latent_radius(args.sigma, args.n, args.alpha):.3f} (= {max_latent_radius(1.0, args.n, args.alpha):.2f}σ)")
    print(f"total wall time {time.perf_counter() - start_all:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitz", description="SPLITZ: split Lipschitz randomized smoothing")
    parser.add_argument("--version", action="version", version=f"splitz_fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="certify a pretrained LeNet-5 on offline MNIST as RS and as SPLITZ")
    d.add_argument("--out", default="runs/demo", help="folder for the result TSVs (default: runs/demo)")
    d.add_argument("--num-images", type=int, default=50, help="number of test images (default: 50)")
    d.add_argument("--skip", type=int, default=200, help="certify every SKIP-th test image (default: 200)")
    d.add_argument("--sigma", type=float, default=0.25, help="noise level σ (default: 0.25)")
    d.add_argument("--threshold", type=float, default=1.0, help="clipped-ReLU threshold θ of f_L (default: 1.0)")
    d.add_argument("--n0", type=int, default=100, help="selection samples (default: 100)")
    d.add_argument("--n", type=int, default=10_000, help="estimation samples (default: 10,000)")
    d.add_argument("--alpha", type=float, default=0.001, help="failure probability (default: 0.001)")
    d.add_argument("--batch", type=int, default=1000, help="noise samples per forward pass (default: 1000)")
    d.add_argument("--seed", type=int, default=0, help="base seed; image i uses seed+i (default: 0)")
    d.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "num_images", 1) < 1 or getattr(args, "skip", 1) < 1:
        parser.error("--num-images and --skip must be >= 1")
    try:
        return args.func(args)
    except DatasetUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
