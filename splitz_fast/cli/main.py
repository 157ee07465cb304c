"""The ``splitz`` command line: ``train``, ``certify``, ``predict``, ``attack``, ``analyze`` and ``demo``
(``splitz CMD --help``).

``certify``/``predict`` take Cohen et al.'s positional arguments ``DATASET CHECKPOINT SIGMA OUTFILE`` and options
(``--batch --skip --max --split --N0 --N --alpha``), so existing scripts carry over; with ``--checkpoint-format cohen``
they read Cohen et al.'s own checkpoints too. They (and ``certify-margin``)
run sharded with ``--shard K/N`` (then ``splitz merge OUTFILE``) or under ``torchrun -m splitz_fast`` (rank 0 merges;
:mod:`splitz_fast.runs.torchrun`). ``train`` under ``torchrun -m splitz_fast`` trains data-parallel over the ranks
(:class:`~splitz_fast.runs.torchrun.DataParallelGroup`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .._checks import (check_count, check_device, check_output_file, check_output_folder, check_positive,
                       check_probability, read_settings_file)
from ..checkpoints.splitz import load_model  # also importable from here (scripts/ use splitz_fast.cli.main.load_model)
from ..data.packages import DatasetUnavailableError
from ..certify.margin import MarginCertifier
from ..certify.protocols import PROTOCOLS, PUBLISHED_DATA_STD, CertificationProtocol, PublishedCode, get_protocol
from ..bounds.radius import BOUND_METHODS, BOUNDS, GAMMA_SEARCHES, BoundOptions
from ..sampling.engine import PRECISIONS, unfolded_batchnorms
from ..certify.sequential import SequentialCertifier
from ..certify.smoothing import Smoother
from ..certify.stats import max_latent_radius


DEMO_RADII = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]


def demo(args: argparse.Namespace) -> int:
    """The README's main job: train an RS LeNet (s = 0) and a SPLITZ LeNet (s = 1) on offline MNIST with the same
    budget, certify the same test images with each, and print the certified-accuracy tables side by side.

    Everything lands in ``--out``; a second call resumes (finished parts are not redone)."""
    from ..analysis.tables import analyze
    from ..data.datasets import get_dataset
    from ..zoo.models import build_model
    from ..runs.loop import CertifyRun, run_over_dataset, select_indices
    from ..training.loop import train

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


# ---------------------------------------------------------------------------------------------------- train
def _model_kwargs(model_name: str, info, args: argparse.Namespace, recipe_model: dict) -> dict:
    """Model options: the command line's, else the recipe's, else the defaults (split 1, θ = 1, fixed, scalar)."""
    chosen = {**_MODEL_DEFAULTS, **recipe_model,
              **{key: value for key in _MODEL_DEFAULTS if (value := getattr(args, key)) is not None}}
    kwargs = {key: chosen[key] for key in ("split_index", "threshold", "learnable_threshold")}
    if chosen["threshold_per_element"]:  # only LeNet and the MLP take it: others refuse the keyword by name
        kwargs["threshold_per_element"] = True
    kwargs.update(_detector_kwargs(model_name, args))
    if model_name == "mlp":
        kwargs.update(in_features=info.input_shape[0], num_classes=info.num_classes)
    elif model_name.startswith(("cifar_resnet", "imagenet_resnet")):
        kwargs.update(num_classes=info.num_classes)
    return kwargs


def _detector_kwargs(model_name: str, args: argparse.Namespace) -> dict:
    """``detectors`` and ``detector_kernel`` of model lenet-rs-init (recorded in model_spec even at their defaults);
    nothing for other models, which refuse the options."""
    from ..zoo.models import RS_INIT_DETECTOR_KERNEL, RS_INIT_DETECTORS

    given = {"detectors": args.detectors, "detector_kernel": args.detector_kernel}
    if model_name != "lenet-rs-init":
        if any(value is not None for value in given.values()):
            raise ValueError(f"--detectors and --detector-kernel do nothing with model {model_name}: they size the "
                             "f_L of model lenet-rs-init")
        return {}
    defaults = {"detectors": RS_INIT_DETECTORS, "detector_kernel": RS_INIT_DETECTOR_KERNEL}
    return {key: defaults[key] if value is None else value for key, value in given.items()}


_MODEL_DEFAULTS = {"split_index": 1, "threshold": 1.0, "learnable_threshold": False, "threshold_per_element": False}


# TrainConfig field -> the option that sets it, so a refused value is reported under the name the user typed.
_TRAIN_OPTIONS = {
    "sigma": "--sigma", "epochs": "--epochs", "batch_size": "--batch", "noise_samples": "--noise-samples",
    "lambda_start": "--lambda-start", "lambda_end": "--lambda-end", "theta_lip": "--theta-lip",
    "gamma_train": "--gamma-train", "power_iters": "--power-iters", "optimizer": "--optimizer", "lr": "--lr",
    "weight_decay": "--weight-decay", "lr_schedule": "--lr-schedule", "lr_step": "--lr-step", "lr_decay": "--lr-decay",
    "val_fraction": "--val-fraction", "max_batches": "--max-batches", "seed": "--seed", "num_workers": "--workers",
    "lip_objective": "--lip-objective", "lip_target": "--lip-target", "dual_step": "--dual-step",
    "gamma_ramp": "--gamma-ramp", "init_checkpoint": "--init", "gamma_ramp_fraction": "--gamma-ramp-fraction",
    "stability_weight": "--stability-weight", "stability_scale": "--stability-scale",
    "flatness_weight": "--flatness-weight", "radius_weight": "--radius-weight", "radius_target": "--radius-target",
    "radius_beta": "--radius-beta", "radius_ramp_fraction": "--radius-ramp-fraction",
}
_DEMO_TRAIN_OPTIONS = {"sigma": "--sigma", "epochs": "--epochs", "batch_size": "--train-batch",
                       "lambda_start": "--lambda-start", "lambda_end": "--lambda-end", "seed": "--seed",
                       "max_batches": "--max-batches"}


def _train_config(args: argparse.Namespace, options: dict[str, str], recipe: str | None = None):
    """The validated TrainConfig of ``options`` (field -> option) over ``recipe``'s settings (options left unset keep the
    recipe's value, else TrainConfig's default); errors name the option, not the field."""
    from ..training.recipes import recipe_config

    try:
        return recipe_config(recipe, **{field: getattr(args, option[2:].replace("-", "_"))
                                        for field, option in options.items()})
    except (ValueError, TypeError) as err:  # TrainConfig's messages start with the field's name
        field, _, rest = str(err).partition(" ")
        raise type(err)(f"{options.get(field, field)} {rest}") from None


def train_command(args: argparse.Namespace) -> int:
    """``splitz train``; under torchrun, data-parallel over the ranks (:class:`~splitz_fast.runs.torchrun.DataParallelGroup`:
    the same weights as one process, rank 0 writes the files and prints)."""
    from ..data.datasets import get_dataset
    from ..runs.torchrun import TorchrunEnv, process_group
    from ..zoo.models import build_model
    from ..training.recipes import get_recipe
    from ..training.loop import SINGLE_PROCESS, DataParallelGroup, train

    # Validate the settings before touching data or the output folder.
    config = _train_config(args, _TRAIN_OPTIONS, args.recipe)
    _detector_kwargs(args.model, args)
    check_output_folder("OUTDIR", args.outdir)
    env = TorchrunEnv.from_environ()
    if env is None:
        args.device = check_device("--device", args.device or "cpu")
        group, ranks = SINGLE_PROCESS, contextlib.nullcontext()
    else:
        args.device = check_device("--device", env.device(args.device))
        group, ranks = DataParallelGroup(env.rank, env.world_size), process_group(env, args.device)
    info = get_dataset(args.dataset, args.split, root=args.root)
    kwargs = _model_kwargs(args.model, info, args, dict(get_recipe(args.recipe).model) if args.recipe else {})
    torch.manual_seed(args.seed)  # the initial weights are part of the run: seed them
    model = build_model(args.model, **kwargs)
    if model.input_shape != tuple(info.input_shape):
        raise ValueError(f"model {args.model} expects inputs {model.input_shape}, dataset {args.dataset} gives "
                         f"{tuple(info.input_shape)}")
    spec = {"name": args.model, "kwargs": kwargs, "dataset": args.dataset}
    # Recorded only when set, so runs written before these options still resume.
    if args.split != "train":
        spec["split"] = args.split
    if args.recipe is not None:
        spec["recipe"] = args.recipe
    with ranks:
        result = train(model, info.dataset, config, args.outdir, model_spec=spec, device=args.device,
                       resume=args.resume, data_parallel=group, on_epoch_end=lambda r: print(
                           f"epoch {r['epoch']} of 0-{config.epochs - 1}: loss {r['train_loss']:.4f}, val noisy acc "
                           f"{r['val_noisy_acc']:.4f}, L̂ {r['val_lip_estimate']:.3f}, {r['epoch_seconds']:.1f} s",
                           flush=True))
    if group.rank == 0:
        on_ranks = f" on {group.world_size} ranks" if env is not None else ""
        print(f"best epoch {result.best_epoch} (val noisy acc {result.best_val_noisy_acc:.4f}){on_ranks} → "
              f"{Path(args.outdir) / 'best.pt'}")
    return 0


# ---------------------------------------------------------------------------------------------------- certify / predict
#: The ``--split`` that selects the validation images a checkpoint's training run held out.
HELD_OUT_SPLIT = "heldout"


def _held_out_dataset(args: argparse.Namespace, ckpt: dict):
    """The held-out validation part of the training split of the checkpoint's run (no augmentation)."""
    from dataclasses import replace

    from ..data.datasets import evaluation_options, get_dataset
    from ..training.loop import held_out_part

    spec = ckpt.get("model_spec") or {}
    if spec.get("dataset") != args.dataset:
        raise ValueError(f"--split {HELD_OUT_SPLIT} reads the validation images held out when the checkpoint was "
                         f"trained, on {spec.get('dataset')!r}, not {args.dataset!r}")
    info = get_dataset(args.dataset, spec.get("split", "train"), root=args.root, **evaluation_options(args.dataset))
    return replace(info, dataset=held_out_part(info.dataset, ckpt),
                   description=f"{info.description}, the part held out for validation by the checkpoint's run")


