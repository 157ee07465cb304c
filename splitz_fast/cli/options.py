"""What several ``splitz`` commands share: the help formatter, the options of more than one command
(``--threads``, ``--max``, ``--checkpoint-format``, ``--device``/``--shard``), the bound options built from the
parsed ones, and the options refused when typed together where one does nothing (:data:`_CONFLICTS`)."""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING

from .choices import CHECKPOINT_FORMATS, COHEN_ARCH_DATASETS, DATASET_NAMES, INPUT_NORMALIZATION_NAMES

if TYPE_CHECKING:
    from ..bounds.radius import BoundOptions


DEMO_RADII = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]

# --cuda-graphs / --fused-kernels -> Smoother(cuda_graphs=..., fused_kernels=...)
_AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show (unset, flags, required)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads`` of every command that computes: torch's intra-op threads (``torch.set_num_threads``)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads of this process (each rank under torchrun); unset, torch's default "
                             "(torch.get_num_threads(): as a rule one per physical core). Trained weights depend on it "
                             "(float sums are split differently); on a machine shared with other jobs fewer threads "
                             "can be much faster")


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
    archs = ", ".join(f"{name} ({dataset})" for name, dataset in COHEN_ARCH_DATASETS.items())
    parser.add_argument("--checkpoint-format", choices=CHECKPOINT_FORMATS, default="splitz",
                        help="splitz: CHECKPOINT was written by `splitz train`. cohen: a checkpoint.pth.tar of "
                             "Cohen et al.'s randomized smoothing code (locuslab/smoothing; SmoothAdv, MACER, ... "
                             f"built on it), arch {archs}, certified at split 0 behind that code's normalisation; it "
                             "does not record σ, so SIGMA must be the σ it was trained at, and DATASET its dataset. "
                             "macer: a {'net', 'epoch'} file of MACER's code (RuntianZ/macer), its CIFAR ResNet "
                             "certified at split 0 on cifar10 behind --input-normalization")
    names = " | ".join(INPUT_NORMALIZATION_NAMES)
    parser.add_argument("--input-normalization", default=None, metavar="NAME|MEAN,STD",
                        help=f"with --checkpoint-format macer (required there: the file does not record it): the "
                             f"(x - mean)/std the network was trained behind, {names} or MEAN,STD (2 numbers for "
                             "every channel, or 6: three means then three stds). MACER's own CIFAR-10 training uses "
                             "none (raw [0, 1] pixels). Part of the model: recorded in the sidecar and the digest")


def _checked_input_normalization(args: argparse.Namespace) -> None:
    """Refuse ``--checkpoint-format macer`` without ``--input-normalization``, and the option with another format
    (where the checkpoint's model holds its own), before the checkpoint and the data load."""
    given, format = getattr(args, "input_normalization", None), getattr(args, "checkpoint_format", "splitz")
    if format == "macer" and given is None:
        raise ValueError("MACER checkpoints store no normalisation: pass --input-normalization none (MACER's own "
                         f"CIFAR-10 training: raw [0, 1] pixels), {' or '.join(INPUT_NORMALIZATION_NAMES[1:])}, or "
                         "MEAN,STD")
    if format != "macer" and given is not None:
        raise ValueError(f"--input-normalization belongs to --checkpoint-format macer; a {format} checkpoint's model "
                         "holds its own normalisation: drop the option")
    if given is not None:
        from ..checkpoints.macer import input_normalization

        try:
            input_normalization(given)
        except ValueError as err:  # its message names the setting "input normalisation": name the option
            raise ValueError(f"--input-normalization: {err}") from None


def _add_sharding_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--shard`` of the commands that run over a dataset (certify, predict, certify-margin)."""
    parser.add_argument("--device", default=None,
                        help="cpu, or cuda / cuda:N where a GPU is present; unset, cpu (under torchrun: each rank's "
                             "cuda:LOCAL_RANK when CUDA is available)")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run only shard K of N (0 <= K < N: every N-th selected input from the K-th) into "
                             "OUTFILE.shard-K-of-N, e.g. --shard $SLURM_ARRAY_TASK_ID/8; then `splitz merge OUTFILE`. "
                             "Under torchrun the ranks are the shards and rank 0 merges")


def _add_check_images_option(parser: argparse.ArgumentParser) -> None:
    """``--check-images`` of the commands that run over a dataset: a damaged image found before the first row."""
    parser.add_argument("--check-images", action=argparse.BooleanOptionalAction, default=True,
                        help="before the first row, open and decode every image file of a folder dataset (ImageNet, "
                             "an ImageFolder --root) that the run will read (--skip/--max, --shard, the rows a "
                             "--resume still lacks), so a damaged file is refused at once, named, not when reached; "
                             "about 4 ms per 512x512 JPEG on one core, far less than one certification")


def _dataset_help() -> str:
    return f"dataset name: {', '.join(DATASET_NAMES)}"


def _bound_options(args: argparse.Namespace) -> BoundOptions:
    """The certifier's :class:`~splitz_fast.bounds.radius.BoundOptions`, built (and so validated) once from the parsed
    options: each option is the field of the same name (``--bound-method`` is ``bound_method``); a field the command
    has no option for keeps its default. Options typed together where one does nothing were refused before
    (:data:`_CONFLICTS`)."""
    from ..bounds.radius import BoundOptions

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
