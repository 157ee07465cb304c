"""The `splitz` command line on bad input and interruptions: one clear line on stderr, exit status 2 (130 for Ctrl-C),
no traceback, nothing half-written; and checkpoints identified by their content, not by file bytes or wall times."""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import splitz_fast.training.loop as training
from splitz_fast import Smoother
from splitz_fast.cli.main import build_parser, main
from splitz_fast.data.datasets import DATASETS
import splitz_fast.certify.outcomes as outcomes
import splitz_fast.certify.windows as windows
from splitz_fast.checkpoints.splitz import CHECKPOINT_DIGEST_COVERS, checkpoint_digest, load_checkpoint_file
from _helpers import TINY_TRAIN_OPTIONS as TRAIN, one_line_error as _one_line_error


def _train(run, *extra):
    assert main(["train", "tiny", "mlp", str(run), *TRAIN, *extra]) == 0
    return run / "best.pt"


def _certify_args(ckpt, out, *extra):
    return ["certify", "tiny", str(ckpt), "0.5", str(out), "--skip", "10", "--N0", "10", "--N", "50", "--batch", "25",
            *extra]


def _last_line(capsys) -> str:
    """The last line on stderr (progress bars before it end in carriage returns), checked to be the only message."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    last = err.splitlines()[-1]
    assert err.count(last) == 1
    return last


@pytest.fixture
def checkpoint(tmp_path_factory, tiny, capsys):
    ckpt = _train(tmp_path_factory.mktemp("run") / "run")
    capsys.readouterr()  # the training's progress output is not under test
    return ckpt


# ------------------------------------------------------------------------------------------------ devices
@pytest.mark.parametrize("flag", ["--cuda-graphs", "--fused-kernels"])
def test_a_cuda_only_choice_on_without_a_gpu_is_one_line(flag, checkpoint, tmp_path, capsys):
    assert main(_certify_args(checkpoint, tmp_path / "on.tsv", flag, "on")) == 2
    assert f"{flag} on needs a CUDA device (this run samples on cpu)" in _one_line_error(capsys)
    assert not (tmp_path / "on.tsv").exists()


def test_fused_kernels_auto_and_off_give_the_same_rows_on_the_cpu(checkpoint, tmp_path):
    """Nothing fuses on the CPU: both settings sample the plain f_R."""
    for name in ("auto", "off"):
        assert main(_certify_args(checkpoint, tmp_path / f"{name}.tsv", "--fused-kernels", name)) == 0
    rows = [[line.split("\t")[:5] for line in (tmp_path / f"{name}.tsv").read_text().splitlines()]
            for name in ("auto", "off")]
    assert rows[0] == rows[1] and len(rows[0]) > 1


def test_cuda_graphs_on_without_a_gpu_is_one_line_and_auto_samples_eagerly(checkpoint, tmp_path, capsys):
    assert main(_certify_args(checkpoint, tmp_path / "on.tsv", "--cuda-graphs", "on")) == 2
    assert "--cuda-graphs on needs a CUDA device (this run samples on cpu)" in _one_line_error(capsys)
    assert not (tmp_path / "on.tsv").exists()
    assert main(_certify_args(checkpoint, tmp_path / "auto.tsv", "--cuda-graphs", "auto")) == 0
    assert main(_certify_args(checkpoint, tmp_path / "off.tsv", "--cuda-graphs", "off")) == 0
    rows = [[line.split("\t")[:5] for line in (tmp_path / f"{name}.tsv").read_text().splitlines()]
            for name in ("auto", "off")]
    assert rows[0] == rows[1] and len(rows[0]) > 1  # the same certificates (columns 1-5; the 6th is the time)
    with pytest.raises(SystemExit):
        main(_certify_args(checkpoint, tmp_path / "bad.tsv", "--cuda-graphs", "sometimes"))
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, setting", [([], None), (["--compile"], True), (["--no-compile"], False)])
def test_compile_is_measured_by_default_and_the_flags_force_it(extra, setting, checkpoint, tmp_path, monkeypatch):
    """The setting the command line gives the Smoother (None: the engine decides); the flag also before the
    positional arguments."""
    given = []
    original = Smoother.__init__

    def recording(self, *args, **kwargs):
        given.append(kwargs["compile"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(Smoother, "__init__", recording)
    args = _certify_args(checkpoint, tmp_path / "out.tsv")
    assert build_parser().parse_args(args[:1] + extra + args[1:]).compile is setting
    assert main(args + extra) == 0
    assert given == [setting]


@pytest.mark.parametrize("command", ["train", "certify"])
@pytest.mark.parametrize("device, problem", [("cuda", "unavailable"), ("cuda:7", "unavailable"),
                                             ("gpu", "not a device")])
def test_device_that_is_missing_or_not_a_device_is_named(tmp_path, capsys, monkeypatch, tiny, command, device,
                                                         problem):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    args = (["train", "tiny", "mlp", str(tmp_path / "run"), *TRAIN] if command == "train" else
            _certify_args(tmp_path / "missing.pt", tmp_path / "out.tsv"))
    assert main(args + ["--device", device]) == 2
    err = _one_line_error(capsys)
    assert f"--device {device!r} is {problem}" in err and "valid here: cpu" in err and "cuda" not in err.split(":")[-1]
    assert list(tmp_path.iterdir()) == []  # nothing created


# ------------------------------------------------------------------------------------------------ output paths
def test_outfile_that_is_a_folder_or_under_a_file_says_so(tmp_path, capsys, checkpoint):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(_certify_args(checkpoint, tmp_path)) == 2
    assert "is a folder; give a file path" in _one_line_error(capsys)
    assert main(_certify_args(checkpoint, blocker / "x.tsv")) == 2
    assert f"'{blocker}' is a file, not a folder" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.fixture
def unwritable(tmp_path):
    """A folder this user cannot create files in: a read-only folder, or /sys for root (whom permissions let through)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    for candidate in (folder, Path("/sys")):
        try:
            (candidate / "probe").touch()
            (candidate / "probe").unlink()
        except OSError:
            yield candidate
            break
    else:
        pytest.skip("no folder here that this user cannot write")
    folder.chmod(0o700)