def _model_and_dataset(args: argparse.Namespace):
    """The checkpoint's model and the dataset split, refused with a clear message when they do not fit together."""
    from ..data.datasets import class_names_of, get_dataset

    checkpoint_format = getattr(args, "checkpoint_format", "splitz")
    model, ckpt = load_model(args.checkpoint, args.device, format=checkpoint_format)
    if checkpoint_format == "cohen":
        from ..checkpoints.cohen import check_cohen_dataset

        check_cohen_dataset(ckpt, args.dataset)
        if args.split == HELD_OUT_SPLIT:
            raise ValueError(f"--split {HELD_OUT_SPLIT} reads the images a `splitz train` run held out; Cohen et al.'s "
                             "checkpoints do not record theirs: choose a split of the dataset")
    if args.split == HELD_OUT_SPLIT:
        info = _held_out_dataset(args, ckpt)
    else:
        info = get_dataset(args.dataset, args.split, root=args.root)
    if model.input_shape != tuple(info.input_shape) or model.num_classes != info.num_classes:
        raise ValueError(f"checkpoint model takes {model.input_shape} with {model.num_classes} classes, but "
                         f"{args.dataset} has {tuple(info.input_shape)} with {info.num_classes} classes")
    trained_classes, classes = ckpt.get("class_names"), class_names_of(info.dataset)
    if trained_classes is not None and classes is not None and list(trained_classes) != classes:
        k = next((k for k, (a, b) in enumerate(zip(trained_classes, classes)) if a != b), None)
        which = (f"class {k} is {classes[k]!r}, but the checkpoint was trained with {trained_classes[k]!r} as class "
                 f"{k}" if k is not None else f"has {len(classes)} classes, the checkpoint's training set "
                 f"{len(trained_classes)}")
        raise ValueError(f"the {args.split} split's {which}: its labels would name other classes; give a folder with "
                         "the training run's class folders (the same names)")
    trained_sigma = (ckpt.get("config") or {}).get("sigma")
    if getattr(args, "sigma", None) is not None and trained_sigma is not None and trained_sigma != args.sigma:
        # Valid (the certificate is about the classifier smoothed at SIGMA), but usually a slip: say it once.
        print(f"note: SIGMA = {args.sigma:g}, but the checkpoint was trained with sigma = {trained_sigma:g}; the "
              f"results are for the model smoothed at {args.sigma:g}", file=sys.stderr)
    return model, ckpt, info


def _protocol(name: str, dataset: str, lipschitz_factor: float | None = None) -> CertificationProtocol:
    """The protocol ``--protocol NAME`` means for ``dataset``: ``published-code`` reads a model without
    standardization behind the dataset's published normalization (MNIST's std 0.3081) and multiplies its ``L`` by
    ``--published-lipschitz-factor`` (``lipschitz_factor``, default 1), which no other protocol takes."""
    if name == "published-code":
        factor = 1.0 if lipschitz_factor is None else lipschitz_factor
        return PublishedCode(data_std=PUBLISHED_DATA_STD.get(dataset), lipschitz_factor=factor)
    if lipschitz_factor is not None:
        raise ValueError(f"--published-lipschitz-factor belongs to --protocol published-code, not --protocol {name}")
    return get_protocol(name)


