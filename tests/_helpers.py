"""Helpers shared by the test files (importable because pytest puts this folder on sys.path)."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

#: torchrun of the interpreter running the tests.
TORCHRUN = Path(sys.executable).with_name("torchrun")


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` (e.g. an offline data package) is installed."""
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def kernel_devices() -> list:
    """Where a Triton kernel test runs: Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by
    conftest.py without a GPU) and, marked ``gpu``, CUDA tensors where a GPU exists."""
    import os

    import pytest
    import torch

    has_triton = importlib.util.find_spec("triton") is not None
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return [
        pytest.param("cpu", id="interp", marks=pytest.mark.skipif(not (has_triton and interpret),
                                                                 reason="needs triton with TRITON_INTERPRET=1")),
        pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not (has_triton and torch.cuda.is_available()), reason="needs CUDA")]),
    ]


def start_torchrun(args: list[str], program: tuple[str, ...] = ("-m", "splitz_fast"), **popen) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=2 -m splitz_fast ARGS`` (or another ``program``, e.g. a script's
    path) in its own session (so that a hung run can be killed whole), one thread per rank, without the torchrun
    variables of any enclosing job."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "--monitor-interval=0.1", *program, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def finish_torchrun(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """``(exit status, output)`` of a run from :func:`start_torchrun`; killed whole, and the test failed, after
    ``timeout`` seconds."""
    import pytest

    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Every process of the run, found before any is killed: some torch versions start the ranks in sessions of
        # their own, which killing torchrun's group misses; a rank left alive would hold the output pipe open forever.
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "(no output: a process outside the run's tree still holds its pipe)"
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), read from ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            child = int(stat.parent.name)
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state
            children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def small_splitz(seed: int = 0):
    """Conv f_L (1→3 channels on 6×6) and a small conv f_R with BatchNorm, and 7 inputs: every engine path, in
    milliseconds. Returns ``(SplitModel, inputs [7, 1, 6, 6])``."""
    import torch
    import torch.nn as nn

    import splitz_fast as sz

    torch.manual_seed(seed)
    left = sz.LeftHalf([nn.Conv2d(1, 3, 3, padding=1)], [sz.ClippedReLU(1.0)], input_shape=(1, 6, 6))
    right = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    with torch.no_grad():
        right[1].running_mean.uniform_(-0.2, 0.2)
        right[1].running_var.uniform_(0.5, 2.0)
    xs = torch.rand(7, 1, 6, 6, generator=torch.Generator().manual_seed(seed + 100))
    return sz.SplitModel(left, right, 5), xs


#: ``splitz train`` options of a tiny, fast training run (the command-line tests).
TINY_TRAIN_OPTIONS = ["--sigma", "0.5", "--epochs", "2", "--batch", "8", "--val-fraction", "0.25", "--lr-schedule",
                      "none"]


def one_line_error(capsys) -> str:
    """What a command printed on stderr, checked to be one ``error: ...`` line without a traceback."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err
