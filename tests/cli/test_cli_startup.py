"""``splitz --help`` (and each ``splitz CMD --help``) and cheap argument errors import neither torch nor scipy:
the parser's choices come from a light module (:mod:`splitz_fast.cli.choices`) that must list what the registries
hold, and cheap arguments are checked before any checkpoint or dataset is read."""
import json
import subprocess
import sys

import pytest

from splitz_fast.cli import choices
from splitz_fast.cli.main import main

COMMANDS = ["demo", "train", "certify", "predict", "merge", "certify-margin", "attack", "analyze", "diagnose",
            "envelope"]
_PROBE = """
import json, resource, sys
from splitz_fast.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "scipy", "scipy.stats") if m in sys.modules),
                  "cpu": usage.ru_utime + usage.ru_stime}), file=sys.stderr)
"""


def _probe(*argv: str) -> dict:
    """Run ``splitz ARGV`` in a fresh interpreter: its exit code, which heavy modules it imported, its CPU seconds
    (reported, not asserted: the machine may be shared), and its stderr."""
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    *lines, report = done.stderr.strip().splitlines()
    return {**json.loads(report), "stdout": done.stdout, "stderr": "\n".join(lines)}


@pytest.mark.parametrize("argv", [["--help"], *[[command, "--help"] for command in COMMANDS]], ids=" ".join)
def test_help_imports_neither_torch_nor_scipy(argv):
    found = _probe(*argv)
    assert found["code"] == 0 and "usage: splitz" in found["stdout"]
    assert found["heavy"] == [], f"{' '.join(argv)} imported {found['heavy']} ({found['cpu']:.2f} s CPU)"


@pytest.mark.parametrize("argv, message", [
    (["certify", "mnist", "missing.pt", "0.5", "out.tsv", "--skip", "0"], "error: --skip must be >= 1, got 0"),
    (["certify", "mnist", "missing.pt", "0.5", "out.tsv", "--max", "0"], "error: --max must be -1 (all) or >= 1, got 0"),
    (["train", "mnist", "lenet-6", "out", "--sigma", "0.5"], "error: unknown model 'lenet-6'; valid names: "),
    (["certify", "mnist", "missing.pt", "0.5", "out.tsv", "--bound", "nope"], "invalid choice: 'nope'"),
])
def test_cheap_argument_errors_come_before_anything_heavy_is_read(argv, message):
    found = _probe(*argv)
    assert found["code"] == 2 and message in found["stderr"] and found["stderr"].count("\n") == 0
    assert found["heavy"] == [], f"{' '.join(argv)} imported {found['heavy']}"


def test_the_parser_choices_are_the_registries_names():
    from splitz_fast.bounds import radius
    from splitz_fast.certify.attacks import ATTACKS
    from splitz_fast.certify.protocols import PROTOCOLS
    from splitz_fast.checkpoints.cohen import COHEN_ARCHS
    from splitz_fast.checkpoints.macer import NAMED_NORMALIZATIONS
    from splitz_fast.checkpoints.splitz import CHECKPOINT_FORMATS
    from splitz_fast.data.datasets import DATASETS
    from splitz_fast.runs.dataset_run import HELD_OUT_SPLIT
    from splitz_fast.sampling.engine import PRECISIONS
    from splitz_fast.training.config import LIP_OBJECTIVES
    from splitz_fast.training.recipes import RECIPES
    from splitz_fast.zoo.models import MODELS

    assert choices.DATASET_NAMES == tuple(DATASETS) and choices.MODEL_NAMES == tuple(MODELS)
    assert choices.RECIPE_NAMES == tuple(RECIPES) and choices.LIP_OBJECTIVE_NAMES == tuple(LIP_OBJECTIVES)
    assert choices.CHECKPOINT_FORMATS == tuple(CHECKPOINT_FORMATS)
    assert choices.INPUT_NORMALIZATION_NAMES == tuple(NAMED_NORMALIZATIONS)
    assert choices.COHEN_ARCH_DATASETS == {name: arch.dataset for name, arch in COHEN_ARCHS.items()}
    assert (choices.BOUNDS, choices.BOUND_METHODS, choices.GAMMA_SEARCHES) == (
        tuple(radius.BOUNDS), tuple(radius.BOUND_METHODS), tuple(radius.GAMMA_SEARCHES))
    assert choices.PROTOCOL_NAMES == tuple(PROTOCOLS) and choices.PRECISION_NAMES == tuple(PRECISIONS)
    assert choices.ATTACK_NAMES == tuple(ATTACKS) and choices.HELD_OUT_SPLIT == HELD_OUT_SPLIT


def test_cli_errors_name_the_options_not_the_python_arguments(tmp_path, capsys):
    """The library says split_index, resume=True and init_checkpoint=...; the command line says its options."""
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "train.log").write_text("epoch\n")
    for argv, said in (
            (["train", "mnist", "lenet", str(tmp_path / "a"), "--sigma", "0.5", "--split-index", "5"],
             "error: --split-index must be an integer in [0, 4] for this network"),
            (["train", "mnist", "lenet", str(stopped), "--sigma", "0.5"],
             f"error: {stopped} holds a run stopped in its first epoch: pass --resume to continue that run"),
            (["train", "mnist", "lenet", str(tmp_path / "b"), "--sigma", "0.5", "--recipe", "warm-start"],
             "error: recipe 'warm-start' starts from a trained checkpoint: give it with --init CHECKPOINT\n")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1
        assert "split_index" not in err and "resume=True" not in err and "init_checkpoint" not in err