@dataclass
class _DatasetRun:
    """What every dataset command (certify, predict, certify-margin, attack) shares once its arguments are checked:
    the model and data, the selected indices, torchrun ranks or a ``--shard``, and the settings every sidecar
    records (dataset, split, selection, model)."""

    args: argparse.Namespace
    model: Any
    info: Any
    indices: list[int]
    env: Any
    shard: Any
    settings: dict[str, Any]

    @classmethod
    def open(cls, args: argparse.Namespace) -> "_DatasetRun":
        from ..runs.loop import select_indices

        check_count("--seed", args.seed, 0)
        check_output_file("OUTFILE", args.outfile)
        env, shard = _sharding(args)
        model, ckpt, info = _model_and_dataset(args)
        indices = select_indices(len(info.dataset), args.skip, args.max)
        settings = {"dataset": args.dataset, "split": args.split, "skip": args.skip, "max": args.max,
                    "model_spec": ckpt.get("model_spec")}
        return cls(args, model, info, indices, env, shard, settings)

    def run(self, task, settings: dict[str, Any]) -> int:
        """``task`` (:mod:`splitz_fast.runs.loop`) over the selection: whole, one ``--shard K/N``, or this torchrun rank's
        shard followed by rank 0's merge."""
        from ..runs.loop import run_over_dataset

        args, indices = self.args, self.indices
        settings = {**self.settings, **settings}

        def run(shard_spec, progress):
            return run_over_dataset(task, self.info.dataset, args.outfile, settings=settings, indices=indices,
                                    seed=args.seed, resume=args.resume, checkpoint=args.checkpoint, shard=shard_spec,
                                    progress=progress,
                                    checkpoint_format=getattr(args, "checkpoint_format", "splitz"))

        what = "inputs" if task.kind == "certify-margin" else "images"
        if self.env is not None:
            from ..runs.torchrun import run_sharded
            from ..runs.loop import finished_output, run_settings

            env = self.env
            # Every rank reads the merged OUTFILE first: without --resume it is refused before any shard starts, and
            # with --resume a finished one (same settings, every row) leaves nothing to do.
            whole = run_settings(task, settings, seed=args.seed, indices=indices, checkpoint=args.checkpoint,
                                 checkpoint_format=getattr(args, "checkpoint_format", "splitz"))
            if finished_output(task, args.outfile, whole, indices, args.resume):
                if env.rank == 0:
                    print(f"{task.kind}: {args.outfile} already holds all {len(indices)} {what}; nothing to do")
                return 0
            merged = run_sharded(env, args.device, args.outfile, lambda spec: run(spec, env.rank == 0))
            if merged is not None:
                ranks = f"{env.world_size} rank{'s' * (env.world_size > 1)}"
                print(f"{task.kind}: {len(indices)} {what} on {ranks} → {merged} (merged from "
                      f"{Path(args.outfile).name}.shard-*-of-{env.world_size})")
        elif self.shard is not None:
            path = run(self.shard, True)
            print(f"{task.kind}: shard {self.shard}, {len(self.shard.select(indices))} of {len(indices)} {what} → "
                  f"{path}; when all {self.shard.count} shards are done: splitz merge {shlex.quote(str(args.outfile))}")
        else:
            run(None, True)
            print(f"{task.kind}: {len(indices)} {what} → {args.outfile}")
        return 0


# --cuda-graphs / --fused-kernels -> Smoother(cuda_graphs=..., fused_kernels=...)
_AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def _smoother(args: argparse.Namespace, selection: bool) -> tuple[_DatasetRun, Smoother, dict[str, Any]]:
    """certify / predict: the sampling options checked under their command-line names and the bound options built
    (before the model and data are loaded), the run, the Smoother and the settings its sidecar records.
    ``selection``: the command draws ``--N0``."""
    check_positive("SIGMA", args.sigma)
    if args.batch is not None:
        check_count("--batch", args.batch)
    check_count("--N", args.N)
    if selection and not args.sequential:
        check_count("--N0", args.N0)
        if args.N0 > args.N:
            raise ValueError(f"--N0 ({args.N0}) must not exceed --N ({args.N})")
    check_probability("--alpha", args.alpha)
    bound_options = _bound_options(args)
    protocol_name = getattr(args, "protocol", "sound")
    factor = getattr(args, "published_lipschitz_factor", None)
    if factor is not None:
        check_positive("--published-lipschitz-factor", factor)
    protocol = _protocol(protocol_name, args.dataset, factor)
    run = _DatasetRun.open(args)
    for flag, value in (("--cuda-graphs", args.cuda_graphs), ("--fused-kernels", args.fused_kernels)):
        if value == "on" and torch.device(args.device).type != "cuda":
            raise ValueError(f"{flag} on needs a CUDA device (this run samples on {args.device}): pass --device "
                             f"cuda, or {flag} auto / off")
    smoother = Smoother(run.model, args.sigma, bound_options=bound_options, precision=args.precision,
                        compile=args.compile, cuda_graphs=_AUTO_ON_OFF[args.cuda_graphs],
                        fused_kernels=_AUTO_ON_OFF[args.fused_kernels], protocol=protocol)
    settings = {"bound": smoother.bound, "bound_method": smoother.bound_method, "gamma_search": smoother.gamma_search}
    if smoother.precision != "float32":  # recorded only when set, so files written before the option still resume
        settings["precision"] = smoother.precision
    if smoother.options.gamma_batch != 2:  # changes which γ are evaluated (and so the radii)
        settings["gamma_batch"] = smoother.options.gamma_batch
    if unfolded_batchnorms(run.model.right):  # sampled with unfolded BatchNorm: recorded only then (files resume)
        settings["bn_folded"] = False
    return run, smoother, settings


def _sharding(args: argparse.Namespace):
    """``(torchrun ranks or None, ShardSpec or None)`` of a certify/predict run; sets ``args.device`` to the device
    this process uses (under torchrun: its local rank's GPU, see :meth:`TorchrunEnv.device`)."""
    from ..runs.torchrun import TorchrunEnv
    from ..runs.loop import ShardSpec

    env = TorchrunEnv.from_environ()
    shard = None if args.shard is None else ShardSpec.parse(args.shard)
    if env is None:
        args.device = check_device("--device", args.device or "cpu")
        return None, shard
    if shard is not None:
        raise ValueError(f"--shard splits a run into separate jobs; under torchrun (WORLD_SIZE={env.world_size}) the "
                         "ranks already are the shards: drop --shard, or run each shard without torchrun")
    args.device = check_device("--device", env.device(args.device))
    if Path(args.outfile).exists() and not args.resume:
        raise FileExistsError(f"{args.outfile} exists; pass --resume to continue it, or choose another OUTFILE")
    return env, None


def _sequential_budget(args: argparse.Namespace) -> int:
    """The checked sample budget of ``certify --sequential`` (``--budget``, else ``--N``) and its ``--radii``."""
    if not args.radii:
        raise ValueError("--sequential needs --radii: the input-space radii to decide, e.g. --radii 0.5 1 1.5 2")
    bad = [r for r in args.radii if not (r > 0 and r != float("inf"))]
    if bad:
        raise ValueError(f"--radii must be finite and > 0 (raw input units), got {bad}")
    name, budget = ("--budget", args.budget) if args.budget is not None else ("--N", args.N)
    check_count(name, budget)
    check_count("--N0", args.N0)
    if args.N0 > budget:
        raise ValueError(f"--N0 ({args.N0}) must not exceed {name} ({budget}), the sequential sample budget")
    return budget


def certify_command(args: argparse.Namespace) -> int:
    from ..runs.loop import CertifyRun

    if args.sequential:
        budget = _sequential_budget(args)
        if getattr(args, "protocol", "sound") != "sound":
            raise ValueError(f"--sequential decides certificates; --protocol {args.protocol} is an estimate")
    elif args.radii is not None or args.budget is not None:
        raise ValueError("--radii and --budget belong to sequential certification: add --sequential")
    run, smoother, settings = _smoother(args, selection=True)
    if not args.sequential:
        return run.run(CertifyRun(smoother, args.N0, args.N, args.alpha, args.batch), settings)
    # recorded only when set, so files written before the option still resume
    settings.update(sequential=True, radii=list(args.radii), budget=budget)
    return run.run(CertifyRun(SequentialCertifier(smoother, args.radii), args.N0, budget, args.alpha, args.batch),
                   settings)


