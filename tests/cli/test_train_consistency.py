"""`splitz train`'s consistency options: parsed into the TrainConfig over a recipe's settings, recorded in the
checkpoint, and refused in one line under the option's own name."""
from __future__ import annotations

import pytest

from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.cli.main import build_parser, main
from splitz_fast.cli.train import _TRAIN_OPTIONS, _train_config
from _helpers import TINY_TRAIN_OPTIONS as TRAIN, one_line_error


def _config(*options):
    args = build_parser().parse_args(["train", "mnist", "lenet", "out", "--sigma", "0.5", *options])
    return _train_config(args, _TRAIN_OPTIONS, args.recipe)


def test_the_options_set_the_config_and_override_the_recipe():
    config = _config("--noise-samples", "2", "--consistency-lambda", "20", "--consistency-eta", "0.5")
    assert (config.noise_samples, config.consistency_lambda, config.consistency_eta) == (2, 20.0, 0.5)
    recipe = _config("--recipe", "consistency")  # the recipe's 2 draws are not overridden by an unset option
    assert (recipe.noise_samples, recipe.consistency_lambda, recipe.consistency_eta) == (2, 20.0, 0.5)
    mixed = _config("--recipe", "consistency", "--consistency-lambda", "5", "--noise-samples", "4")
    assert (mixed.noise_samples, mixed.consistency_lambda, mixed.consistency_eta) == (4, 5.0, 0.5)
    assert _config().noise_samples == 1 and _config().consistency_lambda == 0.0


@pytest.mark.parametrize("options, message", [
    (["--consistency-lambda", "-2"], "error: --consistency-lambda must be a finite number >= 0, got -2.0"),
    (["--consistency-eta", "inf", "--noise-samples", "2"], "error: --consistency-eta must be a finite number >= 0"),
    (["--consistency-lambda", "20"], "error: --noise-samples must be >= 2 where the consistency terms are on"),
    (["--recipe", "consistency", "--noise-samples", "1"],
     "error: --noise-samples must be >= 2 where the consistency terms are on"),
])
def test_bad_values_are_one_line_under_the_option_name(options, message, tiny, tmp_path, capsys):
    assert main(["train", "tiny", "mlp", str(tmp_path / "run"), *TRAIN, *options]) == 2
    assert one_line_error(capsys).startswith(message)
    assert not (tmp_path / "run").exists()


def test_a_tiny_training_with_the_options_records_them(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), *TRAIN, "--split-index", "0", "--noise-samples", "2",
                 "--consistency-lambda", "10", "--consistency-eta", "0.5"]) == 0
    ckpt = load_checkpoint_file(run / "best.pt")
    assert ckpt["config"]["consistency_lambda"] == 10.0 and ckpt["config"]["noise_samples"] == 2
    assert all(record["train_consistency_kl"] >= 0 for record in ckpt["history"])
