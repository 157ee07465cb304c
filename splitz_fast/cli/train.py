"""``splitz train``: the model options, the TrainConfig built from the options, the command, and its parser."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from .choices import LIP_OBJECTIVE_NAMES, MODEL_NAMES, RECIPE_NAMES
from .options import _HelpFormatter, _add_threads_option, _dataset_help


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
    "consistency_lambda": "--consistency-lambda", "consistency_eta": "--consistency-eta",
}


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
    """``splitz train``; under torchrun, data-parallel over the ranks
    (:class:`~splitz_fast.training.parallel.DataParallelGroup`: the same weights as one process, rank 0 writes the
    files and prints)."""
    import torch

    from .._checks import check_device, check_output_folder
    from ..data.datasets import get_dataset
    from ..runs.torchrun import TorchrunEnv, process_group
    from ..zoo.models import build_model
    from ..training.recipes import get_recipe
    from ..training.loop import train
    from ..training.parallel import SINGLE_PROCESS, DataParallelGroup
    from .certify import resume_notices_on_stderr

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
    spec = {"name": args.model, "kwargs": kwargs, "dataset": args.dataset, "split": args.split, "recipe": args.recipe}
    with ranks, resume_notices_on_stderr():
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


def _add_train_parser(sub) -> None:
    """``splitz train``: SPLITZ (or RS) training with a named recipe and its overrides."""
    dataset_help = _dataset_help()
    t = sub.add_parser("train", help="train a SPLITZ model (or the RS baseline with --split-index 0)",
                       formatter_class=_HelpFormatter)
    t.add_argument("dataset", help=dataset_help)
    t.add_argument("model", help=f"model name: {', '.join(MODEL_NAMES)}")
    t.add_argument("outdir", help="run folder: last.pt, best.pt, train.log")
    t.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
    t.add_argument("--split", default="train",
                   help="dataset split to train on (--val-fraction of it is held out); another split only for smoke "
                        "runs, e.g. cifar10-samples, whose 20 images are test images")
    t.add_argument("--recipe", choices=RECIPE_NAMES, default=None,
                   help="named settings (options below override them); where each comes from: "
                        "docs/reproducing-splitz.md (Training recipes), splitz_fast.training.recipes.RECIPES")
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
    t.add_argument("--noise-samples", type=int, default=None,
                   help="Q noise draws per input (unset: the recipe's, else 1; >= 2 with the consistency terms)")
    t.add_argument("--lambda-start", type=float, default=None,
                   help="λ at the first epoch (unset: the recipe's, else 0.8)")
    t.add_argument("--lambda-end", type=float, default=None, help="λ at the last epoch (unset: the recipe's, else 0.4)")
    t.add_argument("--lip-objective", choices=LIP_OBJECTIVE_NAMES, default=None,
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
    t.add_argument("--consistency-lambda", type=float, default=None,
                   help="weight λ of the consistency term mean_j KL(p̂ ‖ p_j), p_j the predictions of an input's "
                        "--noise-samples draws and p̂ their mean (Jeong & Shin 2020; unset: the recipe's, else 0)")
    t.add_argument("--consistency-eta", type=float, default=None,
                   help="weight η of the entropy H(p̂) of the draws' mean prediction (unset: the recipe's, else 0)")
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
    t.add_argument("--resume", action="store_true",
                   help="continue OUTDIR/last.pt (same settings only); where OUTDIR holds no last.pt, training starts "
                        "from epoch 0, saying so in one line on stderr (job scripts can pass --resume always)")
    _add_threads_option(t)
    t.set_defaults(func=train_command)