@pytest.mark.parametrize("command", ["certify", "train", "analyze", "merge"])
def test_output_path_the_user_cannot_write_is_one_line_that_names_it(tmp_path, capsys, tiny, unwritable, command):
    target = unwritable / "sub" / "out.tsv"
    tsv = tmp_path / "a.tsv"
    tsv.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0.1\n")
    args = {"certify": _certify_args(tmp_path / "missing.pt", target),
            "train": ["train", "tiny", "mlp", str(target), *TRAIN],
            "analyze": ["analyze", str(tsv), "--out", str(target)],
            "merge": ["merge", str(target), str(tsv)]}[command]
    assert main(args) == 2
    err = _one_line_error(capsys)
    assert "cannot write " in err and repr(str(target)) in err and f"cannot create files in {str(unwritable)!r}" in err
    assert "Errno" not in err and not (unwritable / "sub").exists()


def test_analyze_out_that_is_a_file_or_under_a_file_says_so(tmp_path, capsys):
    tsv = tmp_path / "a.tsv"
    tsv.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0.1\n")
    assert main(["analyze", str(tsv), "--out", str(tsv / "sub")]) == 2
    assert f"'{tsv}' is a file, not a folder" in _one_line_error(capsys)
    assert main(["analyze", str(tsv), "--out", str(tsv)]) == 2
    assert "is a file, not a folder" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tsv"]