def certify_margin_command(args: argparse.Namespace) -> int:
    """Deterministic margin certificates for a model trained with the whole classifier in f_L."""
    from ..runs.loop import MarginRun

    bound_options = _bound_options(args)
    run = _DatasetRun.open(args)
    certifier = MarginCertifier(run.model, bound_options=bound_options)
    return run.run(MarginRun(certifier), {"certifier": "margin", "bound": certifier.bound,
                                          "bound_method": certifier.bound_method,
                                          "gamma_search": certifier.gamma_search})


def predict_command(args: argparse.Namespace) -> int:
    from ..runs.loop import PredictRun

    run, smoother, settings = _smoother(args, selection=False)
    return run.run(PredictRun(smoother, args.N, args.alpha, args.batch), settings)


def attack_command(args: argparse.Namespace) -> int:
    """l2 attacks (:mod:`splitz_fast.certify.attacks`) on each selected input; PREDICT decides the clean and attacked points."""
    from ..certify.attacks import Attacker
    from ..runs.loop import AttackRun

    check_positive("SIGMA", args.sigma)
    check_positive("--eps", args.eps)
    for name in ("steps", "samples", "group", "N"):
        check_count(f"--{name}", getattr(args, name))
    if args.step_size is not None:
        check_positive("--step-size", args.step_size)
    if args.clamp is not None and not args.clamp[0] < args.clamp[1]:
        raise ValueError(f"--clamp must be LO HI with LO < HI, got {args.clamp[0]} {args.clamp[1]}")
    if args.batch is not None:
        check_count("--batch", args.batch)
    check_probability("--alpha", args.alpha)
    run = _DatasetRun.open(args)
    attacker = Attacker(Smoother(run.model, args.sigma), args.attack, args.eps, steps=args.steps,
                        step_size=args.step_size, samples=args.samples, random_start=args.random_start,
                        clamp=args.clamp, evaluate=args.evaluate, group=args.group)
    return run.run(AttackRun(attacker, args.N, args.alpha, args.batch), attacker.settings())


def merge_command(args: argparse.Namespace) -> int:
    """Join the shards of one certify/predict run (``--shard K/N``) into OUTFILE, sorted by idx."""
    from ..runs.loop import ShardData, merge_shards, shard_files

    out = check_output_file("OUTFILE", args.outfile)
    paths = [Path(p) for p in args.shards] if args.shards else shard_files(out)
    given = {str(p) for p in paths}  # `OUTFILE.shard-*` also matches the sidecars: they come with their shards
    paths = [p for p in paths if not (p.suffix == ".json" and str(p.with_suffix("")) in given)]
    if out.resolve() in {p.resolve() for p in paths}:
        raise ValueError(f"OUTFILE {str(out)!r} is also given as a shard; name the merged file first")
    merged = merge_shards(out, [ShardData.read(p) for p in paths])
    rows = merged.read_text().count("\n") - 1
    print(f"merge: {len(paths)} shards, {rows} rows → {merged}")
    return 0


# ---------------------------------------------------------------------------------------------------- analyze
def analyze_command(args: argparse.Namespace) -> int:
    from ..analysis.tables import analyze

    if args.names and len(args.names) != len(args.files):
        raise ValueError(f"--names gives {len(args.names)} names for {len(args.files)} files")
    if args.names and len(set(args.names)) != len(args.names):
        raise ValueError(f"--names gives a name twice ({', '.join(args.names)}): one name per run")
    runs = dict(zip(args.names, args.files)) if args.names else list(args.files)
    print(analyze(runs, args.radii, out_dir=args.out))
    return 0


def diagnose_command(args: argparse.Namespace) -> int:
    from ..analysis.tables import read_certification
    from ..analysis.diagnostics import diagnose, diagnostics_report
    from ..checkpoints.splitz import checkpoint_digest

    table = read_certification(args.certification)  # first: a missing TSV is named as such, not as a missing sidecar
    try:
        sidecar = read_settings_file(args.certification + ".json")
    except ValueError as err:
        raise ValueError(f"{args.certification}: its sidecar {err}; diagnose needs the one `splitz certify` wrote "
                         "(it records which images were certified)") from None
    missing = [key for key in ("dataset", "split", "sigma") if key not in sidecar]
    if missing:
        raise ValueError(f"{args.certification}: its sidecar records no {', '.join(missing)}; diagnose reads a "
                         "`splitz certify` run")
    args.dataset, args.split = sidecar["dataset"], sidecar["split"]
    args.checkpoint_format = sidecar.get("checkpoint_format", "splitz")
    model, ckpt, info = _model_and_dataset(args)
    if checkpoint_digest(ckpt) != sidecar.get("checkpoint_digest"):
        raise ValueError(f"{args.certification} was certified with another model than {args.checkpoint} "
                         "(checkpoint digests differ); give the checkpoint that was certified")
    title = f"{Path(args.certification).stem} (σ = {sidecar['sigma']:g})"
    print(diagnostics_report(diagnose(model, info.dataset, table), title, out_dir=args.out))
    return 0


def envelope_command(args: argparse.Namespace) -> int:
    from ..analysis.envelope import MNIST_REFERENCES, envelope_report, load_group

    groups = {}
    for name, *files in args.group:
        if not files:
            raise ValueError(f"--group {name} names no certification files; give NAME FILE [FILE ...]")
        if name in groups:
            raise ValueError(f"--group {name} is given twice; give each method's files once")
        groups[name] = load_group(files)
    references = MNIST_REFERENCES if args.references == "mnist" else ()
    print(envelope_report(groups, args.radii, references, out_dir=args.out))
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show (unset, flags, required)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads`` of every command that computes: torch's intra-op threads (``torch.set_num_threads``)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"torch threads of this process (each rank under torchrun); unset, torch's default "
                             f"({torch.get_num_threads()} here). Trained weights depend on it (float sums are split "
                             "differently); on a machine shared with other jobs fewer threads can be much faster")


def _add_max_option(parser: argparse.ArgumentParser, what: str) -> None:
    """Cohen's ``--max``, also spelled ``--max-inputs``: torchrun's own parser reads ``--max`` (and ``--max=N``) after
    ``-m splitz_fast`` as an abbreviation of its ``--max-restarts`` and stops, so under torchrun only the long
    spelling gets through."""
    parser.add_argument("--max", "--max-inputs", dest="max", type=int, default=-1, metavar="MAX",
                        help=f"at most MAX {what}, -1 = all (a count: Cohen's scripts stop at dataset index MAX, so "
                             "his --skip 20 --max 100 is --skip 20 --max 5 here; under torchrun write --max-inputs: "
                             "torchrun takes --max for its --max-restarts)")


