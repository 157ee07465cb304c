"""The first stages of scripts/gpu_checks.sh on the CPU: ``python -m benchmarks.targets`` (SPEC §5's target table
against the naive loop) in its quick mode, end to end, and its outputs' structure — so that the GPU session's
first minutes cannot be lost to a broken script."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
WORKLOADS = ("mnist-lenet", "cifar10-resnet110", "imagenet-resnet50")


def run_targets(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.targets", "--quick", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def outputs(out: Path) -> tuple[dict, list[dict], str]:
    data = json.loads((out / "targets.json").read_text())
    with (out / "targets.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    return data, rows, (out / "targets.md").read_text()


@pytest.mark.slow
def test_quick_mode_end_to_end_writes_the_target_table(tmp_path: Path):
    done = run_targets(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data, csv_rows, md = outputs(tmp_path)
    env = data["environment"]
    assert env["device"] and env["torch"] and "triton" in env
    rows = data["parts"]["targets"]["rows"]
    assert data["parts"]["targets"]["settings"]["quick"] is True
    # 3 workloads × s = 0, 1 × fp32, bf16, in the order the header of gpu_checks.sh states
    assert [(r["workload"], r["split"], r["precision"]) for r in rows] == [
        (w, s, p) for w in WORKLOADS for s in (0, 1) for p in ("float32", "bfloat16")]
    for r in rows:
        assert r["status"] == "ok", r
        for key in ("ours_s_per_image", "naive_s_per_image", "ratio_vs_naive"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ratio_vs_naive"] == pytest.approx(r["naive_s_per_image"] / r["ours_s_per_image"])
        assert r["images"] == 1 and r["warmup_images"] == 1 and r["naive_precision"] == "float32"
        assert 0 <= r["certified"] <= r["images"] and r["target_s"] > 0
    native = data["parts"]["native"]["rows"]
    assert native == [{"what": "native CUDA vs Triton", "status": "skipped", "error": "needs CUDA"}]
    assert len(csv_rows) == len(rows) + len(native)
    assert all(float(r["ratio_vs_naive"]) > 0 for r in csv_rows if r["part"] == "targets")
    assert f"Card: **{env['device']}**" in md and "Quick mode: smoke-test numbers" in md
    assert md.count("| s = ") == len(rows) and "SPLITZ / RS" in md and "Native CUDA kernels" in md


@pytest.mark.slow
def test_every_failed_row_is_recorded_and_the_next_one_runs(tmp_path: Path):
    """On the meta device every measurement fails (at s = 0 the loop, then each of ours; at s = 1 already the radius
    search's set-up, for the whole group): every failure is recorded, the run goes on to the end, the native part still
    runs, and the files are written; then a second part merges into the same files."""
    done = run_targets(tmp_path, "--device", "meta")
    assert done.returncode == 0, done.stderr[-3000:]
    data, csv_rows, md = outputs(tmp_path)
    rows = data["parts"]["targets"]["rows"]
    groups = [(r["workload"], r["split"]) for r in rows]
    assert sorted(set(groups), key=groups.index) == [(w, s) for w in WORKLOADS for s in (0, 1)]
    assert all(r["status"] == "error" and r["error"] for r in rows)
    per_precision = [r for r in rows if "precision" in r]  # s = 0: the loop failed, ours was still tried
    assert [r["precision"] for r in per_precision] == ["float32", "bfloat16"] * 3
    assert all(r["naive_errors"] and r["naive_s_per_image"] is None for r in per_precision)
    assert md.count("| error: ") == len(rows) and len(csv_rows) == len(rows) + 1
    done = run_targets(tmp_path, "--part", "targets", "--budget", "0")  # budget spent: every group skipped
    assert done.returncode == 0, done.stderr[-3000:]
    data, _, md = outputs(tmp_path)
    assert [r["status"] for r in data["parts"]["targets"]["rows"]] == ["skipped"] * 6
    assert data["parts"]["native"]["rows"][0]["status"] == "skipped"  # the other part's rows are kept


def test_gpu_checks_runs_the_target_table_first():
    """The header promises the order: stage 1 the target table, stage 2 native CUDA vs Triton, then the rest."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    code = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    first = code.index("benchmarks.targets --part targets")
    native = code.index("benchmarks.targets --part native")
    assert first < code.index("splitz_fast.kernels.native_cuda\n") < native < code.index("train mnist lenet")
    assert native < code.index("mnist_envelope.sh") and native < code.index("pytest")
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    for promise in ("1. SPEC §5's target table", "2. native CUDA vs Triton", "n0 = 100, α = 0.001", "warm-up",
                    "random weights and synthetic", "targets.json", "targets.md", "CHECKS=0"):
        assert promise in header, promise