# ------------------------------------------------------------------------------------------------ Ctrl-C
def _interrupt_on_call(monkeypatch, owner, name, call):
    original = getattr(owner, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("kind", ["certify", "predict"])
def test_ctrl_c_during_a_run_says_where_it_stopped_and_how_to_resume(tmp_path, capsys, monkeypatch, checkpoint, kind):
    def args(out):
        certify = _certify_args(checkpoint, out)
        return certify if kind == "certify" else ["predict", *certify[1:certify.index("--N0")], "--N", "50"]

    assert main(args(tmp_path / "whole.tsv")) == 0
    whole = (tmp_path / "whole.tsv").read_text().splitlines()
    part_args = args(tmp_path / "part.tsv")
    with monkeypatch.context() as patch:
        # The per-input statistic of the kind: raised while finishing the third input, after two rows are written.
        module, statistic = ((windows, "clopper_pearson_lower") if kind == "certify"
                             else (outcomes, "two_sided_binomial_pvalue"))
        _interrupt_on_call(patch, module, statistic, 3)
        assert main(part_args) == 130
    err = _last_line(capsys)
    assert err.startswith(f"interrupted: 2 rows in {tmp_path / 'part.tsv'}; to continue, run: ")
    command = shlex.split(err.split("to continue, run: ")[1])
    assert command == ["splitz", *part_args, "--resume"]
    assert main(command[1:]) == 0
    time_column = whole[0].split("\t").index("time")
    drop_time = lambda lines: [[f for i, f in enumerate(line.split("\t")) if i != time_column] for line in lines]  # noqa: E731
    assert drop_time((tmp_path / "part.tsv").read_text().splitlines()) == drop_time(whole)


def test_ctrl_c_during_training_says_which_epoch_and_resumes(tmp_path, capsys, monkeypatch, tiny):
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_on_call(patch, training, "evaluate", 2)  # during the second epoch
        assert main(["train", "tiny", "mlp", str(run), *TRAIN]) == 130
    err = _last_line(capsys)
    assert err.startswith(f"interrupted: 1 of 2 epochs finished in {run}; ")
    command = shlex.split(err.split("to continue, run: ")[1])
    assert command[-1] == "--resume" and main(command[1:]) == 0
    assert len(load_checkpoint_file(run / "last.pt")["history"]) == 2


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("content, reason", [(b"", "the file is empty"),
                                             (b"garbage\x00\x01", "not a torch.save archive")])
def test_garbage_or_empty_checkpoint_is_one_line(tmp_path, capsys, tiny, content, reason):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    assert main(_certify_args(bad, tmp_path / "out.tsv")) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"error: {bad} is not a splitz_fast checkpoint: ") and reason in err
    assert "written by `splitz train`" in err and not (tmp_path / "out.tsv").exists()


def test_load_checkpoint_gives_the_model_and_sigma_that_certify_uses(tmp_path, capsys, monkeypatch, checkpoint, tiny):
    """The documented Python way in: ``sz.load_checkpoint`` (weights_only) gives the model `splitz certify` certifies."""
    import splitz_fast as sz
    import splitz_fast.checkpoints.splitz as checkpoints
    from splitz_fast.checkpoints.splitz import load_model

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k))
    ckpt = sz.load_checkpoint(checkpoint)
    assert loads == [True]
    assert isinstance(ckpt, sz.LoadedCheckpoint) and isinstance(ckpt.model, sz.SplitModel) and not ckpt.model.training
    assert ckpt.sigma == 0.5 and ckpt.dataset == "tiny" and ckpt.model_spec["name"] == "mlp"
    assert ckpt.digest == checkpoint_digest(load_checkpoint_file(checkpoint)) and ckpt.epoch == ckpt.data["epoch"]
    # The old import sites are the same functions (moved, not copied).
    assert load_checkpoint_file is checkpoints.load_checkpoint_file and load_model is checkpoints.load_model
    out = tmp_path / "out.tsv"
    assert main(_certify_args(checkpoint, out)) == 0
    row = out.read_text().splitlines()[1].split("\t")
    x, _ = tiny.dataset[int(row[0])]
    r = sz.Smoother(ckpt.model, ckpt.sigma).certify(x, n0=10, n=50, alpha=0.001, batch_size=25, seed=int(row[0]))
    assert (str(r.prediction), float(row[3])) == (row[2], pytest.approx(r.radius, rel=1e-5, abs=1e-6))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sz.load_checkpoint(tmp_path / "missing.pt")


def test_a_loaded_checkpoint_prints_as_one_short_line(tmp_path, checkpoint):
    import splitz_fast as sz

    ckpt = sz.load_checkpoint(checkpoint)
    parameters = sum(p.numel() for p in ckpt.model.parameters())
    assert repr(ckpt) == str(ckpt) == (
        f"LoadedCheckpoint(mlp on tiny, split_index=1, epoch={ckpt.epoch}, sigma=0.5, {parameters:,} parameters, with "
        f"optimizer state, digest={ckpt.digest[:12]}…)")
    data = load_checkpoint_file(checkpoint)
    del data["optimizer"]
    torch.save(data, tmp_path / "weights-only.pt")
    assert ", without optimizer state, " in repr(sz.load_checkpoint(tmp_path / "weights-only.pt"))