def _add_checkpoint_format_option(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint-format`` of the commands that certify or attack a smoothed classifier."""
    from ..checkpoints.splitz import CHECKPOINT_FORMATS
    from ..checkpoints.cohen import COHEN_ARCHS

    archs = ", ".join(f"{name} ({arch.dataset})" for name, arch in COHEN_ARCHS.items())
    parser.add_argument("--checkpoint-format", choices=CHECKPOINT_FORMATS, default="splitz",
                        help="splitz: CHECKPOINT was written by `splitz train`. cohen: a checkpoint.pth.tar of "
                             "Cohen et al.'s randomized smoothing code (locuslab/smoothing; SmoothAdv, MACER, ... "
                             f"built on it), arch {archs}, certified at split 0 behind that code's normalisation; it "
                             "does not record σ, so SIGMA must be the σ it was trained at, and DATASET its dataset")


def _add_sharding_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--shard`` of the commands that run over a dataset (certify, predict, certify-margin)."""
    parser.add_argument("--device", default=None,
                        help="cpu, or cuda / cuda:N where a GPU is present; unset, cpu (under torchrun: each rank's "
                             "cuda:LOCAL_RANK when CUDA is available)")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run only shard K of N (0 <= K < N: every N-th selected input from the K-th) into "
                             "OUTFILE.shard-K-of-N, e.g. --shard $SLURM_ARRAY_TASK_ID/8; then `splitz merge OUTFILE`. "
                             "Under torchrun the ranks are the shards and rank 0 merges")


def _dataset_help() -> str:
    from ..data.datasets import DATASETS

    return f"dataset name: {', '.join(DATASETS)}"


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


def _add_train_parser(sub) -> None:
    """``splitz train``: SPLITZ (or RS) training with a named recipe and its overrides."""
    from ..zoo.models import MODELS
    from ..training.recipes import RECIPES
    from ..training.loop import LIP_OBJECTIVES

    dataset_help = _dataset_help()
    t = sub.add_parser("train", help="train a SPLITZ model (or the RS baseline with --split-index 0)",
                       formatter_class=_HelpFormatter)
    t.add_argument("dataset", help=dataset_help)
    t.add_argument("model", help=f"model name: {', '.join(MODELS)}")
    t.add_argument("outdir", help="run folder: last.pt, best.pt, train.log")
    t.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
    t.add_argument("--split", default="train",
                   help="dataset split to train on (--val-fraction of it is held out); another split only for smoke "
                        "runs, e.g. cifar10-samples, whose 20 images are test images")
    t.add_argument("--recipe", choices=tuple(RECIPES), default=None,
                   help="named settings with their source (splitz_fast.training.recipes; options below override them): "
                        + "; ".join(f"{r.name}: {r.source}" for r in RECIPES.values()))
    t.add_argument("--init", default=None, metavar="CHECKPOINT",
                   help="warm start: copy this checkpoint's affine layers (same architecture and σ; recipe warm-start)")
    # Options a recipe sets default to None: unset, they take the recipe's value, else TrainConfig's (the paper's).
    t.add_argument("--split-index", type=int, default=None,
                   help="affine layers in f_L; 0 = plain RS (unset: the recipe's, else 1)")
    t.add_argument("--threshold", type=float, default=None,
                   help="clipped-ReLU threshold θ in f_L (inf keeps a pretrained network's outputs; unset: 1)")
    t.add_argument("--learnable-threshold", action=argparse.BooleanOptionalAction, default=None,
                   help="learn θ (projected to >= 0; unset: the recipe's, else fixed)")
    t.add_argument("--threshold-per-element", action=argparse.BooleanOptionalAction, default=None,
                   help="one θ per element of f_L's activations (lenet, mlp; unset: the recipe's, else one per layer)")
    t.add_argument("--detectors", type=int, default=None,
                   help="lenet-rs-init: detector channels of f_L, beside its identity channel (unset: 8)")
    t.add_argument("--detector-kernel", type=int, default=None,
                   help="lenet-rs-init: odd kernel size of f_L's convolution (unset: 7)")
    t.add_argument("--sigma", type=float, required=True, help="training noise σ (train at the test σ)")
    t.add_argument("--epochs", type=int, default=10,
                   help="training epochs, numbered from 0 to EPOCHS-1 (messages, train.log, a checkpoint's epoch)")
    t.add_argument("--batch", type=int, default=512,
                   help="training batch size (under torchrun: the global batch, shared out over the ranks)")
    t.add_argument("--noise-samples", type=int, default=1, help="Q noise draws per input")
    t.add_argument("--lambda-start", type=float, default=None,
                   help="λ at the first epoch (unset: the recipe's, else 0.8)")
    t.add_argument("--lambda-end", type=float, default=None, help="λ at the last epoch (unset: the recipe's, else 0.4)")
    t.add_argument("--lip-objective", choices=tuple(LIP_OBJECTIVES), default=None,
                   help="how the estimate L̂ enters the loss (unset: the recipe's, else per-sample-hinge)")
    t.add_argument("--theta-lip", type=float, default=None, help="hinge threshold θ_lip (unset: the recipe's, else 0.5)")
    t.add_argument("--lip-target", type=float, default=None,
                   help="lagrangian objective: target L* of the mean estimate (unset: the recipe's, else 0.5)")
    t.add_argument("--dual-step", type=float, default=None,
                   help="lagrangian objective: multiplier step per training step (unset: the recipe's, else 0.01)")
    t.add_argument("--gamma-train", type=float, default=None,
                   help="γ of the training estimate (unset: the recipe's, else 0.1)")
    t.add_argument("--gamma-ramp", action=argparse.BooleanOptionalAction, default=None,
                   help="ramp γ linearly from 0 to --gamma-train over the epochs (unset: the recipe's, else off)")
    t.add_argument("--gamma-ramp-fraction", type=float, default=None,
                   help="ramp γ per step, reaching --gamma-train after this share of training (unset: the recipe's)")
    t.add_argument("--stability-weight", type=float, default=None,
                   help="weight of the term rewarding neurons constant on the training ball (unset: the recipe's, "
                        "else 0)")
    t.add_argument("--stability-scale", type=float, default=None,
                   help="τ of the stability term, pre-activation units (unset: the recipe's, else 1)")
    t.add_argument("--flatness-weight", type=float, default=None,
                   help="weight of the term pulling f_L's masked spectrum flat, log(L̂² n / ‖A‖_F²); one-layer f_L "
                        "(unset: the recipe's, else 0)")
    t.add_argument("--radius-weight", type=float, default=None,
                   help="weight of the MACER-style term max(0, target − r̃) on the soft SPLITZ radius r̃ = min(γ, "
                        "σΦ⁻¹(p̃_A)/L̂(x, γ)) of inputs the soft smoothed classifier gets right (unset: the recipe's, "
                        "else 0)")
    t.add_argument("--radius-target", type=float, default=None,
                   help="radius the radius term asks for, raw input units (unset: the recipe's, else 2.0)")
    t.add_argument("--radius-beta", type=float, default=None,
                   help="inverse temperature β of the radius term's soft classifier (unset: the recipe's, else 16)")
    t.add_argument("--radius-ramp-fraction", type=float, default=None,
                   help="ramp the radius term's weight from 0 over this share of training steps; 0 = no ramp "
                        "(unset: the recipe's, else 0.5)")
    t.add_argument("--power-iters", type=int, default=None,
                   help="power steps per training step (unset: the recipe's, else 5)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer (sgd: momentum 0.9)")
    t.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    t.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")
    t.add_argument("--lr-schedule", choices=("step", "half-cosine", "cosine", "none"), default="step",
                   help="learning-rate schedule")
    t.add_argument("--lr-step", type=int, default=50, help="epochs between ×lr-decay steps")
    t.add_argument("--lr-decay", type=float, default=0.1, help="factor of each step of the step schedule")
    t.add_argument("--val-fraction", type=float, default=0.1, help="held-out share of train for early stop")
    t.add_argument("--max-batches", type=int, default=None, help="batches per epoch cap (quick runs; default: all)")
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights, data order and noise")
    t.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers (datasets with per-item transforms; in-memory ones are indexed directly)")
    t.add_argument("--device", default=None,
                   help="cpu, or cuda / cuda:N where a GPU is present; unset, cpu (under torchrun: each rank's "
                        "cuda:LOCAL_RANK when CUDA is available)")
    t.add_argument("--resume", action="store_true", help="continue OUTDIR/last.pt (same settings only)")
    _add_threads_option(t)
    t.set_defaults(func=train_command)


