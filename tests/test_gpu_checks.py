"""The first stages of scripts/gpu_checks.sh on the CPU: ``python -m benchmarks.targets`` (SPEC §5's target table
against Cohen et al.'s algorithm as a naive loop and against the card's floor) in its quick mode, end to end, and its
outputs' structure — so that the GPU session's first minutes cannot be lost to a broken script; and the pieces behind
the new columns (benchmarks/floor.py's counts and floors, benchmarks/compile_watch.py's timed-region checks)."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
WORKLOADS = ("mnist-lenet", "cifar10-resnet110", "imagenet-resnet50")
if str(ROOT / "benchmarks") not in sys.path:  # the benchmark modules import each other by bare name
    sys.path.insert(0, str(ROOT / "benchmarks"))

import compile_watch  # noqa: E402
import floor  # noqa: E402

# SPEC §5: LeNet's forward, FLOPs and activation elements per sample; conv1 of LeNet (1→32, 3×3 at 28×28), which f_L
# holds at s = 1: 2 × 32 × 28 × 28 × 9 FLOPs.
LENET_FLOPS, LENET_ELEMENTS, LENET_CONV1_FLOPS = 8.9e6, 88e3, 2 * 32 * 28 * 28 * 9
FLOOR_COLUMNS = slice(9, 13)  # compute floor, memory floors, ours ÷ floor, ours ÷ fused floor


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
        (w, s, p) for w in WORKLOADS for s in (0, 1) for p in ("float32", "tf32", "bfloat16")]
    by_key = {(r["workload"], r["split"], r["precision"]): r for r in rows}
    for r in rows:
        assert r["status"] == "ok", r
        for key in ("ours_s_per_image", "naive_s_per_image", "ratio_vs_naive"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ratio_vs_naive"] == pytest.approx(r["naive_s_per_image"] / r["ours_s_per_image"])
        assert r["images"] == 1 and r["warmup_images"] == 1 and r["naive_precision"] == "float32"
        assert r["baseline"].startswith("Cohen et al. algorithm (naive loop)")
        assert 0 <= r["certified"] <= r["images"] and r["target_s"] > 0
        # targets: s = 0 SPEC's figure; s = 1 the same model's s = 0 time at the same precision plus 1.5× its RNG
        # floor (the normals its latent draws at the rate measured in the run); ≥ 5× the loop
        if r["split"] == 0:
            fp32 = {"mnist-lenet": 0.015}.get(r["workload"], 0.45)  # the fp32 / TF32 target
            assert r["target_s"] == {"float32": fp32, "tf32": fp32,
                                     "bfloat16": {"mnist-lenet": 0.008}.get(r["workload"], 0.25)}[r["precision"]]
        else:
            rs = by_key[(r["workload"], 0, r["precision"])]["ours_s_per_image"]
            assert r["normal_rate"] == data["parts"]["targets"]["settings"]["normal_rate"] > 0
            assert r["rng_floor_s"] == pytest.approx((r["n0"] + r["n"]) * r["noise_per_sample"] / r["normal_rate"])
            assert r["target_s"] == pytest.approx(rs + 1.5 * r["rng_floor_s"])
        assert r["target_met"] == (r["ours_s_per_image"] <= r["target_s"])
        assert r["vs_loop_met"] == (r["ratio_vs_naive"] >= 5)
        # the counted cost of f_R per sample; no floor on a CPU (no card figures)
        assert 0 < r["fused_activation_elements_per_sample"] < r["activation_elements_per_sample"]
        assert r["activation_bytes_per_sample"] == r["activation_elements_per_sample"] * {
            "float32": 4, "tf32": 4, "bfloat16": 2}[r["precision"]]
        assert r["samples_per_image"] == r["n0"] + r["n"]
        for key in ("card", "peak", "compute_floor_s", "memory_floor_s", "fused_memory_floor_s", "floor_s",
                    "fused_floor_s", "ours_over_floor", "ours_over_fused_floor", "fused_floor_met"):
            assert r.get(key) is None, (key, r)
        # nothing compiled while timed (ours, and the loop's timed region), and the warm-up's f_R batches were seen
        assert r["compiled_in_timed_region"] is False and r["naive_compiled_in_timed_region"] is False, r
        compiles = r["timed_region_compiles"]
        assert compiles["dynamo_frames"] == 0 and compiles["new_batch_shapes"] == []
        assert compiles["warmup_batch_shapes"] >= 1
    lenet = [r for r in rows if r["workload"] == "mnist-lenet"]
    for r in lenet:  # the quick LeNet has the full 28×28 input: SPEC §5's counts, within ±20 %
        whole = by_key[("mnist-lenet", 0, r["precision"])]
        assert whole["flops_per_sample"] == pytest.approx(LENET_FLOPS, rel=0.2)
        assert whole["activation_elements_per_sample"] == pytest.approx(LENET_ELEMENTS, rel=0.2)
        if r["split"] == 1:  # f_R without conv1, which f_L holds
            assert r["flops_per_sample"] == whole["flops_per_sample"] - LENET_CONV1_FLOPS
    for r in rows:
        if r["workload"] != "mnist-lenet":  # the ResNets: the fused chains write about a third
            assert 0.2 < r["fused_activation_elements_per_sample"] / r["activation_elements_per_sample"] < 0.4
    native = data["parts"]["native"]["rows"]
    assert native == [{"what": "native CUDA vs Triton", "status": "skipped", "error": "needs CUDA"}]
    assert len(csv_rows) == len(rows) + len(native)
    assert all(float(r["ratio_vs_naive"]) > 0 and float(r["flops_per_sample"]) > 0 and r["floor_s"] == ""
               for r in csv_rows if r["part"] == "targets")
    assert f"Card: **{env['device']}**" in md and "Quick mode: smoke-test numbers" in md
    assert md.count("| s = ") == len(rows) and "SPLITZ / RS" in md
    assert "Settings and kernels compared on the device" in md
    assert "| Cohen et al. algorithm (naive loop), s/image (batch) |" in md and "no card figures" in md
    table = [line.split(" | ") for line in md.splitlines() if "| s = " in line]
    for cells, r in zip(table, rows):
        assert cells[FLOOR_COLUMNS] == ["—", "— / —", "—", "—"], cells
        # no CUDA graph or compiled copy on the CPU; the fused copy where the C++ conv + pool site measured faster
        assert cells[-2] == "no" and cells[7] == f"{r['flops_per_sample'] / 1e9:.3g}", cells
        assert cells[-1] == "— |" or (cells[-1].startswith("fused ") and "graph" not in cells[-1]), cells


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
    assert [r["precision"] for r in per_precision] == ["float32", "tf32", "bfloat16"] * 3
    assert all(r["naive_errors"] and r["naive_s_per_image"] is None for r in per_precision)
    assert md.count("| error: ") == len(rows) and len(csv_rows) == len(rows) + 1
    done = run_targets(tmp_path, "--part", "targets", "--budget", "0")  # budget spent: every group skipped
    assert done.returncode == 0, done.stderr[-3000:]
    data, _, md = outputs(tmp_path)
    assert [r["status"] for r in data["parts"]["targets"]["rows"]] == ["skipped"] * 6
    assert data["parts"]["native"]["rows"][0]["status"] == "skipped"  # the other part's rows are kept


@pytest.mark.slow  # about 15-25 s on the 2-core machine: make test-slow runs it
def test_the_targets_part_runs_the_named_workloads_and_precisions_in_order(tmp_path: Path):
    """--workloads and --precisions (what gpu_checks.sh's WORKLOADS and PRECISIONS pass): the named groups in the given
    order, only the named precisions, recorded in the settings; an unknown name is a usage error that lists the known
    ones. (On the meta device every row fails at once: the selection is what is checked.)"""
    done = run_targets(tmp_path, "--device", "meta", "--part", "targets", "--workloads",
                       "imagenet-resnet50,mnist-lenet", "--precisions", "bfloat16")
    assert done.returncode == 0, done.stderr[-3000:]
    data, _, _ = outputs(tmp_path)
    rows = data["parts"]["targets"]["rows"]
    groups = [(r["workload"], r["split"]) for r in rows]
    assert sorted(set(groups), key=groups.index) == [("imagenet-resnet50", 0), ("imagenet-resnet50", 1),
                                                     ("mnist-lenet", 0), ("mnist-lenet", 1)]
    assert {r["precision"] for r in rows if "precision" in r} == {"bfloat16"}
    settings = data["parts"]["targets"]["settings"]
    assert settings["workloads"] == ["imagenet-resnet50", "mnist-lenet"] and settings["precisions"] == ["bfloat16"]
    for bad, known in ((("--workloads", "lenet"), "mnist-lenet"), (("--precisions", "fp64"), "bfloat16")):
        done = run_targets(tmp_path, *bad)
        assert done.returncode == 2 and known in done.stderr, done.stderr[-2000:]


def test_gpu_checks_runs_the_smoke_stage_then_the_target_table_first():
    """The header promises the order: the smoke stage, then stage 1 the target table, stage 2 graphs and native CUDA vs
    Triton, then the rest."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    code = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    first = code.index("benchmarks.targets --part targets")
    assert code.index("-m benchmarks.smoke") < first
    native = code.index("benchmarks.targets --part native")
    assert first < code.index("splitz_fast.kernels.native_cuda\n") < native < code.index("train mnist lenet")
    assert native < code.index("mnist_envelope.sh") and native < code.index("pytest")
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    for promise in ("0b. the smoke stage", "1. SPEC §5's target table", "2. CUDA graphs, fused pool, native CUDA vs Triton", "n0 = 100, α = 0.001", "warm-up",
                    "random weights and synthetic", "targets.json", "targets.md", "CHECKS=0"):
        assert promise in header, promise


# ------------------------------------------------------------------------------------------------ the pieces
def test_the_smoke_stage_and_make_test_run_under_splitz_strict():
    """A path that falls back fails with its cause in the smoke stage, and so does any fallback in `make test`."""
    assert "env SPLITZ_STRICT=1 $PY -m benchmarks.smoke" in (ROOT / "scripts" / "gpu_checks.sh").read_text()
    test_recipe = (ROOT / "Makefile").read_text().split("\ntest: install\n")[1].split("\n\n")[0]
    assert 'SPLITZ_STRICT=$${SPLITZ_STRICT:-1} $(BIN)/python -m pytest -q -m "not slow" tests' in test_recipe


def test_floors_reproduce_spec_figures_on_an_h100():
    """SPEC §5's per-image floors on one H100 (bf16, ≈ 990 TFLOP/s and ≈ 3 TB/s) from its per-sample counts: compute
    0.9 ms / 51 ms / 83 ms and memory (bf16, written and read once) ≈ 12 ms / 0.49 s / 0.43 s."""
    card = floor.card_for("NVIDIA H100 80GB HBM3")
    assert card is floor.H100_SXM and card.bandwidth == 3.0e12
    for flops, elements, samples, compute, memory in ((8.9e6, 88e3, 100_100, 0.9e-3, 12e-3),
                                                      (0.51e9, 3.7e6, 100_100, 51e-3, 0.49),
                                                      (8.2e9, 32e6, 10_100, 83e-3, 0.43)):
        cost = floor.Cost(flops, flops, 0.0, int(elements), int(elements / 3), 0, {})
        row = floor.floors(cost, "bfloat16", samples, card)
        assert row["compute_floor_s"] == pytest.approx(compute, rel=0.03)
        assert row["memory_floor_s"] == pytest.approx(memory, rel=0.03)
        assert row["floor_s"] == max(row["compute_floor_s"], row["memory_floor_s"])
        assert row["fused_memory_floor_s"] == pytest.approx(row["memory_floor_s"] / 3, rel=1e-3)
        assert row["fused_floor_s"] == max(row["compute_floor_s"], row["fused_memory_floor_s"])
    # the row's precision is how the engine runs f_R: float32 as IEEE fp32 (cuDNN's TF32 off), tf32 on tensor cores
    cost = floor.Cost(3e9, 2e9, 1e9, 10, 5, 0, {})
    row = floor.floors(cost, "float32", 1, card, bandwidth=2.5e12)
    assert row["compute_floor_s"] == pytest.approx(3e9 / 67e12) and row["peak"] == "FP32 67 TFLOP/s"
    assert row["memory_floor_s"] == pytest.approx(2 * 10 * 4 / 2.5e12) and row["bandwidth_source"].startswith("meas")
    row = floor.floors(cost, "tf32", 1, card)
    assert row["compute_floor_s"] == pytest.approx(3e9 / 495e12) and row["peak"] == "TF32 495 TFLOP/s"
    # H200: the H100's compute, 4.8 TB/s; a CPU or a card without figures: bytes only, no floor
    assert floor.card_for("NVIDIA H200").bandwidth == 4.8e12 and floor.card_for("NVIDIA H200").bf16_flops == 989e12
    for name in ("CPU (x86_64)", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 NVL", None):
        assert floor.card_for(name) is None
    row = floor.floors(cost, "bfloat16", 7, None)
    assert row["activation_bytes_per_sample"] == 20 and row["floor_s"] is None and row["compute_floor_s"] is None


def test_the_rng_floor_adds_to_the_compute_floor_and_sets_the_s1_target():
    """LeNet at s = 1 draws 25,088 normals per sample, 2.5 × 10⁹ per image at n0 + n = 100,100: its floor and its
    target include drawing them (at 3 × 10¹¹ normals/s, 8.4 ms), where 1.2× the s = 0 time cannot hold them."""
    from benchmarks.targets.workloads import FULL, RNG_FLOOR_FACTOR, targets_for

    rng = floor.rng_floor(32 * 28 * 28, 100_100, 3e11)
    assert rng["rng_floor_s"] == pytest.approx(25_088 * 100_100 / 3e11) == pytest.approx(8.37e-3, rel=1e-3)
    card = floor.card_for("NVIDIA H100 80GB HBM3")
    cost = floor.Cost(8.9e6, 8.9e6, 0.0, 88_000, 30_000, 0, {})
    plain, with_noise = (floor.floors(cost, "bfloat16", 100_100, card, rng_floor_s=r) for r in (0.0, rng["rng_floor_s"]))
    assert with_noise["floor_s"] == max(plain["compute_floor_s"] + rng["rng_floor_s"], plain["memory_floor_s"])
    assert with_noise["fused_floor_s"] == plain["compute_floor_s"] + rng["rng_floor_s"] > plain["fused_floor_s"]
    lenet = FULL[0]
    target = targets_for(lenet, 1, "bfloat16", {"bfloat16": 0.006}, rng["rng_floor_s"])
    assert target["target_s"] == pytest.approx(0.006 + RNG_FLOOR_FACTOR * rng["rng_floor_s"])
    assert "RNG floor" in target["target_rule"]
    assert targets_for(lenet, 1, "bfloat16", {"bfloat16": 0.006})["target_s"] == pytest.approx(1.2 * 0.006)
    assert targets_for(lenet, 1, "bfloat16", {})["target_s"] is None
    assert targets_for(lenet, 0, "bfloat16", None, 1.0)["target_s"] == 0.008  # SPEC's s = 0 row: no noise term
    assert floor.measure_normal_rate(torch.device("cpu"), count=1 << 16, repeats=2) > 1e6  # normals/s, measured


def test_count_cost_counts_flops_and_activation_writes_of_each_op():
    """Hand-counted: conv(1→2, 3×3, pad 1) on 4×4 → BN → ReLU → 2×2 max pool → flatten (a view) → linear(8→3); and a
    residual block (conv-BN-ReLU-conv-BN, + identity, ReLU) whose fused chains write two of its seven tensors."""
    from splitz_fast.zoo.models import BasicBlock

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.BatchNorm2d(2), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    cost = floor.count_cost(net, torch.rand(1, 4, 4))
    assert (cost.conv_flops, cost.matmul_flops, cost.flops) == (2 * 2 * 16 * 9, 2 * 8 * 3, 2 * 2 * 16 * 9 + 2 * 8 * 3)
    assert cost.activation_elements == 32 + 32 + 32 + 8 + 3  # conv, BN, ReLU, pool, linear; the flatten view: 0
    assert cost.fused_activation_elements == 8 + 3  # conv+BN+ReLU+pool writes the pooled tensor; the linear its own
    assert cost.input_elements == 16
    block = floor.count_cost(BasicBlock(2, 2), torch.rand(2, 4, 4))
    assert block.flops == 2 * (2 * 2 * 16 * 2 * 9)
    assert block.activation_elements == 7 * 32 and block.fused_activation_elements == 2 * 32


def test_the_cpu_floor_times_every_heavy_layer_of_f_r_and_counts_its_flops():
    """benchmarks/cpu_floor.py on LeNet's f_R at s = 0: its four Conv2d / Linear layers in forward order, their
    FLOPs summing to what FlopCounterMode counts for the whole f_R, both layouts timed for each convolution at each
    of its batches (the best taken), and the floor per image = samples × (layer floor + RNG floor)."""
    import cpu_floor

    import splitz_fast as sz

    right = sz.lenet(split_index=0).right.eval()
    latent = torch.rand(1, 28, 28)
    assert [name for name, _, _ in cpu_floor.heavy_layers(right, latent)] == ["0", "3", "7", "9"]
    result = cpu_floor.cpu_floor(right, latent, batch=8, precision="bfloat16", samples=1000, normal_rate=1e9)
    layers = result["floor_layers"]
    assert sum(layer["flops_per_sample"] for layer in layers) == floor.count_cost(right, latent).flops
    assert [sorted(layer["gflops_by_layout"]) for layer in layers] == [["channels_last", "contiguous"]] * 2 + [
        ["contiguous"]] * 2
    assert all(layer["best_layout"] == max(layer["gflops_by_layout"], key=layer["gflops_by_layout"].get)
               for layer in layers)
    # each layer at its best batch too: a large batch can cost more per row than a smaller one
    assert all(layer["best_batch"] == 8 for layer in layers)
    assert cpu_floor.floor_batches(512) == (64, 256, 512) and cpu_floor.floor_batches(100) == (64, 100)
    assert cpu_floor.floor_batches(32) == (32,)
    assert result["rng_floor_s_per_sample"] == 784 / 1e9 and result["normal_rate_source"] == "given"
    from splitz_fast.kernels.native import native_available

    rates = cpu_floor.native_noise_rates(count=1 << 16, rounds=1)
    assert sorted(rates) == (["native", "native-pooled"] if native_available() else [])
    assert all(rate > 0 for rate in rates.values())
    assert result["floor_s_per_image"] == pytest.approx(1000 * (result["layer_floor_s_per_sample"] + 784 / 1e9))


def test_compile_counter_sees_dynamo_compiles_and_triton_compiles_only_inside_its_region(tmp_path, monkeypatch):
    compiled = torch.compile(lambda x: (x * 2).relu(), backend="eager", dynamic=False)
    with compile_watch.CompileCounter() as region:
        compiled(torch.ones(3))
    assert region.compiled and region.counts["dynamo_frames"] == 1 and region.counts["dynamo_graphs"] == 1
    with compile_watch.CompileCounter() as region:  # warm: a cache hit
        compiled(torch.ones(3))
    assert not region.compiled and region.counts["dynamo_frames"] == 0
    with compile_watch.CompileCounter() as region:  # a new shape: dynamo recompiles
        compiled(torch.ones(4))
    assert region.compiled and compile_watch.timed_region_record(region)["compiled_in_timed_region"] is True
    # Triton: a call of JITFunction._do_compile (what a @triton.jit kernel calls on a cache miss) inside the region
    jit = pytest.importorskip("triton.runtime.jit")
    with compile_watch.CompileCounter() as region:
        with pytest.raises(Exception):
            jit.JITFunction._do_compile(None, None, None, None, None, None, None, False)
    assert region.counts["triton_compiles"] == 1 and region.compiled
    # new entries of Triton's cache directory: a compilation on CUDA, ignored on a CPU
    monkeypatch.setattr(compile_watch, "triton_cache_dir", lambda: tmp_path)
    for device, expected in (("cpu", False), ("cuda", True)):
        with compile_watch.CompileCounter(device) as region:
            (tmp_path / device).mkdir()
        assert region.counts["triton_cache_files"] == 1 and region.compiled is expected


def test_batch_shapes_flags_an_f_r_batch_first_seen_after_the_warm_up():

    class Engine:
        def _scores(self, net, batch):
            return batch.sum()

    engine = Engine()
    with compile_watch.BatchShapes(engine) as shapes:
        engine._scores(None, torch.zeros(8, 3))
        engine._scores(None, torch.zeros(2, 3))
        shapes.freeze()
        engine._scores(None, torch.zeros(8, 3))  # seen in the warm-up
        assert shapes.new == []
        engine._scores(None, torch.zeros(8, 3, dtype=torch.bfloat16))  # a new dtype: cuDNN would autotune again
        engine._scores(None, torch.zeros(5, 3))
        engine._scores(None, torch.zeros(5, 3))
    assert "_scores" not in engine.__dict__  # the engine's own method again
    assert [s[:2] for s in shapes.new] == [((8, 3), "bfloat16"), ((5, 3), "float32")]
    with compile_watch.CompileCounter() as region:
        pass
    record = compile_watch.timed_region_record(region, shapes)
    assert record["compiled_in_timed_region"] is True and record["timed_region_compiles"]["warmup_batch_shapes"] == 2
    assert record["timed_region_compiles"]["new_batch_shapes"][1] == {"shape": [5, 3], "dtype": "float32",
                                                                      "stride": [3, 1]}


RENDER_GPU_ROW = r'''
import json, sys
sys.path.insert(0, "benchmarks")
import floor
from targets import report, workloads

NOISE_BYTES = 10_000 * 32 * 28 * 28 * 4  # 10,000 float32 LeNet s = 1 latents
cost = floor.Cost(8.9e6, 7.6e6, 1.3e6, 88_000, 9_600, 784, {})
row = dict(workload="mnist-lenet", label="MNIST LeNet", model="lenet", split=0, precision="bfloat16", n0=100,
           n=100_000, images=3, weights="random", inputs="synthetic", status="ok", gamma_search="bisection",
           bound_method="auto", ours_s_per_image=0.0030, naive_s_per_image=0.10, naive_batch=10_000, certified=3,
           naive_certified=3, gamma_evaluations_mean=0.0, **workloads.targets_for(workloads.FULL[0], 0, "bfloat16", None),
           **cost.record(), **floor.floors(cost, "bfloat16", 100_100, floor.card_for("NVIDIA H100 80GB HBM3"), 3.1e12),
           compiled_in_timed_region=True, naive_compiled_in_timed_region=False,
           timed_region_compiles=dict(dynamo_frames=0, dynamo_graphs=0, triton_compiles=2, triton_cache_files=0,
                                      warmup_batch_shapes=3, new_batch_shapes=[]),
           cuda_graphs=[dict(channels_last=True, pooled=False, batch=4096, used=True, reason="measured", eager_s=0.0021,
                             graph_s=0.0008),  # the eager copy's graph, then the compiled copy's (not used below)
                        dict(channels_last=True, pooled=False, fused=True, compiled=True, batch=4096, used=True,
                             reason="measured", eager_s=0.0009, graph_s=0.0007)],
           fused_kernels=[dict(channels_last=True, pooled=False, batch=4096, used=True, reason="measured",
                               plain_s=0.0021, fused_s=0.0012)],
           compiled=[dict(channels_last=True, pooled=False, fused=True, batch=4096, used=False, reason="measured",
                          compile_s=41.2, eager_s=0.0008, compiled_s=0.0009)])
row.update(workloads.assess(row))
graph_row = dict(what="MNIST LeNet s=0 CERTIFY n=100,000 bfloat16: CUDA graph vs eager", images=3, status="ok",
                 eager_s_per_image=0.0045, graph_s_per_image=0.0030, graph_speedup=1.5, compared=["eager", "graph"],
                 speedup_key="graph_speedup")
bound_row = dict(what="exact bound, LeNet conv1 Gram (d = 784): squaring vs eigvalsh estimate", status="ok",
                 eigvalsh_ms=9.4, squaring_ms=1.2, squaring_vs_eigvalsh=9.4 / 1.2, bound_relative_difference=2e-16,
                 compared=["eigvalsh", "squaring"], speedup_key="squaring_vs_eigvalsh")
ab_rows = [dict(what="fused noise + max pool", images=2, status="ok", unfused_s_per_image=0.112, fused_s_per_image=0.101,
                fused_speedup=0.112 / 0.101, compared=["unfused", "fused"], speedup_key="fused_speedup"),
           dict(what="torch.compile vs eager f_R", images=2, status="ok", eager_s_per_image=0.036,
                compiled_s_per_image=0.018, compile_speedup=2.0, compared=["eager", "compiled"],
                speedup_key="compile_speedup"),
           dict(what="exact bounds of one search round (6 Grams): batched vs one by one", status="ok", batched_ms=4.0,
                one_by_one_ms=16.0, batched_vs_one_by_one=4.0, bound_relative_difference=3e-16,
                compared=["one_by_one", "batched"], speedup_key="batched_vs_one_by_one")]
kernel_row = dict(what="kernel: noise fp32 channels_last", status="ok", cuda_ms=1.279, triton_ms=1.127,
                  reference_ms=9.5, cuda_vs_triton=1.127 / 1.279,
                  **floor.write_bandwidth(NOISE_BYTES, dict(cuda=1.279, triton=1.127), 3.1e12))
settings = dict(n0=100, alpha=0.001, sigma=0.25, images=3, quick=False, card=floor.asdict(floor.H100_SXM),
                copy_bandwidth_Bps=3.1e12, tf32_conv=True, tf32_matmul=False)
data = dict(environment=dict(device="NVIDIA H100 80GB HBM3"), parts=dict(targets=dict(settings=settings, rows=[row]),
                                                                      native=dict(rows=[graph_row, bound_row, *ab_rows,
                                                                                        kernel_row])))
print(json.dumps(dict(row=row, md=report.markdown(data), summary=report.summary(row))))
'''


def test_a_gpu_row_with_floors_renders_with_its_verdicts():
    """What the CPU run cannot show: a row on a card with figures — its floors, multiples, the three verdicts and a
    timed region that compiled — through ``assess``, ``markdown`` and ``summary`` as the GPU run calls them."""
    done = subprocess.run([sys.executable, "-c", RENDER_GPU_ROW], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    row, md = out["row"], out["md"]
    assert row["compute_floor_s"] == pytest.approx(100_100 * (7.6e6 + 1.3e6) / 989e12)
    assert row["memory_floor_s"] == pytest.approx(100_100 * 2 * 88_000 * 2 / 3.1e12)
    assert row["floor_s"] == row["memory_floor_s"] and row["fused_floor_s"] == row["fused_memory_floor_s"]
    assert row["ours_over_floor"] == pytest.approx(0.0030 / row["floor_s"])
    assert row["target_met"] is True and row["vs_loop_met"] is True  # 3 ms ≤ 8 ms; 33× the loop
    assert row["fused_floor_met"] is False and row["all_targets_met"] is False  # 2.4× the fused floor (1.24 ms)
    (cells,) = [line.split(" | ") for line in md.splitlines() if "| s = " in line]
    assert cells[7] == "0.0089" and cells[8] == "0.176 / 0.0192"
    assert cells[FLOOR_COLUMNS] == [f"{row['compute_floor_s']:.3g}",
                                    f"{row['memory_floor_s']:.3g} / {row['fused_memory_floor_s']:.3g}",
                                    f"{row['ours_over_floor']:.1f}×", f"{row['ours_over_fused_floor']:.1f}×"]
    assert cells[13] == "≤ 0.0080 (SPEC §5, one H100)" and cells[14] == "yes / yes / **no**"
    assert cells[15] == "**yes** (triton compiles 2)" and cells[16] == ("yes (2.10 → 0.80 ms/batch); fused yes (2.10 → 1.20 ms/batch); "
                                                        "compiled no (0.80 → 0.90 ms/batch, compiling 41 s) |")
    assert ("| MNIST LeNet s=0 CERTIFY n=100,000 bfloat16: CUDA graph vs eager (3 images) | graph 0.0030 s/image | "
            "eager 0.0045 s/image | — | 1.50× (graph vs eager) |") in md
    assert ("| exact bound, LeNet conv1 Gram (d = 784): squaring vs eigvalsh estimate | squaring 1.20 ms | eigvalsh "
            "9.40 ms | — | 7.83× (squaring vs eigvalsh) (bounds 2.0e-16 apart) |") in md
    assert ("| fused noise + max pool (2 images) | fused 0.1010 s/image | unfused 0.1120 s/image | — | 1.11× (fused "
            "vs unfused) |") in md
    assert ("| torch.compile vs eager f_R (2 images) | compiled 0.0180 s/image | eager 0.0360 s/image | — | 2.00× "
            "(compiled vs eager) |") in md
    assert ("| exact bounds of one search round (6 Grams): batched vs one by one | batched 4.00 ms | one by one 16.00 ms "
            "| — | 4.00× (batched vs one by one) (bounds 3.0e-16 apart) |") in md
    assert "H100 SXM" in md and "3.10 TB/s measured" in md and "2.4x the fused floor" in out["summary"]
    assert "COMPILED IN THE TIMED REGION" in out["summary"]
    assert ("| kernel: noise fp32 channels_last | 1.279 ms (0.78 TB/s written, 25% of copy **(< 70%)**) | 1.127 ms "
            "(0.89 TB/s written, 29% of copy **(< 70%)**) | 9.500 ms | 0.88× |") in md


def test_the_noise_kernels_write_bandwidth_is_a_fraction_of_the_copy_bandwidth():
    """Stage 2b's noise kernel rows: bytes written ÷ time per kernel, as a fraction of the card's measured copy
    bandwidth, met where the better kernel reaches 70 % of it (issue #28's target); made-up timings."""
    written = 10_000 * 32 * 28 * 28 * 4  # 10,000 float32 LeNet s = 1 latents, about 1 GB
    row = floor.write_bandwidth(written, dict(cuda=1.279, triton=1.127), 3.1e12)
    assert row["bytes_written"] == 1_003_520_000 and row["copy_bandwidth_Bps"] == 3.1e12
    assert row["cuda_write_Bps"] == pytest.approx(7.846e11, rel=1e-3)
    assert row["triton_write_Bps"] == pytest.approx(8.904e11, rel=1e-3)
    assert row["triton_of_copy_bandwidth"] == pytest.approx(0.2872, rel=1e-3)
    assert row["cuda_of_copy_bandwidth"] == pytest.approx(0.2531, rel=1e-3)
    assert floor.WRITE_BANDWIDTH_TARGET == 0.70 and row["write_bandwidth_met"] is False
    fast = floor.write_bandwidth(written, dict(cuda=1.279, triton=0.46), 3.1e12)  # 2.18 TB/s: 70.4 % of 3.1 TB/s
    assert fast["triton_of_copy_bandwidth"] == pytest.approx(0.7037, rel=1e-3) and fast["write_bandwidth_met"] is True
    unmeasured = floor.write_bandwidth(written, dict(cuda=1.279, triton=0.46), None)  # no copy bandwidth: no verdict
    assert unmeasured["triton_of_copy_bandwidth"] is None and unmeasured["write_bandwidth_met"] is None
    assert unmeasured["triton_write_Bps"] == fast["triton_write_Bps"]


ASSESS_COMPILED_ROWS = r'''
import json, sys
sys.path.insert(0, "benchmarks")
from targets.workloads import assess

# 4 ms against an 8 ms target, 25x the loop, 1.3x the fused floor: every target met, as long as nothing compiled.
row = dict(ours_s_per_image=0.004, target_s=0.008, naive_s_per_image=0.10, floor_s=0.003, fused_floor_s=0.003)
print(json.dumps([assess(dict(row, **compiled)) for compiled in
                  ({}, dict(compiled_in_timed_region=True), dict(naive_compiled_in_timed_region=True))]))
'''


def test_a_row_that_compiled_in_a_timed_region_meets_no_target():
    """A made-up GPU row whose times meet all three targets: met without compilation, not met when our timed region or
    the loop's compiled (the time is not the steady state; the loop's would inflate the ratio)."""
    done = subprocess.run([sys.executable, "-c", ASSESS_COMPILED_ROWS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    clean, ours_compiled, loop_compiled = json.loads(done.stdout)
    for verdicts in (clean, ours_compiled, loop_compiled):
        assert verdicts["target_met"] is verdicts["vs_loop_met"] is verdicts["fused_floor_met"] is True
    assert clean["all_targets_met"] is True
    assert ours_compiled["all_targets_met"] is False and loop_compiled["all_targets_met"] is False


@pytest.mark.slow  # about 15-25 s on the 2-core machine: make test-slow runs it
def test_the_fused_kernel_rows_measure_both_settings(tmp_path: Path):
    """The A/B rows of the fused f_R copy against the plain one (stage 2b runs them on CUDA; the default measures the
    same choice at run time) in quick mode on the CPU, in a process of their own (as the script runs them): one row
    per case, both settings timed, the speedup recorded."""
    code = f"""if True:
        import json, math, torch
        from benchmarks.targets import comparisons, measure, report
        recorder = measure.Recorder(__import__("pathlib").Path({str(tmp_path)!r}), "native", {{}})
        comparisons.run_fused_kernels_comparison(recorder, 1, torch.device("cpu"), True, math.inf)
        rows = recorder.data["parts"]["native"]["rows"]
        print(json.dumps(dict(rows=rows, count=len(comparisons.FUSED_COMPARISONS),
                              cells=[report.ab_cell(r) for r in rows if r["status"] == "ok"])))
    """
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["rows"]) == result["count"] == len(result["cells"])
    for row, cell in zip(result["rows"], result["cells"]):
        assert row["status"] == "ok", row.get("error")
        assert row["compared"] == ["plain_kernels", "fused_kernels"] and row["fused_kernels_speedup"] > 0
        assert "fused kernels vs plain f_R" in row["what"] and cell.startswith("| ")


def test_the_gram_build_row_times_both_stencils_and_restores_the_default():
    """Stage 2b's Gram-construction row (gathered vs tap-by-tap stencil) on the CPU, in its own process: both timed,
    the two Grams equal to rounding, ``gram.GATHERED_STENCIL_DEVICES`` as it was."""
    code = """if True:
        import json, torch
        from benchmarks.targets import comparisons, report
        from splitz_fast.bounds import gram
        default = gram.GATHERED_STENCIL_DEVICES
        row = comparisons.gram_build_case(torch.device("cpu"), repeats=2)
        print(json.dumps(dict(row=row, restored=gram.GATHERED_STENCIL_DEVICES == default, cell=report.ab_cell(row))))
    """
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    row = result["row"]
    assert result["restored"] and row["status"] == "ok" and row["tapwise_ms"] > 0 and row["gathered_ms"] > 0
    assert row["gram_relative_difference"] < 1e-13 and "gathered" in result["cell"]
