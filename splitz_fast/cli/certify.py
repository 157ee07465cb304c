"""The commands that run over a dataset, their parsers beside them: ``splitz certify``, ``predict``,
``certify-margin`` and ``attack`` (each a :class:`~splitz_fast.runs.dataset_run.DatasetRun`: whole, one
``--shard K/N`` or a torchrun rank), and ``splitz merge``, which joins the shards."""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .choices import (ATTACK_NAMES, BOUND_METHODS, BOUNDS, GAMMA_SEARCHES, HELD_OUT_SPLIT, PRECISION_NAMES,
                      PROTOCOL_NAMES)
from .options import (_AUTO_ON_OFF, _HelpFormatter, _add_check_images_option, _add_checkpoint_format_option,
                      _add_max_option, _add_sharding_options, _add_threads_option, _bound_options,
                      _checked_input_normalization, _dataset_help)

if TYPE_CHECKING:  # the parser imports neither torch nor scipy: the commands import what they run
    from ..certify.protocols import CertificationProtocol
    from ..certify.smoothing import Smoother
    from ..runs.dataset_run import DatasetRun


@contextlib.contextmanager
def resume_notices_on_stderr():
    """The library's warning that ``resume`` found nothing to resume (``resume=True: …``), shown as the one line
    ``--resume: …`` on stderr as it happens; other warnings as before. Usable as a decorator."""
    from ..runs.files import RESUME_NOTICE

    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(RESUME_NOTICE):
            print(f"--resume: {str(message).removeprefix(RESUME_NOTICE)}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=RESUME_NOTICE)  # each run says it, also after another
        warnings.showwarning = shown
        yield


def _protocol(name: str, dataset: str, lipschitz_factor: float | None = None) -> CertificationProtocol:
    """The protocol ``--protocol NAME`` means for ``dataset``: ``published-code`` reads a model without
    standardization behind the dataset's published normalization (MNIST's std 0.3081) and multiplies its ``L`` by
    ``--published-lipschitz-factor`` (``lipschitz_factor``, default 1), which no other protocol takes."""
    from ..certify.protocols import PUBLISHED_DATA_STD, PublishedCode, get_protocol

    if name == "published-code":
        factor = 1.0 if lipschitz_factor is None else lipschitz_factor
        return PublishedCode(data_std=PUBLISHED_DATA_STD.get(dataset), lipschitz_factor=factor)
    if lipschitz_factor is not None:
        raise ValueError(f"--published-lipschitz-factor belongs to --protocol published-code, not --protocol {name}")
    return get_protocol(name)


def _open_run(args: argparse.Namespace) -> DatasetRun:
    """The :class:`~splitz_fast.runs.dataset_run.DatasetRun` of a dataset command's checked arguments; sets
    ``args.device`` to the device this process uses (under torchrun: its local rank's GPU)."""
    from ..runs.dataset_run import DatasetRun

    _checked_input_normalization(args)
    run = DatasetRun.open(args.dataset, args.checkpoint, args.outfile, split=args.split, root=args.root,
                          skip=args.skip, max_count=args.max, seed=args.seed, resume=args.resume, device=args.device,
                          shard=args.shard, checkpoint_format=getattr(args, "checkpoint_format", "splitz"),
                          sigma=getattr(args, "sigma", None),
                          input_normalization=getattr(args, "input_normalization", None))
    args.device = run.device
    run.check_images = args.check_images
    return run


def _smoother(args: argparse.Namespace, selection: bool) -> tuple[DatasetRun, Smoother, dict[str, Any]]:
    """certify / predict: the sampling options checked under their command-line names and the bound options built
    (before the model and data are loaded), the run, the Smoother and the settings its sidecar records.
    ``selection``: the command draws ``--N0``."""
    import torch

    from .._checks import check_count, check_positive, check_probability
    from ..certify.smoothing import Smoother

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
    run = _open_run(args)
    for flag, value in (("--cuda-graphs", args.cuda_graphs), ("--fused-kernels", args.fused_kernels)):
        if value == "on" and torch.device(args.device).type != "cuda":
            raise ValueError(f"{flag} on needs a CUDA device (this run samples on {args.device}): pass --device "
                             f"cuda, or {flag} auto / off")
    smoother = Smoother(run.model, args.sigma, bound_options=bound_options, precision=args.precision,
                        compile=args.compile, cuda_graphs=_AUTO_ON_OFF[args.cuda_graphs],
                        fused_kernels=_AUTO_ON_OFF[args.fused_kernels], protocol=protocol)
    # The sampling settings (precision, gamma_batch, bn_folded) are the run task's.
    settings = {"bound": smoother.bound, "bound_method": smoother.bound_method, "gamma_search": smoother.gamma_search}
    return run, smoother, settings


def _sequential_budget(args: argparse.Namespace) -> int:
    """The checked sample budget of ``certify --sequential`` (``--budget``, else ``--N``) and its ``--radii``."""
    from .._checks import check_count

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


@resume_notices_on_stderr()
def certify_command(args: argparse.Namespace) -> int:
    from ..certify.sequential import SequentialCertifier
    from ..runs.tasks import CertifyRun

    if args.sequential:
        budget = _sequential_budget(args)
        if getattr(args, "protocol", "sound") != "sound":
            raise ValueError(f"--sequential decides certificates; --protocol {args.protocol} is an estimate")
    elif args.radii is not None or args.budget is not None:
        raise ValueError("--radii and --budget belong to sequential certification: add --sequential")
    run, smoother, settings = _smoother(args, selection=True)
    if not args.sequential:
        run.run(CertifyRun(smoother, args.N0, args.N, args.alpha, args.batch), settings)
        return 0
    run.run(CertifyRun(SequentialCertifier(smoother, args.radii), args.N0, budget, args.alpha, args.batch), settings)
    return 0


@resume_notices_on_stderr()
def certify_margin_command(args: argparse.Namespace) -> int:
    """Deterministic margin certificates for a model trained with the whole classifier in f_L."""
    from ..certify.margin import MarginCertifier
    from ..runs.tasks import MarginRun

    bound_options = _bound_options(args)
    run = _open_run(args)
    certifier = MarginCertifier(run.model, bound_options=bound_options)
    run.run(MarginRun(certifier), {"certifier": "margin", "bound": certifier.bound,
                                   "bound_method": certifier.bound_method, "gamma_search": certifier.gamma_search})
    return 0


@resume_notices_on_stderr()
def predict_command(args: argparse.Namespace) -> int:
    from ..runs.tasks import PredictRun

    run, smoother, settings = _smoother(args, selection=False)
    run.run(PredictRun(smoother, args.N, args.alpha, args.batch), settings)
    return 0


@resume_notices_on_stderr()
def attack_command(args: argparse.Namespace) -> int:
    """l2 attacks (:mod:`splitz_fast.certify.attacks`) on each selected input; PREDICT decides the clean and attacked points."""
    from .._checks import check_count, check_positive, check_probability
    from ..certify.attacks import Attacker
    from ..certify.smoothing import Smoother
    from ..runs.tasks import AttackRun

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
    run = _open_run(args)
    attacker = Attacker(Smoother(run.model, args.sigma), args.attack, args.eps, steps=args.steps,
                        step_size=args.step_size, samples=args.samples, random_start=args.random_start,
                        clamp=args.clamp, evaluate=args.evaluate, group=args.group)
    run.run(AttackRun(attacker, args.N, args.alpha, args.batch), attacker.settings())
    return 0


def merge_command(args: argparse.Namespace) -> int:
    """Join the shards of one certify/predict run (``--shard K/N``) into OUTFILE, sorted by idx."""
    from .._checks import check_output_file
    from ..runs.shards import ShardData, merge_shards, shard_files

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


_RESUME_HELP = ("continue an interrupted OUTFILE (same settings only); where OUTFILE does not exist yet, a new run "
                "starts, saying so in one line on stderr (job scripts can pass --resume always)")


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
            c.add_argument("--protocol", choices=PROTOCOL_NAMES, default="sound",
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
        c.add_argument("--precision", choices=PRECISION_NAMES, default="float32",
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
                       help="sample through f_R with its convolution epilogues fused (on CUDA conv + bias + ReLU "
                            "(+ shortcut) as one cuDNN call and conv + ReLU + 2x2 pool as one Triton kernel; on the "
                            "CPU a thin conv + ReLU + 2x2 pool as one C++ kernel): auto (default) site by site where "
                            "it scores like the plain f_R and measures faster, on (needs CUDA), off (the same "
                            "function; rounding may differ in the last bits)")
        c.add_argument("--seed", type=int, default=0, help="base seed; image i uses SEED+i")
        c.add_argument("--resume", action="store_true", help=_RESUME_HELP)
        _add_checkpoint_format_option(c)
        _add_sharding_options(c)
        _add_check_images_option(c)
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
    m.add_argument("--resume", action="store_true", help=_RESUME_HELP)
    _add_sharding_options(m)
    _add_check_images_option(m)
    _add_threads_option(m)
    m.set_defaults(func=certify_margin_command)


def _add_attack_parser(sub) -> None:
    """``splitz attack``: l2 attacks with PREDICT at the clean and attacked points."""
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
    k.add_argument("--attack", choices=ATTACK_NAMES, default="smooth-pgd",
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
    k.add_argument("--resume", action="store_true", help=_RESUME_HELP)
    _add_checkpoint_format_option(k)
    _add_sharding_options(k)
    _add_check_images_option(k)
    _add_threads_option(k)
    k.set_defaults(func=attack_command)