def _add_certify_predict_parser(sub) -> None:
    """``splitz certify`` and ``splitz predict``: Cohen's protocol over a dataset."""
    dataset_help = _dataset_help()
    for name, func, helptext in (("certify", certify_command, "Cohen's CERTIFY with the SPLITZ radius"),
                                 ("predict", predict_command, "Cohen's PREDICT")):
        c = sub.add_parser(name, help=helptext, formatter_class=_HelpFormatter)
        c.add_argument("dataset", help=dataset_help)
        c.add_argument("checkpoint", help="best.pt or last.pt written by `splitz train`, or with --checkpoint-format "
                                          "cohen a checkpoint of Cohen et al.'s code")
        c.add_argument("sigma", type=float, help="noise level σ")
        c.add_argument("outfile", help="TSV output (a sidecar OUTFILE.json records the settings)")
        c.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
        c.add_argument("--batch", type=int, default=None,
                       help="noise samples per forward pass of f_R; unset, the fastest batch measured on this device "
                            "(up to 4096, or 32768 on CUDA) is used. It never changes an image's noise, which "
                            "depends only on its seed (only f_R's float rounding)")
        c.add_argument("--skip", type=int, default=1, help="every SKIP-th image")
        _add_max_option(c, "images")
        c.add_argument("--split", default="test",
                       help=f"dataset split, or {HELD_OUT_SPLIT}: the validation images the checkpoint's training run "
                            "held out (model selection without test data)")
        if name == "certify":
            c.add_argument("--N0", type=int, default=100, help="selection samples")
        c.add_argument("--N", type=int, default=100_000, help="estimation samples")
        c.add_argument("--alpha", type=float, default=0.001, help="failure probability")
        if name == "certify":
            c.add_argument("--gamma-search", choices=GAMMA_SEARCHES, default="bisection",
                           help="how γ is searched (every evaluated γ gives a valid radius)")
            c.add_argument("--gamma-batch", type=int, default=2,
                           help="bisection: γ candidates per batched bound pass, a power of two (2 = classic "
                                "bisection; 4 = a superset of its points in half the passes; 8, ...)")
            c.add_argument("--bound", choices=BOUNDS, default="local",
                           help="local L(x, γ) or the global product of norms")
            c.add_argument("--bound-method", choices=BOUND_METHODS, default="auto",
                           help="exact (deterministic) or probabilistic (δ added to α); auto picks by size")
            c.add_argument("--sequential", action="store_true",
                           help="anytime-valid sequential certification: decide each radius of --radii with a "
                                "confidence sequence and stop sampling once all are decided (same α, same TSV)")
            c.add_argument("--radii", type=float, nargs="+", default=None,
                           help="with --sequential: input-space l2 radii to decide, e.g. 0.5 1 1.5 2")
            c.add_argument("--budget", type=int, default=None,
                           help="with --sequential: most estimation samples per image; --N when unset")
            c.add_argument("--protocol", choices=tuple(PROTOCOLS), default="sound",
                           help="sound: a certificate; displacement: a certificate never smaller than sound (the "
                                "latent-displacement bound of clipped neurons; slower). paper (Algorithm 1: masked "
                                "5-step power iteration, one-step "
                                "γ) and published-code (the published code: no masks, radius in standardized units) "
                                "are ESTIMATES, NOT CERTIFICATES, for comparing with the paper's numbers: every row's "
                                "bound column and the sidecar say so")
            c.add_argument("--published-lipschitz-factor", type=float, default=None, metavar="C",
                           help="with --protocol published-code: multiply its L by C, the published code's "
                                "normalisation constant (its stored versions disagree: 0.2023 multiplies, 1/0.2023 "
                                "divides; unset: 1). Recorded in the sidecar")
        c.add_argument("--precision", choices=tuple(PRECISIONS), default="float32",
                       help="how f_R computes while sampling (noise stays float32): float32 is IEEE float32 also on "
                            "CUDA; tf32 uses TF32 tensor cores on CUDA (a different base classifier, recorded)")
        c.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="sample f_R's full batches through torch.compile(f_R) at their static shape from the first "
                            "batch (--compile) or never (--no-compile); unset: on CUDA once the run has sampled for a "
                            "minute at its batch size, where the compiled f_R then measures faster. Eager, with a "
                            "warning, where compiling fails or the compiled f_R scores differently")
        c.add_argument("--cuda-graphs", choices=tuple(_AUTO_ON_OFF), default="auto",
                       help="on CUDA, replay f_R as a CUDA graph at the static batch: auto (default) where it measures "
                            "faster than eager, on, off (the same base classifier either way)")
        c.add_argument("--fused-kernels", choices=tuple(_AUTO_ON_OFF), default="auto",
                       help="on CUDA, sample through f_R with its convolution epilogues fused (conv + bias + ReLU "
                            "(+ shortcut) as one cuDNN call, conv + ReLU + 2x2 pool as one Triton kernel): auto "
                            "(default) where it scores like the plain f_R and measures faster, on, off (the same "
                            "function; rounding may differ in the last bits)")
        c.add_argument("--seed", type=int, default=0, help="base seed; image i uses SEED+i")
        c.add_argument("--resume", action="store_true", help="continue an interrupted OUTFILE (same settings only)")
        _add_checkpoint_format_option(c)
        _add_sharding_options(c)
        _add_threads_option(c)
        c.set_defaults(func=func)


def _add_merge_parser(sub) -> None:
    """``splitz merge``: join the shards of a run."""
    g = sub.add_parser("merge", help="join the shards of a certify/predict run (--shard K/N) into one TSV",
                       formatter_class=_HelpFormatter)
    g.add_argument("outfile", help="merged TSV (rows sorted by idx) and its sidecar OUTFILE.json")
    g.add_argument("shards", nargs="*",
                   help="shard files; default: every OUTFILE.shard-K-of-N beside OUTFILE. Refused: shards of other "
                        "settings or checkpoints, missing, duplicated or incomplete shards")
    g.set_defaults(func=merge_command)


