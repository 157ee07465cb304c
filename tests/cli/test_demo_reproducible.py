"""``splitz demo`` is reproducible: two trainings with the demo's settings, the same seed and the same thread count
give bitwise-equal checkpoints, and certifying one checkpoint twice, or with another ``f_R`` batch (the demo's batch
is measured, so it changes with the machine's load), gives the same TSV rows apart from the time column. Small
budgets (a 640-digit slice of offline MNIST, 2 batches an epoch, n = 500) stand in for the demo's. The weights do
depend on the thread count (float sums are split differently), so both runs of a test use the same one."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset

from splitz_fast.certify.smoothing import Smoother
from splitz_fast.checkpoints.splitz import load_model
from splitz_fast.cli.demo import _DEMO_TRAIN_OPTIONS
from splitz_fast.cli.main import build_parser
from splitz_fast.cli.train import _train_config
from splitz_fast.data.datasets import get_dataset
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.tasks import CertifyRun
from splitz_fast.training.loop import train
from splitz_fast.zoo.models import build_model

# About 35 s of CPU (two trainings and four certify runs per model), minutes on a shared machine.
pytestmark = pytest.mark.slow

SIGMA = 0.75  # the demo's default --sigma
TEST_IMAGES = [0, 333, 666]  # the demo's first images (--skip 333)


def _train_like_the_demo(split_index: int, out_dir) -> None:
    """What ``splitz demo`` does for one model, on a slice of the training set and 2 batches an epoch."""
    args = build_parser().parse_args(["demo", "--max-batches", "2", "--train-batch", "64"])
    config = _train_config(args, _DEMO_TRAIN_OPTIONS)
    kwargs = {"split_index": split_index, "threshold": 1.0, "learnable_threshold": False}
    torch.manual_seed(args.seed)
    model = build_model("lenet", **kwargs)
    digits = Subset(get_dataset("mnist", "train").dataset, range(640))
    train(model, digits, config, out_dir, model_spec={"name": "lenet", "kwargs": kwargs, "dataset": "mnist"})


def _tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by its path of keys."""
    found = {}

    def walk(obj, where: str) -> None:
        if isinstance(obj, torch.Tensor):
            found[where] = obj
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{where}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{where}[{i}]")

    walk(torch.load(path, weights_only=True), "")
    return found


def _certified_rows(checkpoint, out_tsv, batch: int | None) -> list[list[str]]:
    """The demo's certify step on ``TEST_IMAGES`` with small budgets: the TSV's rows without the time column."""
    model, _ = load_model(str(checkpoint), "cpu")
    smoother = Smoother(model, SIGMA)
    run_over_dataset(CertifyRun(smoother, 50, 500, 0.001, batch), get_dataset("mnist", "test").dataset, out_tsv,
                     settings={"dataset": "mnist", "split": "test"}, indices=TEST_IMAGES, seed=0, progress=False)
    header, *rows = (line.split("\t") for line in out_tsv.read_text().splitlines())
    timed = header.index("time")
    return [header[:timed] + header[timed + 1:]] + [row[:timed] + row[timed + 1:] for row in rows]


@pytest.mark.parametrize("split_index", [0, 1], ids=["RS", "SPLITZ"])
def test_same_seed_and_threads_train_the_same_bits_and_certify_the_same_rows(tmp_path, split_index):
    for run in ("a", "b"):
        _train_like_the_demo(split_index, tmp_path / run)
    for name in ("last.pt", "best.pt"):
        first, second = _tensors(tmp_path / "a" / name), _tensors(tmp_path / "b" / name)
        assert first.keys() == second.keys() and first
        differing = [key for key in first if not torch.equal(first[key], second[key])]
        assert not differing, f"{name}: tensors differ between two identical trainings: {differing}"

    best = tmp_path / "a" / "best.pt"
    measured = _certified_rows(best, tmp_path / "measured.tsv", None)
    assert len(measured) == 1 + len(TEST_IMAGES)
    assert _certified_rows(best, tmp_path / "again.tsv", None) == measured
    for batch in (32, 100):
        assert _certified_rows(best, tmp_path / f"batch{batch}.tsv", batch) == measured, f"--batch {batch}"