def test_checkpoint_of_another_split_is_one_line_not_a_key_dump(tmp_path, capsys, checkpoint):
    ckpt = load_checkpoint_file(checkpoint)
    ckpt["model_spec"]["kwargs"]["split_index"] = 2
    other = tmp_path / "other.pt"
    torch.save(ckpt, other)
    assert main(_certify_args(other, tmp_path / "out.tsv")) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"error: {other}: ") and "another split or architecture" in err
    assert "Missing key" not in err and not (tmp_path / "out.tsv").exists()


@pytest.mark.parametrize("sigma", ["0.75", -1.0, float("nan")])
def test_a_checkpoint_recording_an_invalid_sigma_is_refused_at_load(tmp_path, checkpoint, sigma):
    import splitz_fast as sz

    ckpt = load_checkpoint_file(checkpoint)
    ckpt["config"]["sigma"] = sigma
    torch.save(ckpt, tmp_path / "edited.pt")
    with pytest.raises(ValueError, match="records an invalid training noise level"):
        sz.load_checkpoint(tmp_path / "edited.pt")


@pytest.mark.parametrize("device,reason", [("gpu0", "is not a device"),
                                           pytest.param("cuda", "is unavailable on this machine", marks=pytest.mark.skipif(
                                               torch.cuda.is_available(), reason="needs a machine without CUDA"))])
def test_a_bad_device_is_named_not_read_as_a_damaged_file(checkpoint, device, reason):
    import splitz_fast as sz

    with pytest.raises(ValueError, match=f"device '{device}' {reason}"):
        sz.load_checkpoint(checkpoint, device=device)


def test_train_numbers_epochs_from_0_as_its_log_and_checkpoints_do(tmp_path, capsys, tiny):
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), *TRAIN[:3], "3", *TRAIN[4:]]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines()[:-1]] == ["epoch 0 of 0-2", "epoch 1 of 0-2",
                                                                       "epoch 2 of 0-2"]
    assert [json.loads(line)["epoch"] for line in (run / "train.log").read_text().splitlines()] == [0, 1, 2]
    best = load_checkpoint_file(run / "best.pt")
    assert out.splitlines()[-1].startswith(f"best epoch {best['epoch']} (") and best["epoch"] == best["best_epoch"]
    assert load_checkpoint_file(run / "last.pt")["epoch"] == 2


def test_resume_with_other_settings_names_them(tmp_path, capsys, tiny):
    run = tmp_path / "run"
    assert main(["train", "tiny", "mlp", str(run), *TRAIN[:3], "1", *TRAIN[4:]]) == 0
    capsys.readouterr()
    assert main(["train", "tiny", "mlp", str(run), *TRAIN, "--lr", "0.01", "--resume"]) == 2
    err = _one_line_error(capsys)
    assert "epochs (1 in last.pt, 2 now)" in err and "lr (0.001 in last.pt, 0.01 now)" in err and "sigma" not in err


def test_certify_resume_names_only_the_settings_that_differ(tmp_path, capsys, checkpoint):
    out = tmp_path / "out.tsv"
    assert main(_certify_args(checkpoint, out)) == 0
    capsys.readouterr()
    assert main(_certify_args(checkpoint, out, "--N", "60", "--alpha", "0.01", "--resume")) == 2
    err = _one_line_error(capsys)
    assert "different settings: alpha (0.001 in out.tsv.json, 0.01 now); n (50 in out.tsv.json, 60 now); use" in err
    assert "skip" not in err and "seed" not in err
    # The demo's sidecar records no skip/max (it selects with --num-images): only N differs, only n is named.
    sidecar = tmp_path / "out.tsv.json"
    settings = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({k: v for k, v in settings.items() if k not in ("skip", "max")}))
    assert main(_certify_args(checkpoint, out, "--N", "60", "--resume")) == 2
    err = _one_line_error(capsys)
    assert "different settings: n (50 in out.tsv.json, 60 now); use" in err and "skip" not in err and "max" not in err
    assert main(_certify_args(checkpoint, out, "--resume")) == 2
    err = _one_line_error(capsys)
    assert "max (not recorded in out.tsv.json, -1 now); skip (not recorded in out.tsv.json, 10 now)" in err
    assert "; another command or version wrote the file; use" in err


