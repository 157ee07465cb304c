"""``splitz demo``: the README's main job, its parser beside it."""
from __future__ import annotations

import argparse
import json
import platform
import time

from .. import __version__
from .options import DEMO_RADII, _HelpFormatter, _add_threads_option


def demo(args: argparse.Namespace) -> int:
    """The README's main job: train an RS LeNet (s = 0) and a SPLITZ LeNet (s = 1) on offline MNIST with the same
    budget, certify the same test images with each, and print the certified-accuracy tables side by side.

    Everything lands in ``--out``; a second call resumes (finished parts are not redone)."""
    import torch

    from .._checks import check_count, check_output_folder, check_probability
    from ..analysis.plots import analyze
    from ..certify.smoothing import Smoother
    from ..certify.stats import max_latent_radius
    from ..checkpoints.splitz import load_model
    from ..data.datasets import get_dataset
    from ..zoo.models import build_model
    from ..runs.loop import run_over_dataset, select_indices
    from ..runs.tasks import CertifyRun
    from ..training.loop import train
    from .train import _train_config

    # Check every setting up front: a bad value must not cost a training run first.
    config = _train_config(args, _DEMO_TRAIN_OPTIONS)
    check_probability("--alpha", args.alpha)
    check_count("--n0", args.n0)
    check_count("--n", args.n)
    if args.batch is not None:
        check_count("--batch", args.batch)
    check_count("--num-images", args.num_images)
    check_count("--skip", args.skip)
    if args.n0 > args.n:
        raise ValueError(f"--n0 ({args.n0}) must not exceed --n ({args.n})")
    out = check_output_folder("--out", args.out)
    start_all = time.perf_counter()
    train_info = get_dataset("mnist", "train")
    test_info = get_dataset("mnist", "test")
    indices = select_indices(len(test_info.dataset), args.skip, args.num_images)
    print(f"splitz_fast {__version__} demo: torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, device {args.device}")
    print(f"train: offline MNIST ({len(train_info)} digits, 10% held out), LeNet, σ={args.sigma}, {args.epochs} "
          f"epoch{'s' if args.epochs != 1 else ''}, batch {args.train_batch}; certify: test images {indices[0]}, {indices[0] + args.skip}, ... "
          f"({len(indices)} images), n0={args.n0}, n={args.n}, α={args.alpha}")
    tsvs = {}
    for name, split_index in (("RS", 0), ("SPLITZ", 1)):
        kwargs = {"split_index": split_index, "threshold": 1.0, "learnable_threshold": False}
        torch.manual_seed(args.seed)
        model = build_model("lenet", **kwargs)
        run_dir = out / name.lower()
        spec = {"name": "lenet", "kwargs": kwargs, "dataset": "mnist"}
        started = time.perf_counter()
        result = train(model, train_info.dataset, config, run_dir, model_spec=spec, device=args.device, resume=True)
        # Checkpoints hold no wall times (identical runs give identical files): read them from the log.
        epoch_times = [json.loads(line)["epoch_seconds"] for line in (run_dir / "train.log").read_text().splitlines()]
        print(f"{name}: trained in {time.perf_counter() - started:.0f} s this call; epoch times "
              f"{', '.join(f'{t:.0f}' for t in epoch_times)} s; best epoch {result.best_epoch}, "
              f"val noisy acc {result.best_val_noisy_acc:.3f}", flush=True)
        best, _ = load_model(str(run_dir / "best.pt"), args.device)
        smoother = Smoother(best, args.sigma)
        tsv = out / f"{name.lower()}.tsv"
        started = time.perf_counter()
        try:
            run_over_dataset(CertifyRun(smoother, args.n0, args.n, args.alpha, args.batch), test_info.dataset, tsv,
                             settings={"dataset": "mnist", "split": "test", "model_spec": spec, "bound": smoother.bound,
                                       "bound_method": smoother.bound_method, "gamma_search": smoother.gamma_search},
                             indices=indices, seed=args.seed, resume=True, checkpoint=run_dir / "best.pt")
        except ValueError as err:  # the demo names no OUTFILE: its files live in --out
            if "cannot resume" not in str(err):
                raise
            raise ValueError(f"{err} (the demo writes its files into --out {out}: for other settings, give another "
                             "--out)") from None
        print(f"{name}: certified in {time.perf_counter() - started:.0f} s this call → {tsv}", flush=True)
        tsvs[f"{name} (s={split_index}, σ={args.sigma})"] = tsv
    print()
    print("Certified accuracy (%) on real MNIST test images (l2 radius in [0,1] pixel units):")
    print(analyze(tsvs, DEMO_RADII, out_dir=out))
    print(f"largest radius any RS certificate can reach here: "
          f"{max_latent_radius(args.sigma, args.n, args.alpha):.3f} (= {max_latent_radius(1.0, args.n, args.alpha):.2f}σ)")
    print(f"tables and plot: {out}/table.md, table.tex, certified_accuracy.png/.pdf; "
          f"total wall time {time.perf_counter() - start_all:.0f} s")
    return 0


_DEMO_TRAIN_OPTIONS = {"sigma": "--sigma", "epochs": "--epochs", "batch_size": "--train-batch",
                       "lambda_start": "--lambda-start", "lambda_end": "--lambda-end", "seed": "--seed",
                       "max_batches": "--max-batches"}


def _add_demo_parser(sub) -> None:
    """``splitz demo``: the README's main job."""
    d = sub.add_parser("demo", help="train RS and SPLITZ LeNets on offline MNIST, certify, compare",
                       formatter_class=_HelpFormatter)
    d.add_argument("--out", default="runs/demo", help="folder for checkpoints, TSVs, tables, plot")
    d.add_argument("--epochs", type=int, default=2, help="training epochs of each model (numbered from 0)")
    d.add_argument("--train-batch", type=int, default=256, help="training batch size")
    d.add_argument("--lambda-start", type=float, default=0.8, help="SPLITZ λ at the first epoch")
    d.add_argument("--lambda-end", type=float, default=0.4, help="SPLITZ λ at the last epoch")
    d.add_argument("--num-images", type=int, default=30, help="number of test images")
    d.add_argument("--skip", type=int, default=333, help="certify every SKIP-th test image")
    d.add_argument("--sigma", type=float, default=0.75, help="noise level σ, train and test")
    d.add_argument("--n0", type=int, default=100, help="selection samples")
    d.add_argument("--n", type=int, default=10_000, help="estimation samples")
    d.add_argument("--alpha", type=float, default=0.001, help="failure probability")
    d.add_argument("--batch", type=int, default=None,
                   help="noise samples per forward pass of f_R; unset, the fastest batch measured on this device")
    d.add_argument("--max-batches", type=int, default=None, help="cap batches per epoch (quick runs; default: all)")
    d.add_argument("--seed", type=int, default=0, help="seed of training and certification")
    d.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N where a GPU is present")
    _add_threads_option(d)
    d.set_defaults(func=demo)
