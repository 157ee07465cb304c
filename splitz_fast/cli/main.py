"""The ``splitz`` command line: ``train``, ``certify``, ``predict``, ``attack``, ``analyze`` and ``demo``
(``splitz CMD --help``).

``certify``/``predict`` take Cohen et al.'s positional arguments ``DATASET CHECKPOINT SIGMA OUTFILE`` and options
(``--batch --skip --max --split --N0 --N --alpha``), so existing scripts carry over; with ``--checkpoint-format cohen``
they read Cohen et al.'s own checkpoints too. They (and ``certify-margin``)
run sharded with ``--shard K/N`` (then ``splitz merge OUTFILE``) or under ``torchrun -m splitz_fast`` (rank 0 merges;
:mod:`splitz_fast.runs.torchrun`). ``train`` under ``torchrun -m splitz_fast`` trains data-parallel over the ranks
(:class:`~splitz_fast.training.parallel.DataParallelGroup`). The run itself, whole, one shard or a torchrun rank,
is :class:`~splitz_fast.runs.dataset_run.DatasetRun`, which Python code can use the same way.

This module: :func:`main`, the parser (:func:`build_parser`, one builder per command family, each beside its
handlers: :mod:`.demo`, :mod:`.train`, :mod:`.certify`, :mod:`.analyze`; shared options: :mod:`.options`), the error
line and what an interrupted run prints.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

from .. import __version__
from .analyze import _add_analyze_parser, _add_diagnose_parser, _add_envelope_parser
from .certify import _add_attack_parser, _add_certify_margin_parser, _add_certify_predict_parser, _add_merge_parser
from .choices import MODEL_NAMES
from .demo import _add_demo_parser
from .options import _refuse_conflicts
from .train import _add_train_parser


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
    from ..runs.shards import ShardSpec

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


#: The library's words for a setting -> the command line's: the Python API names its arguments, the CLI its options.
_OPTION_NAMES = (
    ("split_index must", "--split-index must"),
    ("pass resume=True (--resume)", "pass --resume"),
    ("--init CHECKPOINT (init_checkpoint=...)", "--init CHECKPOINT"),
)


def _in_option_names(message: str) -> str:
    """``message`` with the library's argument names (:data:`_OPTION_NAMES`) said as the options that set them."""
    for python, option in _OPTION_NAMES:
        message = message.replace(python, option)
    return message


def _check_cheap_arguments(args: argparse.Namespace) -> None:
    """The arguments checked without torch, before any checkpoint or dataset is read, so that a typo costs a fraction
    of a second (the libraries check them again, in the same words)."""
    if hasattr(args, "max") and args.skip < 1:
        raise ValueError(f"--skip must be >= 1, got {args.skip}")
    if hasattr(args, "max") and not (args.max == -1 or args.max >= 1):
        raise ValueError(f"--max must be -1 (all) or >= 1, got {args.max}")
    if args.command == "train" and args.model not in MODEL_NAMES:
        raise ValueError(f"unknown model {args.model!r}; valid names: {', '.join(sorted(MODEL_NAMES))}")


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
        _check_cheap_arguments(args)
        if getattr(args, "threads", None) is not None:
            import torch

            from .._checks import check_count

            torch.set_num_threads(check_count("--threads", args.threads))
        if getattr(args, "device", None) is not None and not hasattr(args, "shard"):
            from .._checks import check_device

            check_device("--device", args.device)  # certify/predict check theirs once torchrun's ranks are known
        return args.func(args)
    except KeyboardInterrupt:
        print(f"interrupted: {_stopped_at(args)}; to continue, run: {_continue_command(args, argv)}", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as err:  # OSError: DatasetUnavailableError (a FileNotFoundError) too
        _print_error(f"error: {_in_option_names(str(err))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