def test_a_resume_with_a_changed_checkpoint_file_says_so(tmp_path, capsys, checkpoint):
    out, ckpt = tmp_path / "out.tsv", tmp_path / "model.pt"
    shutil.copy(checkpoint, ckpt)
    assert main(_certify_args(ckpt, out, "--max", "2")) == 0
    changed = torch.load(ckpt, weights_only=True)
    name = next(iter(changed["model"]))
    changed["model"][name] = changed["model"][name] + 1
    torch.save(changed, ckpt)  # the same path and arguments, other weights
    capsys.readouterr()
    assert main(_certify_args(ckpt, out, "--max", "2", "--resume")) == 2
    assert ("different settings: checkpoint_digest; the checkpoint's contents are not those the run began with"
            in _one_line_error(capsys))


@pytest.mark.parametrize("content, problem", [
    (b'{"alpha": 0.001, "n\x01', "is not valid JSON (Invalid control character at: line 1 column 20 (char 19))"),
    (b"[1, 2]", "holds no settings (a JSON object) but an array"),
    (b"\xff\xfe{}", "is not a text file"),
    (None, "is missing"),
])
def test_resume_with_a_damaged_settings_file_names_it_and_says_what_to_do(tmp_path, capsys, checkpoint, content,
                                                                           problem):
    out, sidecar = tmp_path / "out.tsv", tmp_path / "out.tsv.json"
    assert main(_certify_args(checkpoint, out, "--max", "1")) == 0
    sidecar.unlink() if content is None else sidecar.write_bytes(content)
    capsys.readouterr()
    assert main(_certify_args(checkpoint, out, "--max", "2", "--resume")) == 2
    assert _one_line_error(capsys) == (f"error: cannot resume {out}: its settings file {sidecar} {problem}; restore it "
                                       "or start a new OUTFILE\n")
    assert len(out.read_text().splitlines()) == 2  # the finished row is kept


def test_merge_over_a_file_with_a_damaged_settings_file_names_it(tmp_path, capsys, checkpoint):
    out = tmp_path / "out.tsv"
    assert main(_certify_args(checkpoint, out, "--max", "1", "--shard", "0/1")) == 0
    assert main(["merge", str(out)]) == 0
    (tmp_path / "out.tsv.json").write_text('{"kind": "certify",')
    capsys.readouterr()
    assert main(["merge", str(out)]) == 2
    assert (f"{out} exists and was not written by this run (its settings file {out}.json is not valid JSON (Expecting "
            "property name enclosed in double quotes") in _one_line_error(capsys)


# ------------------------------------------------------------------------------------------------ option messages
def test_option_messages_use_the_options_the_command_has(tmp_path, capsys, checkpoint):
    assert main(_certify_args(checkpoint, tmp_path / "out.tsv", "--skip", "0")) == 2
    err = _one_line_error(capsys)
    assert "--skip must be >= 1" in err and "--num-images" not in err
    assert main(_certify_args(checkpoint, tmp_path / "out.tsv", "--batch", "0")) == 2
    err = _one_line_error(capsys)
    assert "--batch must be >= 1" in err and "batch_size" not in err
    assert main(["train", "tiny", "mlp", str(tmp_path / "run"), *TRAIN, "--batch", "0"]) == 2
    err = _one_line_error(capsys)
    assert "--batch must be >= 1" in err and "batch_size" not in err
    assert main(["demo", "--num-images", "0", "--out", str(tmp_path / "demo")]) == 2
    assert "--num-images must be >= 1" in _one_line_error(capsys)
    assert main(["demo", "--skip", "0", "--out", str(tmp_path / "demo")]) == 2
    assert "--skip must be >= 1" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_threads_option_on_every_computing_command_sets_torchs_threads(tmp_path, capsys, monkeypatch, checkpoint):
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("demo", "train", "certify", "predict", "certify-margin", "attack", "diagnose"):
        assert "--threads" in commands[name]._option_string_actions, name
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # the test process keeps its threads
    assert main(_certify_args(checkpoint, tmp_path / "out.tsv", "--threads", "1")) == 0
    assert calls == [1]
    assert main(_certify_args(checkpoint, tmp_path / "other.tsv")) == 0
    assert calls == [1]  # unset: torch's default stays
    capsys.readouterr()
    assert main(_certify_args(checkpoint, tmp_path / "bad.tsv", "--threads", "0")) == 2
    assert "--threads must be >= 1, got 0" in _one_line_error(capsys) and not (tmp_path / "bad.tsv").exists()