def _add_certify_margin_parser(sub) -> None:
    """``splitz certify-margin``: logit-margin certificates of a whole-f_L model."""
    dataset_help = _dataset_help()
    m = sub.add_parser("certify-margin", help="deterministic logit-margin certificates (no smoothing) for a model "
                                              "whose whole classifier is in f_L (the Lipschitz-only baseline)",
                       formatter_class=_HelpFormatter)
    m.add_argument("dataset", help=dataset_help)
    m.add_argument("checkpoint", help="best.pt or last.pt written by `splitz train` with --split-index = all layers")
    m.add_argument("outfile", help="TSV output (Cohen's columns; pA_lower is nan, R_latent is margin/√2)")
    m.add_argument("--root", default=None, help="dataset folder")
    m.add_argument("--skip", type=int, default=1, help="every SKIP-th input")
    _add_max_option(m, "inputs")
    m.add_argument("--split", default="test", help="dataset split")
    m.add_argument("--gamma-search", choices=GAMMA_SEARCHES, default="bisection",
                   help="how γ is searched (every evaluated γ gives a valid radius)")
    m.add_argument("--bound", choices=BOUNDS, default="local",
                   help="local L(x, γ) or the global product of norms")
    m.add_argument("--bound-method", choices=BOUND_METHODS, default="auto",
                   help="exact (deterministic) or probabilistic; auto picks by size")
    m.add_argument("--seed", type=int, default=0, help="seeds probabilistic bounds only")
    m.add_argument("--resume", action="store_true", help="continue an interrupted OUTFILE (same settings only)")
    _add_sharding_options(m)
    _add_threads_option(m)
    m.set_defaults(func=certify_margin_command)


def _add_attack_parser(sub) -> None:
    """``splitz attack``: l2 attacks with PREDICT at the clean and attacked points."""
    from ..certify.attacks import ATTACKS

    dataset_help = _dataset_help()
    k = sub.add_parser("attack", help="l2 attacks on the smoothed classifier (smooth-pgd, smooth-fgsm) or the base "
                                      "classifier (pgd, fgsm, deepfool); PREDICT decides clean and attacked points",
                       formatter_class=_HelpFormatter)
    k.add_argument("dataset", help=dataset_help)
    k.add_argument("checkpoint", help="best.pt or last.pt written by `splitz train`, or with --checkpoint-format "
                                      "cohen a checkpoint of Cohen et al.'s code")
    k.add_argument("sigma", type=float, help="noise level σ of the smoothed classifier")
    k.add_argument("outfile", help="TSV: idx label clean_predict adv_predict eps delta_norm success time (a sidecar "
                                   "OUTFILE.json records the settings)")
    k.add_argument("--attack", choices=ATTACKS, default="smooth-pgd",
                   help="smooth-*: gradients of the Monte Carlo soft smoothed classifier through f_L and f_R")
    k.add_argument("--eps", type=float, required=True, help="l2 budget in raw input units")
    k.add_argument("--steps", type=int, default=20, help="PGD / DeepFool iterations")
    k.add_argument("--step-size", type=float, default=None, help="PGD step as a fraction of eps; unset, 2.5/steps")
    k.add_argument("--samples", type=int, default=32, help="noise draws per gradient step (smooth-* attacks)")
    k.add_argument("--random-start", action="store_true", help="PGD from a uniform point of the eps ball")
    k.add_argument("--clamp", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="keep attacked inputs in [LO, HI] (e.g. 0 1 for images)")
    k.add_argument("--evaluate", choices=("smoothed", "base"), default="smoothed",
                   help="predictions in the TSV: PREDICT of the smoothed classifier, or the base classifier's argmax")
    k.add_argument("--group", type=int, default=8, help="inputs attacked together in one batch (rows unchanged)")
    k.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
    k.add_argument("--batch", type=int, default=None, help="noise samples per forward pass of f_R in PREDICT")
    k.add_argument("--skip", type=int, default=1, help="every SKIP-th input")
    _add_max_option(k, "inputs")
    k.add_argument("--split", default="test", help="dataset split")
    k.add_argument("--N", type=int, default=10_000, help="PREDICT samples at the clean and at the attacked point")
    k.add_argument("--alpha", type=float, default=0.001, help="PREDICT's significance level")
    k.add_argument("--seed", type=int, default=0, help="base seed; input i uses SEED+i (attack and PREDICT offsets)")
    k.add_argument("--resume", action="store_true", help="continue an interrupted OUTFILE (same settings only)")
    _add_checkpoint_format_option(k)
    _add_sharding_options(k)
    _add_threads_option(k)
    k.set_defaults(func=attack_command)


def _add_analyze_parser(sub) -> None:
    """``splitz analyze``: tables and plots from certify TSVs."""
    a = sub.add_parser("analyze", help="certified accuracy / ACR tables and plots from certify TSVs",
                       formatter_class=_HelpFormatter)
    a.add_argument("files", nargs="+", help="certification TSVs (Cohen's six columns first)")
    a.add_argument("--names", nargs="+", default=None, help="one display name per file; file names when omitted")
    a.add_argument("--radii", type=float, nargs="+", default=DEMO_RADII,
                   help="l2 radii (input units, >= 0) at which to report certified accuracy")
    a.add_argument("--out", default=None, help="folder for table.md, table.tex and the plot (PNG and PDF)")
    a.set_defaults(func=analyze_command)


def _add_diagnose_parser(sub) -> None:
    """``splitz diagnose``: what explains a SPLITZ model's certificates."""
    x = sub.add_parser("diagnose", help="what explains a SPLITZ model's certificates: L(x, γ*), p_A and the neurons "
                                        "of f_L constant on the ball, per certified input", formatter_class=_HelpFormatter)
    x.add_argument("checkpoint", help="the checkpoint that was certified")
    x.add_argument("certification", help="its SPLITZ certify TSV (dataset and split are read from the sidecar)")
    x.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
    x.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N where a GPU is present")
    x.add_argument("--out", default=None, help="folder for diagnostics.md/.tsv and the histograms")
    _add_threads_option(x)
    x.set_defaults(func=diagnose_command)


def _add_envelope_parser(sub) -> None:
    """``splitz envelope``: best-σ envelopes of methods."""
    e = sub.add_parser("envelope", help="best-σ envelopes of methods (one certify TSV per σ) with reference lines",
                       formatter_class=_HelpFormatter)
    e.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "FILE"),
                   help="a method's name, then its certification TSVs, one per σ (σ read from each sidecar); repeat "
                        "for each method; same-σ differences are second group − first")
    e.add_argument("--radii", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 2.0, 2.5],
                   help="l2 radii ε (input units) of the table")
    e.add_argument("--references", choices=("mnist", "none"), default="none",
                   help="published lines to show: mnist = the literature's RS envelope and best trained RS (LeNet, "
                        "n = 10⁵, full test set)")
    e.add_argument("--out", default=None, help="folder for envelope.md and envelope.png/.pdf")
    e.set_defaults(func=envelope_command)


#: How long a torchrun rank other than 0 waits before it exits with an error (:func:`_print_error`).
RANK_ERROR_EXIT_DELAY = 2.0