@pytest.mark.parametrize("extra, typed, setting", [
    (["--gamma-search", "one-step", "--gamma-batch", "4"], "--gamma-batch", "--gamma-search one-step"),
    (["--gamma-search=one-step", "--gamma-b=2"], "--gamma-batch", "--gamma-search one-step"),  # abbreviated, = form
    (["--bound", "global", "--gamma-batch", "4"], "--gamma-batch", "--bound global"),
    (["--bound", "global", "--gamma-search", "one-step"], "--gamma-search", "--bound global"),
])
def test_certify_options_that_do_nothing_together_are_refused(tmp_path, capsys, extra, typed, setting):
    assert main(_certify_args(tmp_path / "missing.pt", tmp_path / "out.tsv", *extra)) == 2
    err = _one_line_error(capsys)
    assert f"{typed} does nothing with {setting} (" in err and err.rstrip().endswith("drop it")
    assert list(tmp_path.iterdir()) == []


def test_bound_options_are_built_before_the_checkpoint_is_read(tmp_path, capsys):
    """The command line builds the BoundOptions (their only validation) from the parsed options before it loads
    anything: a missing checkpoint does not hide a bad --gamma-batch."""
    assert main(_certify_args(tmp_path / "missing.pt", tmp_path / "out.tsv", "--gamma-batch", "1")) == 2
    assert "--gamma-batch must be >= 2, got 1" in _one_line_error(capsys) and list(tmp_path.iterdir()) == []
    assert main(_certify_args(tmp_path / "missing.pt", tmp_path / "out.tsv", "--gamma-batch", "3")) == 2
    assert _one_line_error(capsys).startswith("error: --gamma-batch must be a power of two (2, 4, 8, ...), got 3: ")