def _print_error(line: str) -> None:
    """An error line on stderr, once per torchrun job. The ranks of a command mostly fail alike (the same arguments
    and files), so under torchrun only rank 0 prints; every rank also writes its line to its torchrun error file
    (``TORCHELASTIC_ERROR_FILE``), which torchrun's failure report shows (``traceback : error: ...``), so a line of
    another rank alone is not lost. The other ranks then wait :data:`RANK_ERROR_EXIT_DELAY` seconds before exiting:
    torchrun stops every rank as soon as one exits, and rank 0, failing alike, must get to print first. Without an
    error file to write (no torchrun), every process prints at once."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The format of torch.distributed.elastic's ErrorHandler, without a Python call stack: the report shows the line.
        record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps(record))
    if not error_file or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(RANK_ERROR_EXIT_DELAY)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, with a pointer to ``--help`` instead of the usage
    (exit status 2, as argparse's; once per torchrun job, :func:`_print_error`)."""

    def error(self, message: str):
        _print_error(f"{self.prog}: error: {message} — see `{self.prog} --help`")
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``splitz`` parser: one builder per verb (each verb's parser a :class:`_Parser` too)."""
    parser = _Parser(prog="splitz", description="SPLITZ: split Lipschitz randomized smoothing")
    parser.add_argument("--version", action="version", version=f"splitz_fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_demo_parser, _add_train_parser, _add_certify_predict_parser, _add_merge_parser,
                _add_certify_margin_parser, _add_attack_parser, _add_analyze_parser, _add_diagnose_parser,
                _add_envelope_parser):
        add(sub)
    return parser

def _stopped_at(args: argparse.Namespace) -> str:
    """Where an interrupted run stopped, read from what it keeps on disk (flushed rows, per-epoch checkpoints)."""
    if args.command == "train":
        log = Path(args.outdir) / "train.log"
        epochs = len(log.read_text().splitlines()) if log.is_file() else 0
        return f"{epochs} of {args.epochs} epochs finished in {args.outdir}"
    if args.command == "demo":
        return f"finished parts are kept in {args.out}"
    if args.command in ("analyze", "merge"):
        return "nothing to keep"
    out = Path(args.outfile)
    shard = _shard_being_written(args)
    if shard is not None:
        out = shard.path(out)
    rows = max(0, out.read_text().count("\n") - 1) if out.is_file() else 0  # complete lines after the header
    return f"{rows} rows in {out}"


def _shard_being_written(args: argparse.Namespace):
    """The shard a certify/predict process writes (``--shard``, or its torchrun rank), else ``None``."""
    from ..runs.torchrun import TorchrunEnv
    from ..runs.loop import ShardSpec

    try:
        env = TorchrunEnv.from_environ()
        return env.shard if env is not None else ShardSpec.parse(args.shard) if getattr(args, "shard", None) else None
    except ValueError:
        return None


def _continue_command(args: argparse.Namespace, argv: list[str]) -> str:
    words = list(argv)
    if getattr(args, "resume", None) is False:  # demo resumes by itself and analyze has nothing to resume
        words.append("--resume")
    if os.environ.get("WORLD_SIZE") and os.environ.get("RANK"):
        return f"the same torchrun command with: -m splitz_fast {shlex.join(words)}"
    return "splitz " + shlex.join(words)


def _typed_options(argv: list[str]) -> dict[str, str]:
    """``dest -> option`` for every option typed in ``argv`` (abbreviations and ``--opt=value`` included), defaults
    left out: the same parser with every default suppressed."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    options = {}
    for sub in commands.values():
        for action in sub._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
                options[action.dest] = action.option_strings[0]
    return {dest: options[dest] for dest in vars(parser.parse_args(argv)) if dest in options}


def _bound_options(args: argparse.Namespace) -> BoundOptions:
    """The certifier's :class:`~splitz_fast.bounds.radius.BoundOptions`, built (and so validated) once from the parsed
    options: each option is the field of the same name (``--bound-method`` is ``bound_method``); a field the command
    has no option for keeps its default. Options typed together where one does nothing were refused before
    (:data:`_CONFLICTS`)."""
    given = {field.name: getattr(args, field.name) for field in fields(BoundOptions) if hasattr(args, field.name)}
    try:
        return BoundOptions(**given)
    except (ValueError, TypeError) as err:  # BoundOptions' messages start with the field's name: name the option
        field, _, rest = str(err).partition(" ")
        option = f"--{field.replace('_', '-')}" if field in given else field
        raise type(err)(f"{option} {rest}") from None


_PGD = ("pgd", "smooth-pgd")
#: command -> (options, the setting under which they do nothing, why): typed together, they are refused.
_CONFLICTS = {
    "certify": (
        (("gamma_batch",), lambda a: a.gamma_search == "one-step", "--gamma-search one-step",
         "--gamma-batch groups the bisection's γ points; the one-step search evaluates two γ, one after the other"),
        (("gamma_search", "gamma_batch"), lambda a: a.bound == "global", "--bound global",
         "the global bound does not depend on γ, so no γ is searched"),
    ),
    "certify-margin": (
        (("gamma_search",), lambda a: a.bound == "global", "--bound global",
         "the global bound does not depend on γ, so no γ is searched"),
    ),
    "attack": (
        (("steps",), lambda a: a.attack in ("fgsm", "smooth-fgsm"), "--attack {attack}", "FGSM takes one step"),
        (("step_size", "random_start"), lambda a: a.attack not in _PGD, "--attack {attack}",
         "only the PGD attacks take a step size and a random start"),
        (("samples",), lambda a: not a.attack.startswith("smooth-"), "--attack {attack}",
         "it attacks the base classifier, without noise samples"),
        (("N", "alpha", "batch"), lambda a: a.evaluate == "base", "--evaluate base",
         "the base classifier's argmax decides, PREDICT does not run"),
    ),
}


def _refuse_conflicts(args: argparse.Namespace, typed: dict[str, str]) -> None:
    """One line for options typed together where one makes the other do nothing (instead of ignoring it silently)."""
    for dests, applies, setting, why in _CONFLICTS.get(args.command, ()):
        given = [typed[d] for d in dests if d in typed]
        if given and applies(args):
            raise ValueError(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with "
                             f"{setting.format(**vars(args))} ({why}); drop {'it' if len(given) == 1 else 'them'}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; errors are one line on stderr with exit status 2 (under torchrun printed by rank 0 only,
    :func:`_print_error`), Ctrl-C exits with 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo" and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise ValueError(f"`splitz demo` runs as one process; under torchrun (WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']}) every rank would write the same files. train runs "
                             "data-parallel; certify, predict and certify-margin are sharded over ranks")
        _refuse_conflicts(args, _typed_options(argv))
        if getattr(args, "threads", None) is not None:
            torch.set_num_threads(check_count("--threads", args.threads))
        if getattr(args, "device", None) is not None and not hasattr(args, "shard"):
            check_device("--device", args.device)  # certify/predict check theirs once torchrun's ranks are known
        return args.func(args)
    except KeyboardInterrupt:
        print(f"interrupted: {_stopped_at(args)}; to continue, run: {_continue_command(args, argv)}", file=sys.stderr)
        return 130
    except (DatasetUnavailableError, ValueError, TypeError, OSError) as err:
        _print_error(f"error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