@pytest.mark.parametrize("command", [
    ["certify-margin", "tiny", "c.pt", "o.tsv", "--bound", "global", "--gamma-search", "bisection"],
    ["attack", "tiny", "c.pt", "0.5", "o.tsv", "--eps", "1", "--attack", "fgsm", "--steps", "5"],
    ["attack", "tiny", "c.pt", "0.5", "o.tsv", "--eps", "1", "--attack", "smooth-fgsm", "--random-start"],
    ["attack", "tiny", "c.pt", "0.5", "o.tsv", "--eps", "1", "--attack", "pgd", "--samples", "8"],
    ["attack", "tiny", "c.pt", "0.5", "o.tsv", "--eps", "1", "--evaluate", "base", "--N", "100", "--alpha", "0.01"],
])
def test_other_options_that_do_nothing_together_are_refused(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    assert "nothing with --" in _one_line_error(capsys) and list(tmp_path.iterdir()) == []


def test_options_that_work_together_are_not_refused(tmp_path, capsys, checkpoint):
    assert main(_certify_args(checkpoint, tmp_path / "a.tsv", "--gamma-search", "bisection", "--gamma-batch", "4")) == 0
    assert main(_certify_args(checkpoint, tmp_path / "b.tsv", "--gamma-search", "one-step", "--bound", "local")) == 0


def test_analyze_names_a_binary_file_and_prints_bad_radii_plainly(tmp_path, capsys):
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\xff\xfe\x00binary")
    assert main(["analyze", str(binary)]) == 2
    err = _one_line_error(capsys)
    assert str(binary) in err and "not a text file" in err
    tsv = tmp_path / "a.tsv"
    tsv.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0.1\n")
    assert main(["analyze", str(tsv), "--radii", "-1", "0.5"]) == 2
    err = _one_line_error(capsys)
    assert err == "error: radii must be >= 0, got -1\n"


@pytest.mark.parametrize("command", [["analyze", "{tsv}"], ["envelope", "--group", "A", "{tsv}"],
                                     ["diagnose", "{ckpt}", "{tsv}"]])
def test_a_missing_or_folder_input_is_one_line_that_names_it(tmp_path, capsys, command):
    folder = tmp_path / "runs"
    folder.mkdir()
    for tsv, problem in ((tmp_path / "out" / "x.tsv", "no such file"),
                         (folder, "is a folder; give a certification TSV")):
        assert main([word.format(tsv=tsv, ckpt=tmp_path / "missing.pt") for word in command]) == 2
        assert _one_line_error(capsys) == f"error: {tsv}: {problem}\n"


def test_diagnose_names_its_sidecar_and_checkpoint_problems(tmp_path, capsys):
    tsv = tmp_path / "a.tsv"
    tsv.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0.1\n")
    assert main(["diagnose", str(tmp_path / "run"), str(tsv)]) == 2
    assert f"{tsv}: its sidecar {tsv}.json is missing; diagnose needs the one `splitz certify` wrote" in (
        _one_line_error(capsys))
    Path(f"{tsv}.json").write_text(json.dumps({"sigma": 0.5}))
    assert main(["diagnose", str(tmp_path / "run"), str(tsv)]) == 2
    assert f"{tsv}: its sidecar records no dataset, split; " in _one_line_error(capsys)
    Path(f"{tsv}.json").write_text(json.dumps({"sigma": 0.5, "dataset": "mnist", "split": "test"}))
    (tmp_path / "run").mkdir()
    assert main(["diagnose", str(tmp_path / "run"), str(tsv)]) == 2
    assert f"checkpoint {tmp_path / 'run'} is a folder; give a checkpoint file" in _one_line_error(capsys)


@pytest.mark.parametrize("argv, expected", [
    (["certify", "mnist", "ck.pt", "0.5", "out.tsv", "--protocol", "fancy"],
     "splitz certify: error: argument --protocol: invalid choice: 'fancy' (choose from 'sound', 'displacement', "
     "'paper', 'published-code') — see `splitz certify --help`"),
    (["certify", "mnist", "ck.pt", "abc", "out.tsv"],
     "splitz certify: error: argument sigma: invalid float value: 'abc' — see `splitz certify --help`"),
    (["train", "tiny", "mlp", "run"], "splitz train: error: the following arguments are required: --sigma — see "
                                      "`splitz train --help`"),
    (["certfy"], "splitz: error: argument command: invalid choice: 'certfy' (choose from "),
])
def test_parser_errors_are_one_line_that_points_to_help(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(expected) and "usage" not in err, err
    assert err.endswith(f" — see `{expected.split(':')[0]} --help`\n") and list(tmp_path.iterdir()) == []


def test_help_lists_dataset_names_and_every_default():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps the subparsers here
    for name in ("train", "certify", "predict", "certify-margin"):
        text = " ".join(commands[name].format_help().split())
        assert all(dataset in text for dataset in DATASETS), name
    for name, sub in commands.items():
        text = " ".join(sub.format_help().split())
        shown = [a for a in sub._actions if a.option_strings and not a.required
                 and a.default not in (None, argparse.SUPPRESS) and a.default is not False]
        assert all(a.help for a in sub._actions), name
        assert text.count("(default: ") == len(shown), name


# ------------------------------------------------------------------------------------------------ reproducibility
def test_identical_trainings_give_identical_checkpoints_and_certify_resumes_with_either(tmp_path, capsys, tiny):
    first, second = _train(tmp_path / "a"), _train(tmp_path / "b")
    a = torch.load(first, weights_only=True)
    assert all("epoch_seconds" not in record for record in a["history"])  # no wall times in checkpoints ...
    log = [json.loads(line) for line in (tmp_path / "a" / "train.log").read_text().splitlines()]
    assert all(record["epoch_seconds"] >= 0 for record in log)  # ... they are in the training log
    assert checkpoint_digest(a) == checkpoint_digest(load_checkpoint_file(second))
    assert first.read_bytes() != b"" and first.read_bytes() == second.read_bytes()

    out = tmp_path / "out.tsv"
    with pytest.MonkeyPatch.context() as patch:
        _interrupt_on_call(patch, windows, "clopper_pearson_lower", 2)
        assert main(_certify_args(first, out)) == 130
    sidecar = json.loads((tmp_path / "out.tsv.json").read_text())
    assert sidecar["checkpoint_digest"] == checkpoint_digest(a)
    assert sidecar["checkpoint_digest_covers"] == CHECKPOINT_DIGEST_COVERS
    assert main(_certify_args(second, out, "--resume")) == 0  # the retrained twin is the same model
    assert len(out.read_text().splitlines()) == 1 + 4

    other = _train(tmp_path / "c", "--seed", "1")
    capsys.readouterr()
    assert main(_certify_args(other, out, "--resume")) == 2
    assert "checkpoint_digest" in _one_line_error(capsys)
