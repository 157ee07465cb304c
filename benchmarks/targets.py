"""SPEC §5's target table end to end, each row against Cohen et al.'s certification algorithm run as a naive loop in
the same process, and against the floor the card allows.

``python -m benchmarks.targets --out DIR`` (from the repository root) measures, in this order:

``--part targets`` (stage 1 of scripts/gpu_checks.sh): on CUDA first the card's copy bandwidth (a 1 GiB ``copy_``,
benchmarks/floor.py), then for each workload, split s = 0 (RS) then s = 1 (SPLITZ),

0. the cost of one sample through the model's ``f_R``, counted once (not timed; benchmarks/floor.py: FLOPs with
   ``torch.utils.flop_counter.FlopCounterMode``, activation elements written by every aten op of the forward, unfused
   and as a conv + BN + ReLU (+ pool) / + residual-add fusion would write them);
1. **Cohen et al.'s algorithm (naive loop)**: ``Smooth.certify`` of Cohen et al. 2019 (locuslab/smoothing, core.py) as
   written — per input ``x.repeat(b)`` → the whole fp32 eager model → predictions copied to the host and counted in
   Python, n0 selection draws then n estimation draws, Clopper–Pearson — plus the same sound radius search as ours for
   every certified input (benchmarks/test_bench_certify.py: ``cohen_style_certify``), at each of the workload's batch
   sizes, its fastest batch kept as the baseline;
2. ours, ``Smoother(model, σ, precision=p).certify_many(images, n0, n, α)`` (the engine path, sound bound and γ
   search included, batch measured by the engine) for p = float32 then bfloat16 (bf16 ``f_R`` is a different base
   classifier, labelled; its baseline is the same fp32 loop);

   workloads: MNIST LeNet n = 10⁵ (advertorch's clean-trained weights and real MNIST test digits where those offline
   packages are installed, else random weights and inputs: the row says which), CIFAR-10 ResNet-110 n = 10⁵ and
   ImageNet-shaped ResNet-50 (3×224×224) n = 10⁴, both with random weights and synthetic uniform inputs (the time of
   a pass does not depend on the weights; whether an input is certified, and so runs the radius search, does: each
   row records how many were certified). n0 = 100, α = 0.001, σ = 0.25, ``--images`` inputs per row (default 3),
   each timing after one warm-up (a separate input, excluded: compilation, autotuning, the engine's batch
   measurement, the radius search's kernels), seconds per image = wall time of the whole set / images, CUDA
   synchronized around each timing.

Per row, besides the times: the counted FLOPs and activation bytes per sample (elements × the row's element size);
on a card of benchmarks/floor.py's table the compute floor, the memory floor (unfused and fused) and our time as a
multiple of max(compute floor, memory floor) and of the fused floor (max(compute floor, fused memory floor)); "—" on
a CPU or an unknown card. The targets, one H100 (SPEC §5): s = 0 LeNet n = 10⁵ ≤ 8 ms bf16 / ≤ 15 ms fp32 (TF32),
ResNet-110 n = 10⁵ ≤ 0.25 s bf16 / ≤ 0.45 s fp32, ResNet-50 n = 10⁴ ≤ 0.25 s bf16 / ≤ 0.45 s fp32; s = 1 ≤ 1.2× the
same model's s = 0 time at the same precision; every row ≥ 5× the naive loop of the same run and ≤ 2× its fused
floor — each met or not in the table. And whether the timed run compiled anything (benchmarks/compile_watch.py:
dynamo compiles, Triton JIT compiles, new Triton cache files, ``f_R`` batch shapes not seen in the warm-up, which
would let cuDNN's benchmark mode autotune): ``compiled_in_timed_region``, marked in the table; a row whose timed
run (or its loop's) compiled meets no target (``all_targets_met`` false).

``--part native`` (stage 2): A/B rows of CERTIFY, the settings not yet decided by a GPU first — ``f_R``'s fused copy
against the plain one (:func:`run_fused_kernels_comparison`), ``torch.compile``, ``gamma_batch`` 4 against the
bisection, the exact bound's pieces (the Gram built gathered against tap by tap, the squaring against the eigvalsh
estimate, a round's certificates batched against one by one), the fused noise + max-pool kernel, CUDA graphs against
eager — then the CUDA kernels of csrc/noise_votes_cuda.cu against the Triton ones (benchmarks/test_bench_kernels.py's
cases; for the noise kernels also the bytes written per second and their fraction of the card's copy bandwidth,
measured in the part, with whether the better kernel reaches ``floor.WRITE_BANDWIDTH_TARGET``). CUDA only (recorded as skipped elsewhere).

Every part merges its rows into DIR/targets.json (environment: device name, torch, triton, CUDA, TF32 settings) and
rewrites DIR/targets.csv and DIR/targets.md (tables ready to paste into benchmarks/RESULTS.md, the card named) after
every row, so a part stopped by its time limit keeps the rows it finished. A row that fails records its error and the
next row runs. ``--quick``: tiny sizes (LeNet n = 200 at its full 28×28 input, ResNet-20 for ResNet-110, ResNet-50 at
3×32×32, one image, the cheap bound) so the whole path runs on a CPU in a test (tests/test_gpu_checks.py); its
timings are smoke-test numbers, never results.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark modules import each other by bare name, as under pytest
    sys.path.insert(0, str(HERE))

import splitz_fast as sz  # noqa: E402
from splitz_fast.bounds.gram import factor_gram  # noqa: E402
from splitz_fast.certify.windows import WINDOW_BATCHES  # noqa: E402
from splitz_fast.kernels import conv_relu_pool  # noqa: E402
from compile_watch import BatchShapes, CompileCounter, timed_region_record  # noqa: E402
from conftest import environment  # noqa: E402
from floor import (WRITE_BANDWIDTH_TARGET, card_for, count_cost, floors, measure_copy_bandwidth,  # noqa: E402
                   write_bandwidth)
from test_bench_certify import cohen_style_certify  # noqa: E402  (the faithful naive loop, shared)

N0, ALPHA, SIGMA = 100, 0.001, 0.25
# float32 (IEEE: the engine switches cuDNN's TF32 off), tf32 (tensor cores, labelled) and bf16 f_R; SPEC §5's fp32
# targets are for TF32.
PRECISIONS = ("float32", "tf32", "bfloat16")
BASELINE = ("Cohen et al. algorithm (naive loop): Smooth.certify as written — x.repeat → the whole fp32 eager model → "
            "counts on the host → Clopper–Pearson (+ the same sound radius search)")
# Targets every row must meet besides its time (SPEC §5, one H100): at least this many times faster than the naive
# loop of the same run; at most this multiple of the fused floor (benchmarks/floor.py); and s = 1 at most this
# multiple of the same model's s = 0 time at the same precision.
VS_LOOP_TARGET = 5.0
FUSED_FLOOR_TARGET = 2.0
SPLITZ_OVER_RS_TARGET = 1.2


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    model: str  # a name of sz.MODELS
    shape: tuple[int, ...]
    n: int
    naive_batches: tuple[int, ...]  # the loop's batch sizes; its fastest is the baseline
    targets: dict = field(default_factory=dict)  # precision → SPEC §5 target at s = 0, seconds per image
    n0: int = N0
    mnist: bool = False  # trained LeNet and real MNIST digits where available
    options: dict = field(default_factory=dict)  # BoundOptions fields besides the defaults (quick mode only)


# SPEC §5, one H100, s = 0 (s = 1: SPLITZ_OVER_RS_TARGET × the s = 0 time): LeNet n = 10⁵ ≤ 8 ms bf16, ≤ 15 ms fp32
# (TF32); ResNet-110 n = 10⁵ ≤ 0.25 s bf16, ≤ 0.45 s fp32; ResNet-50 n = 10⁴ ≤ 0.25 s bf16, ≤ 0.45 s fp32. Batch 1000 is
# Cohen's certify.py default, 400 his ImageNet runs'.
FULL = (
    Workload("mnist-lenet", "MNIST LeNet", "lenet", (1, 28, 28), 100_000, (1000, 10_000),
             {"float32": 0.015, "tf32": 0.015, "bfloat16": 0.008}, mnist=True),
    Workload("cifar10-resnet110", "CIFAR-10 ResNet-110", "cifar_resnet110", (3, 32, 32), 100_000, (1000,),
             {"float32": 0.45, "tf32": 0.45, "bfloat16": 0.25}),
    Workload("imagenet-resnet50", "ImageNet ResNet-50 (3×224×224)", "imagenet_resnet50", (3, 224, 224), 10_000,
             (400,), {"float32": 0.45, "tf32": 0.45, "bfloat16": 0.25}),
)
# Quick mode (a CPU smoke test of the whole path): tiny n, small inputs, and the one-step γ search over the
# probabilistic bound (ten exact bounds take seconds on 2 shared CPU cores).
CHEAP_BOUND = {"gamma_search": "one-step", "bound_method": "probabilistic"}
QUICK = (
    Workload("mnist-lenet", "MNIST LeNet (quick)", "lenet", (1, 28, 28), 200, (100,),
             FULL[0].targets, mnist=True, options=CHEAP_BOUND),
    Workload("cifar10-resnet110", "CIFAR-10 ResNet-20 (quick stand-in for ResNet-110)", "cifar_resnet20",
             (3, 32, 32), 20, (10,), FULL[1].targets, n0=10, options=CHEAP_BOUND),
    Workload("imagenet-resnet50", "ResNet-50 at 3×32×32 (quick)", "imagenet_resnet50", (3, 32, 32), 10, (10,),
             FULL[2].targets, n0=5, options=CHEAP_BOUND),
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def load_inputs(workload: Workload, split: int, count: int, device: torch.device):
    """``(model, inputs [count, *shape], weights label, inputs label)``; the first input is the warm-up."""
    torch.manual_seed(0)
    weights, inputs = "random", "synthetic uniform [0, 1]"
    model = None
    if workload.mnist:
        try:
            model = sz.build_model(workload.model, split_index=split, pretrained=True)
            weights = "advertorch clean-trained"
        except Exception as exc:  # the offline advertorch package is optional
            print(f"  (no trained LeNet: {error_text(exc)}; random weights)", flush=True)
    if model is None:
        model = sz.build_model(workload.model, split_index=split)
    if model.input_shape not in (None, workload.shape):  # quick mode's small inputs for ResNet-50
        model.left.input_shape = tuple(workload.shape)
    xs = torch.rand(count, *workload.shape)
    if workload.mnist:
        try:
            from splitz_fast.data.packages import load_mnist

            xs = load_mnist("test")[0][:count].clone()
            inputs = "MNIST test digits"
        except Exception as exc:
            print(f"  (no MNIST digits: {error_text(exc)}; synthetic inputs)", flush=True)
    return model.eval().to(device), xs.to(device), weights, inputs


class Recorder:
    """The parts' shared output: DIR/targets.json (merged by part), targets.csv and targets.md, rewritten per row."""

    def __init__(self, out: Path, part: str, settings: dict):
        self.out, self.part = out, part
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "targets.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data["environment"] = environment_record()
        self.data.setdefault("parts", {})[part] = {"settings": settings, "rows": [], "started": now()}
        self.write()

    def add(self, row: dict) -> None:
        self.data["parts"][self.part]["rows"].append(row)
        self.write()

    def finish(self, seconds: float) -> None:
        self.data["parts"][self.part].update(finished=now(), seconds=round(seconds, 1))
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        write_csv(self.data, self.out / "targets.csv")
        (self.out / "targets.md").write_text(markdown(self.data))


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def environment_record() -> dict:
    env = environment()
    env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
               cudnn_benchmark=torch.backends.cudnn.benchmark, splitz_backend=os.environ.get("SPLITZ_BACKEND", "auto"))
    return env


def measure_group(workload: Workload, split: int, images: int, device: torch.device, quick: bool,
                  precisions=PRECISIONS, naive: bool = True, bandwidth: float | None = None,
                  rs_times: dict | None = None, cuda_graphs: bool | None = None, compile: bool | None = None,
                  bound_options: dict | None = None, fused_kernels: bool | None = None):
    """Yield one row per precision for ``(workload, split)``: ours vs the fp32 naive loop (timed once, first), with
    ``f_R``'s counted cost per sample and the card's floors. ``bandwidth``: the copy bandwidth measured in this run
    (bytes/s; the card table's figure otherwise). ``rs_times``: precision → this model's s = 0 time, for the s = 1
    target. ``cuda_graphs``: the Smoother's setting (default: decided by measurement); each row records what the
    engine decided. ``compile``: the Smoother's ``torch.compile`` setting (default: the library's, which compiles only
    after a minute of eager sampling at one batch size, so not within a row; what it decided is recorded in
    ``compiled``). ``bound_options``: BoundOptions fields
    set on top of the workload's (for A/B rows). ``fused_kernels``: the Smoother's setting (default: decided by
    measurement, recorded like the graphs)."""
    model, xs, weights, inputs = load_inputs(workload, split, images + 1, device)
    warm, data = xs[:1], xs[1:]
    n0, n = workload.n0, workload.n
    max_batch = 32 if quick else None  # None: the Smoother's default for the device
    bound_options = sz.BoundOptions(**{**workload.options, **(bound_options or {})})
    reference = sz.Smoother(model, SIGMA, bound_options=bound_options)

    def radius(x, p_lower):  # the same sound radius search as ours, for every input the loop certifies
        reference.radius_search.search(x, sz.latent_radius(SIGMA, p_lower), None)

    # f_R's cost per sample: counted once for the group, before anything is timed (benchmarks/floor.py)
    cost, cost_error = None, None
    try:
        cost = count_cost(model.right, reference.latent(warm[0]))
    except Exception as exc:  # a failed count is recorded; the timings still run
        traceback.print_exc()
        cost_error = error_text(exc)
    card = card_for(device_name(device)) if device.type == "cuda" else None

    naive_by_batch, naive_predictions, naive_errors, naive_regions = {}, [], {}, {}
    for b in workload.naive_batches if naive else ():
        try:  # a batch the loop cannot run (memory) is recorded; its other batches and ours still run
            cohen_style_certify(model, warm, n0, min(n, 2 * b), ALPHA, b, radius, sigma=SIGMA)  # warm-up
            radius(warm[0], 0.99)  # the radius search's kernels, also where the warm-up input abstained
            with CompileCounter(device) as region:
                naive_by_batch[b] = timed(lambda b=b: naive_predictions.append(cohen_style_certify(
                    model, data, n0, n, ALPHA, b, radius, sigma=SIGMA)), device) / images
            naive_regions[b] = region
        except Exception as exc:
            traceback.print_exc()
            naive_errors[str(b)] = error_text(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    naive_s = min(naive_by_batch.values()) if naive_by_batch else None
    naive_batch = min(naive_by_batch, key=naive_by_batch.get) if naive_by_batch else None
    for precision in precisions:
        row = dict(workload=workload.key, label=workload.label, model=workload.model, split=split,
                   precision=precision, gamma_search=bound_options.gamma_search,
                   bound_method=bound_options.bound_method, n0=n0, n=n, alpha=ALPHA, sigma=SIGMA,
                   images=images, warmup_images=1, weights=weights, inputs=inputs, device=device_name(device),
                   backend=os.environ.get("SPLITZ_BACKEND", "auto"), baseline=BASELINE, naive_precision="float32",
                   naive_s_per_image=naive_s, naive_batch=naive_batch,
                   naive_certified=(sum(p != sz.ABSTAIN for p in naive_predictions[-1]) if naive_predictions
                                    else None),
                   naive_s_per_image_by_batch={str(b): s for b, s in naive_by_batch.items()},
                   naive_errors=naive_errors)
        row.update(targets_for(workload, split, precision, rs_times))
        if naive_batch is not None:
            row.update(timed_region_record(naive_regions[naive_batch], prefix="naive_"))
        if cost is not None:
            row.update(cost.record())
            row.update(floors(cost, precision, n0 + n, card, bandwidth))
        else:
            row["cost_error"] = cost_error
        smoother = None
        try:
            smoother = sz.Smoother(model, SIGMA, bound_options=bound_options, precision=precision,
                                   max_batch_size=max_batch, cuda_graphs=cuda_graphs, compile=compile,
                                   fused_kernels=fused_kernels)
            with BatchShapes(smoother.engine()) as shapes:  # every f_R batch from the batch measurement on
                start = time.perf_counter()
                (warmed,) = smoother.certify_many(warm, n0, n, ALPHA, seeds=[10_000])  # warm-up, batch measurement
                if warmed.prediction == sz.ABSTAIN and split > 0:  # compile the radius search's kernels all the same
                    smoother.protocol.radii(smoother.radius_search, [warm[0]], [sz.latent_radius(SIGMA, 0.99)],
                                            [torch.Generator(device=device).manual_seed(0)])
                batch = smoother.engine().batch_size(smoother.latent(warm[0]).shape, smoother.max_batch_size)
                if images > 1 and n0 + n < WINDOW_BATCHES * batch:
                    # a sampling window holds several inputs: the timed set's windows (and so the tail batches) differ
                    # from one input's, so warm up on the timed set itself (other seeds) to see its batch shapes
                    list(smoother.certify_many(data, n0, n, ALPHA, seeds=range(20_000, 20_000 + images)))
                synchronize(device)
                row["setup_s"] = time.perf_counter() - start
                shapes.freeze()
                results = []
                with CompileCounter(device) as region:
                    seconds = timed(lambda: results.extend(smoother.certify_many(data, n0, n, ALPHA,
                                                                                 seeds=range(images))), device)
            certified = [r for r in results if r.prediction != sz.ABSTAIN]
            row.update(status="ok", ours_s_per_image=seconds / images, engine_batch=batch,
                       certified=len(certified), warmup_certified=int(warmed.prediction != sz.ABSTAIN),
                       gamma_evaluations_mean=(sum(r.gamma_evaluations for r in certified) / len(certified)
                                               if certified else 0.0),
                       bound_kind=certified[0].bound_kind if certified else "none")
            row.update(timed_region_record(region, shapes))
            row.update(cuda_graphs_setting=cuda_graphs, cuda_graphs=graph_record(smoother.engine()),
                       fused_kernels=fusion_record(smoother.engine()), compiled=compile_record(smoother.engine()),
                       conv_pool_tiles=conv_relu_pool.tuned_configs())
            row.update(assess(row))
        except Exception as exc:  # a failed row is recorded; the next one runs
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        yield row
        smoother = None  # the next row's model gets the memory
        if device.type == "cuda":
            torch.cuda.empty_cache()


def graph_record(engine) -> list[dict]:
    """What the engine decided about CUDA graphs, per static batch it sampled (empty off CUDA)."""
    return [dict(channels_last=key[0], pooled=key[1], fused=key[2], compiled=key[3], batch=key[4], used=d.used,
                 reason=d.reason, eager_s=d.eager_s, graph_s=d.graph_s) for key, d in engine.graphs.decisions.items()]


def fusion_record(engine) -> list[dict]:
    """What the engine decided about its fused ``f_R`` copy, per layout and batch it sampled (empty off CUDA, or where
    nothing fuses)."""
    return [dict(channels_last=key[0], pooled=key[1], batch=key[2], used=d.used, reason=d.reason, plain_s=d.plain_s,
                 fused_s=d.fused_s) for key, d in engine.fusion.decisions.items()]


def compile_record(engine) -> list[dict]:
    """What the engine decided about ``torch.compile`` of ``f_R``, per layout, copy and batch where it compiled (with
    ``compile_s``, the first compiled call); empty where it never did (``compile=False``, or the default's minute of
    eager sampling not reached)."""
    return [dict(channels_last=key[0], pooled=key[1], fused=key[2], batch=key[3], used=d.used, reason=d.reason,
                 compile_s=d.compile_s, eager_s=d.eager_s, compiled_s=d.compiled_s)
            for key, d in engine.compiling.decisions.items()]


def graph_cell(row: dict) -> str:
    """The table's last column: whether the full batches replayed a CUDA graph (of the eager or the compiled copy),
    whether ``f_R``'s fused copy sampled, and whether the compiled copy did, each with the measurement behind it."""
    cells = []
    compiled_used = {(d["channels_last"], d["pooled"], d["fused"], d["batch"]) for d in row.get("compiled") or []
                     if d["used"]}
    for d in row.get("cuda_graphs") or []:
        if d.get("compiled") and (d["channels_last"], d["pooled"], d["fused"], d["batch"]) not in compiled_used:
            continue  # the graph of a compiled copy that was not used (its time is in the compiled cell)
        timing = (f" ({d['eager_s'] * 1e3:.2f} → {d['graph_s'] * 1e3:.2f} ms/batch)" if d.get("graph_s") is not None
                  else f" ({d['reason']})")
        label = "compiled graph " if d.get("compiled") else ("graph " if cells else "")
        cells.append(label + ("yes" if d["used"] else "no") + timing)
    for d in row.get("fused_kernels") or []:
        timing = (f" ({d['plain_s'] * 1e3:.2f} → {d['fused_s'] * 1e3:.2f} ms/batch)" if d.get("fused_s") is not None
                  else f" ({d['reason']})")
        cells.append("fused " + ("yes" if d["used"] else "no") + timing)
    for d in row.get("compiled") or []:
        timing = (f" ({d['eager_s'] * 1e3:.2f} → {d['compiled_s'] * 1e3:.2f} ms/batch, compiling {d['compile_s']:.0f} s)"
                  if d.get("compiled_s") is not None else f" ({d['reason']})")
        cells.append("compiled " + ("yes" if d["used"] else "no") + timing)
    return "; ".join(cells) or "—"


def targets_for(workload: Workload, split: int, precision: str, rs_times: dict | None) -> dict:
    """The row's time target: SPEC §5's at s = 0; at s = 1, SPLITZ_OVER_RS_TARGET × the s = 0 time of the same model
    and precision in this run (``None`` where that row did not run)."""
    if split == 0:
        return dict(target_s=workload.targets.get(precision), target_rule="SPEC §5, one H100")
    rs = (rs_times or {}).get(precision)
    return dict(target_s=SPLITZ_OVER_RS_TARGET * rs if rs else None,
                target_rule=f"{SPLITZ_OVER_RS_TARGET}× s = 0" + (f" ({rs:.4f} s)" if rs else " (not measured)"))


def assess(row: dict) -> dict:
    """Ratios and met/not met of an ``ok`` row: its time target, ≥ VS_LOOP_TARGET× the naive loop, ≤
    FUSED_FLOOR_TARGET× the fused floor (``None``: not assessable here — no target, no loop, no floor); all of them
    (``all_targets_met``) only if neither timed region (ours, the loop's) compiled anything."""
    ours = row["ours_s_per_image"]
    out = {}
    if row.get("naive_s_per_image"):
        out["ratio_vs_naive"] = row["naive_s_per_image"] / ours
    if row.get("floor_s"):
        out["ours_over_floor"] = ours / row["floor_s"]
    if row.get("fused_floor_s"):
        out["ours_over_fused_floor"] = ours / row["fused_floor_s"]
    out["target_met"] = ours <= row["target_s"] if row.get("target_s") is not None else None
    out["vs_loop_met"] = out["ratio_vs_naive"] >= VS_LOOP_TARGET if "ratio_vs_naive" in out else None
    out["fused_floor_met"] = (out["ours_over_fused_floor"] <= FUSED_FLOOR_TARGET if "ours_over_fused_floor" in out
                              else None)
    # A time with compilation in it is not the steady state the targets are about (the loop's would inflate the ratio).
    compiled = bool(row.get("compiled_in_timed_region") or row.get("naive_compiled_in_timed_region"))
    verdicts = [out["target_met"], out["vs_loop_met"], out["fused_floor_met"], not compiled]
    out["all_targets_met"] = False if False in verdicts else (True if all(v is True for v in verdicts) else None)
    return out


def error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else environment()["device"]


def run_targets(recorder: Recorder, workloads, images: int, device: torch.device, quick: bool, deadline: float,
                bandwidth: float | None = None, precisions=PRECISIONS):
    for workload in workloads:
        rs_times: dict[str, float] = {}  # precision → this model's s = 0 time (the s = 1 rows' target)
        for split in (0, 1):
            if time.monotonic() > deadline:
                recorder.add(dict(workload=workload.key, label=workload.label, n=workload.n, split=split,
                                  status="skipped", error="the part's --budget was spent"))
                continue
            print(f"[{now()}] {workload.label}, s = {split}, n = {workload.n:,}", flush=True)
            try:
                for row in measure_group(workload, split, images, device, quick, precisions, bandwidth=bandwidth,
                                         rs_times=rs_times if split else None):
                    print("  " + summary(row), flush=True)
                    recorder.add(row)
                    if split == 0 and row.get("status") == "ok":
                        rs_times[row["precision"]] = row["ours_s_per_image"]
            except Exception as exc:  # e.g. the naive loop itself failed: record it, go on
                traceback.print_exc()
                recorder.add(dict(workload=workload.key, label=workload.label, n=workload.n, split=split,
                                  status="error", error=error_text(exc)))
            if device.type == "cuda":
                torch.cuda.empty_cache()


def summary(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('label')} s={row.get('split')} {row.get('precision', '')}: {row.get('status')} " \
               f"{row.get('error', '')}"
    ratio = row.get("ratio_vs_naive")
    floor = row.get("ours_over_floor")
    return (f"{row['label']} s={row['split']} {row['precision']}: ours {row['ours_s_per_image']:.4f} s/image, "
            f"Cohen et al. algorithm (naive loop) {row['naive_s_per_image'] or float('nan'):.4f} s/image (batch "
            f"{row['naive_batch']}), {ratio or float('nan'):.2f}x, certified {row['certified']}/{row['images']}; "
            f"{row.get('flops_per_sample', float('nan')) / 1e9:.4g} GFLOP and "
            f"{row.get('activation_bytes_per_sample', float('nan')) / 1e6:.3g} MB of activations per sample; "
            + (f"{floor:.1f}x the floor, {row['ours_over_fused_floor']:.1f}x the fused floor; " if floor else
               "no floor (no card figures); ")
            + f"target {_fmt(row['target_s'], 4)} s: {_met(row.get('target_met'))}, >= {VS_LOOP_TARGET:g}x loop: "
            f"{_met(row.get('vs_loop_met'))}, <= {FUSED_FLOOR_TARGET:g}x fused floor: "
            f"{_met(row.get('fused_floor_met'))}"
            + ("; COMPILED IN THE TIMED REGION" if row.get("compiled_in_timed_region") else ""))


def _met(value) -> str:
    return "—" if value is None else ("met" if value else "NOT met")


# ----------------------------------------------------------------------------------------------- native vs Triton
def _comparison(recorder: Recorder, what: str, settings: dict, speedup_key: str, images: int, device: torch.device,
                quick: bool, deadline: float, precision: str, workload: int = 0, split: int = 1) -> None:
    """One row: CERTIFY of ``(QUICK or FULL)[workload]`` at ``split`` timed under each of ``settings`` (label →
    ``(context manager factory that sets it up, keyword arguments of measure_group)``), in order, and
    ``speedup_key`` = the first setting's time over the second's."""
    chosen = (QUICK if quick else FULL)[workload]
    row = dict(what=f"{chosen.label} s={split} CERTIFY n={chosen.n:,} {precision}: {what}", device=device_name(device),
               images=images)
    try:
        for label, (setting, group_options) in settings.items():
            if time.monotonic() > deadline:
                raise TimeoutError("the part's --budget was spent")
            with setting():
                (measured,) = measure_group(chosen, split, images, device, quick, precisions=(precision,),
                                            naive=False, **group_options)
            if measured.get("status") != "ok":
                raise RuntimeError(measured.get("error"))
            row[f"{label}_s_per_image"] = measured["ours_s_per_image"]
            if measured.get("cuda_graphs"):
                row[f"{label}_cuda_graphs"] = measured["cuda_graphs"]
        first, second = settings
        row.update(status="ok", compared=[first, second], speedup_key=speedup_key,
                   **{speedup_key: row[f"{first}_s_per_image"] / row[f"{second}_s_per_image"]})
    except Exception as exc:
        traceback.print_exc()
        row.update(status="error", error=error_text(exc))
    print("  " + json.dumps(row, default=str), flush=True)
    recorder.add(row)


@contextlib.contextmanager
def _without_auto_triton(op: str):
    """``op`` out of ``AUTO_TRITON_OPS`` for the block (``auto`` runs its reference on CUDA)."""
    import splitz_fast.kernels as kernels

    default = kernels.AUTO_TRITON_OPS
    kernels.AUTO_TRITON_OPS = default - {op}
    try:
        yield
    finally:
        kernels.AUTO_TRITON_OPS = default


def run_fused_pool(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 1 CERTIFY with f_R's leading 2x2 max pool drawn by the fused Triton noise kernel (``auto`` on CUDA)
    against the pool run in f_R (``noisy_latents_maxpool2`` taken out of ``AUTO_TRITON_OPS`` for the row): the
    measurement behind ``auto``'s choice. Same samples, same votes."""
    for precision in ("tf32", "bfloat16"):
        _comparison(recorder, "fused noise + max pool (Triton) vs pool in f_R",
                    {"unfused": (lambda: _without_auto_triton("noisy_latents_maxpool2"), {}),
                     "fused": (contextlib.nullcontext, {})},
                    "fused_speedup", images, device, quick, deadline, precision)


# (workload index, split, precision) of the fused-kernel comparison: LeNet (its conv + ReLU + pool layers as one Triton
# kernel) at both splits, then the ResNets (conv + bias + ReLU (+ shortcut) as one cuDNN call).
FUSED_COMPARISONS = ((0, 0, "bfloat16"), (0, 0, "tf32"), (0, 1, "bfloat16"), (1, 0, "bfloat16"), (1, 0, "tf32"),
                     (2, 0, "bfloat16"))


def run_fused_kernels_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """CERTIFY (:data:`FUSED_COMPARISONS`) through the plain prepared ``f_R`` (``fused_kernels=False``) against its
    fused copy (``fused_kernels=True``: :mod:`splitz_fast.sampling.epilogues`): what the default's run-time measurement
    (``fused_kernels=None``, recorded in stage 1's rows) should agree with. On the CPU, where nothing fuses, both
    settings sample the plain ``f_R`` (a smoke test of the row)."""
    forced = True if device.type == "cuda" else None
    for workload, split, precision in FUSED_COMPARISONS:
        _comparison(recorder, "fused kernels vs plain f_R",
                    {"plain_kernels": (contextlib.nullcontext, {"fused_kernels": False}),
                     "fused_kernels": (contextlib.nullcontext, {"fused_kernels": forced})},
                    "fused_kernels_speedup", images, device, quick, deadline, precision, workload, split)


# (workload index, split) of the CUDA graph comparison: the launch-bound LeNet at both splits, the deep ResNet-110.
GRAPH_COMPARISONS = ((0, 0), (0, 1), (1, 0))


def run_graph_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """CERTIFY with ``f_R`` eager (``cuda_graphs=False``) against replayed CUDA graphs (``cuda_graphs=True``) on the
    workloads of :data:`GRAPH_COMPARISONS` with a bf16 ``f_R`` (the fastest, so the most launch-bound): what the
    default's run-time measurement should agree with (the same votes either way)."""
    for workload, split in GRAPH_COMPARISONS:
        for precision in ("bfloat16",):
            _comparison(recorder, "CUDA graph vs eager f_R",
                        {"eager": (contextlib.nullcontext, {"cuda_graphs": False}),
                         "graph": (contextlib.nullcontext, {"cuda_graphs": True})},
                        "graph_speedup", images, device, quick, deadline, precision, workload, split)


def run_compile_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 0 CERTIFY (bf16) with ``f_R`` through ``torch.compile`` (static batch shapes; compilation in the
    warm-up, excluded) against eager: whether Inductor's fused pointwise and pool kernels close part of the gap to the
    fused memory floor, which eager cuDNN leaves (28x it on an H100)."""
    _comparison(recorder, "torch.compile vs eager f_R",
                {"eager": (contextlib.nullcontext, {"compile": False}),
                 "compiled": (contextlib.nullcontext, {"compile": True})},
                "compile_speedup", images, device, quick, deadline, "bfloat16", 0, 0)


def run_gamma_batch_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 1 CERTIFY (bf16) with the classic bisection (``gamma_batch = 2``: one bound per pass, 5 passes)
    against ``gamma_batch = 4`` (three bounds per batched pass, 3 passes; never a smaller radius): fewer sequential
    passes and host synchronisations of the radius search against more bounds per pass."""
    _comparison(recorder, "gamma_batch 4 vs 2 (bisection)",
                {"bisection": (contextlib.nullcontext, {}),
                 "gamma_batch_4": (contextlib.nullcontext, {"bound_options": {"gamma_batch": 4}})},
                "gamma_batch_speedup", images, device, quick, deadline, "bfloat16")


@contextlib.contextmanager
def _dense_estimator(name: str):
    """``lipschitz.DEVICE_DENSE_ESTIMATOR = name`` for the block (what a GPU measurement would decide)."""
    import splitz_fast.bounds.lipschitz as lipschitz

    default = lipschitz.DEVICE_DENSE_ESTIMATOR
    lipschitz.DEVICE_DENSE_ESTIMATOR = name
    try:
        yield
    finally:
        lipschitz.DEVICE_DENSE_ESTIMATOR = default


def exact_bound_case(device: torch.device, repeats: int = 10) -> dict:
    """One exact bound of LeNet's first layer on the device (the masked Gram of d = 784 at γ = 0.5 on an MNIST-sized
    input): milliseconds of ``certified_lambda_max`` with each dense device estimate (median of ``repeats``), and how
    far apart the two proven bounds are."""
    from splitz_fast.bounds.lipschitz import masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    x = torch.rand(1, 1, 28, 28, device=device)
    bounds = sz.ball_bounds(left, x, 0.5)
    gram, terms = factor_gram(masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0], 0, sparse=False)
    row = dict(what=f"exact bound, LeNet conv1 Gram (d = {gram.shape[0]}): squaring vs eigvalsh estimate",
               device=device_name(device))
    values = {}
    for estimator in ("eigvalsh", "squaring"):
        with _dense_estimator(estimator):
            times = []
            for _ in range(repeats + 1):  # the first call loads the solver libraries and compiles nothing timed
                synchronize(device)
                start = time.perf_counter()
                values[estimator] = sz.certified_lambda_max(gram, terms)
                synchronize(device)
                times.append(time.perf_counter() - start)
            row[f"{estimator}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    row.update(status="ok", compared=["eigvalsh", "squaring"], speedup_key="squaring_vs_eigvalsh",
               squaring_vs_eigvalsh=row["eigvalsh_ms"] / row["squaring_ms"],
               bound_relative_difference=abs(values["squaring"] - values["eigvalsh"]) / values["eigvalsh"])
    return row


def gram_build_case(device: torch.device, repeats: int = 10) -> dict:
    """The masked Gram of LeNet's first layer (d = 784 at γ = 0.5, as :func:`exact_bound_case`) built with its half
    stencil gathered in one pass against summed tap by tap (``gram.GATHERED_STENCIL_DEVICES``): milliseconds per Gram
    (median of ``repeats``), and whether the two Grams agree to rounding."""
    from splitz_fast.bounds import gram as grams
    from splitz_fast.bounds.lipschitz import masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    x = torch.rand(1, 1, 28, 28, device=device)
    bounds = sz.ball_bounds(left, x, 0.5)
    op = masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0]
    row = dict(what="LeNet conv1 Gram built: gathered stencil vs tap by tap", device=device_name(device))
    built, default = {}, grams.GATHERED_STENCIL_DEVICES
    try:
        for label, devices in (("tapwise", frozenset()), ("gathered", frozenset({device.type}))):
            grams.GATHERED_STENCIL_DEVICES = devices
            times = []
            for _ in range(repeats + 1):  # the first call builds the gather's index (cached)
                synchronize(device)
                start = time.perf_counter()
                built[label] = factor_gram(op, 0, sparse=False)[0]
                synchronize(device)
                times.append(time.perf_counter() - start)
            row[f"{label}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    finally:
        grams.GATHERED_STENCIL_DEVICES = default
    difference = float((built["gathered"] - built["tapwise"]).abs().max() / built["tapwise"].abs().max())
    row.update(status="ok", compared=["tapwise", "gathered"], speedup_key="gathered_vs_tapwise",
               gathered_vs_tapwise=row["tapwise_ms"] / row["gathered_ms"], gram_relative_difference=difference)
    return row


def batched_bound_case(device: torch.device, repeats: int = 10) -> dict:
    """The Grams of one radius-search round (LeNet conv1 for 2 inputs at 3 γ's each): milliseconds of certifying them
    together (``certified_lambda_max_many``) and one by one (``certified_lambda_max`` each), median of ``repeats``,
    and how far apart the two sets of proven bounds are."""
    from splitz_fast.bounds.lipschitz import certified_lambda_max_many, masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    xs = torch.rand(2, 1, 28, 28, device=device)
    grams = []
    for gamma in (0.2, 0.4, 0.6):
        bounds = sz.ball_bounds(left, xs, gamma)
        op = masked_operators(left, bounds, (1, 28, 28), 2, bounds.input_scale)[0]
        grams += [factor_gram(op, b) for b in range(2)]
    row = dict(what=f"exact bounds of one search round ({len(grams)} LeNet conv1 Grams): batched vs one by one",
               device=device_name(device))
    ways = {"batched": lambda: certified_lambda_max_many([g for g, _ in grams], [t for _, t in grams]),
            "one_by_one": lambda: [sz.certified_lambda_max(g, t) for g, t in grams]}
    values = {}
    for name, certify in ways.items():
        times = []
        for _ in range(repeats + 1):  # the first call loads the solver libraries
            synchronize(device)
            start = time.perf_counter()
            values[name] = certify()
            synchronize(device)
            times.append(time.perf_counter() - start)
        row[f"{name}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    row.update(status="ok", compared=["one_by_one", "batched"], speedup_key="batched_vs_one_by_one",
               batched_vs_one_by_one=row["one_by_one_ms"] / row["batched_ms"],
               bound_relative_difference=max(abs(a - b) / b for a, b in zip(values["batched"], values["one_by_one"])))
    return row


@contextlib.contextmanager
def _certificates_one_by_one():
    """The radius search's exact factors certified one Gram at a time (as before they were batched)."""
    import splitz_fast.bounds.lipschitz as lipschitz

    batched = lipschitz.certified_lambda_max_many
    lipschitz.certified_lambda_max_many = lambda grams, terms, estimator="auto": [
        lipschitz.certified_lambda_max(g, t, estimator) for g, t in zip(grams, terms)]
    try:
        yield
    finally:
        lipschitz.certified_lambda_max_many = batched


def run_bound_comparisons(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """The exact bound on CUDA: one bound with the squaring vs the eigvalsh estimate (``DEVICE_DENSE_ESTIMATOR``), a
    round's Grams certified together vs one by one, then LeNet s = 1 CERTIFY (bf16) with batched vs one-by-one
    certificates."""
    for case in (gram_build_case, exact_bound_case, batched_bound_case):
        row = dict(what=case.__name__, device=device_name(device))
        try:
            row = case(device)
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)
    _comparison(recorder, "exact bounds of a round one by one vs batched",
                {"one_by_one": (_certificates_one_by_one, {}), "batched": (contextlib.nullcontext, {})},
                "batched_speedup", images, device, quick, deadline, "bfloat16")


def run_native(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    if device.type != "cuda":
        recorder.add(dict(what="native CUDA vs Triton", status="skipped", error="needs CUDA"))
        return
    # the undecided settings first (a part stopped by its budget keeps the rows it finished)
    run_fused_kernels_comparison(recorder, images, device, quick, deadline)
    run_compile_comparison(recorder, images, device, quick, deadline)
    run_gamma_batch_comparison(recorder, images, device, quick, deadline)
    run_bound_comparisons(recorder, images, device, quick, deadline)
    run_fused_pool(recorder, images, device, quick, deadline)
    run_graph_comparison(recorder, images, device, quick, deadline)
    from splitz_fast.kernels.native_cuda import cuda_native_available

    start = time.perf_counter()
    available = cuda_native_available()  # builds csrc/noise_votes_cuda.cu on first use (unless stage 2a did)
    recorder.add(dict(what="build or load csrc/noise_votes_cuda.cu", status="ok" if available else "error",
                      seconds=time.perf_counter() - start))
    if not available:
        return
    from test_bench_kernels import CUDA_KERNEL_CASES, cuda_kernel_case

    bandwidth = measure_copy_bandwidth(device)  # what the noise kernels' write bandwidth is a fraction of
    for case in CUDA_KERNEL_CASES:
        row = dict(what=f"kernel: {case}", device=device_name(device))
        try:
            result = cuda_kernel_case(case, 1000 if quick else 10_000)
            result.pop("run")  # the timed callable (pytest-benchmark's round)
            row.update(result, status="ok")
            if "bytes_written" in result:
                row.update(write_bandwidth(result["bytes_written"], dict(cuda=result["cuda_ms"],
                                                                         triton=result["triton_ms"]), bandwidth))
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)


# ----------------------------------------------------------------------------------------------------- outputs
CSV_FIELDS = ("part", "workload", "label", "model", "split", "precision", "n0", "n", "images", "weights", "inputs",
              "device", "backend", "status", "ours_s_per_image", "baseline", "naive_s_per_image", "naive_batch",
              "ratio_vs_naive", "target_s", "target_rule", "target_met", "vs_loop_met", "fused_floor_met",
              "all_targets_met", "flops_per_sample", "conv_flops_per_sample", "matmul_flops_per_sample",
              "activation_elements_per_sample", "fused_activation_elements_per_sample", "input_elements_per_sample",
              "element_size", "activation_bytes_per_sample", "fused_activation_bytes_per_sample", "samples_per_image",
              "card", "peak", "bandwidth_Bps", "bandwidth_source", "compute_floor_s", "memory_floor_s",
              "fused_memory_floor_s", "floor_s", "fused_floor_s", "ours_over_floor", "ours_over_fused_floor",
              "compiled_in_timed_region", "naive_compiled_in_timed_region", "engine_batch", "setup_s", "certified",
              "warmup_certified", "naive_certified", "gamma_evaluations_mean", "what", "cuda_ms", "triton_ms",
              "reference_ms", "cuda_vs_triton", "bytes_written", "copy_bandwidth_Bps", "cuda_write_Bps",
              "triton_write_Bps", "cuda_of_copy_bandwidth", "triton_of_copy_bandwidth", "write_bandwidth_met",
              "unfused_s_per_image", "fused_s_per_image", "fused_speedup", "eager_s_per_image", "graph_s_per_image",
              "graph_speedup", "compiled_s_per_image", "compile_speedup", "bisection_s_per_image",
              "gamma_batch_4_s_per_image", "gamma_batch_speedup", "cuda_graphs_setting", "eigvalsh_ms", "squaring_ms",
              "squaring_vs_eigvalsh",
              "bound_relative_difference", "batched_ms", "one_by_one_ms", "batched_vs_one_by_one",
              "one_by_one_s_per_image", "batched_s_per_image", "batched_speedup",
              "plain_kernels_s_per_image", "fused_kernels_s_per_image", "fused_kernels_speedup",
              "tapwise_ms", "gathered_ms", "gathered_vs_tapwise", "gram_relative_difference",
              "error")


def write_csv(data: dict, path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for part, record in data.get("parts", {}).items():
            for row in record["rows"]:
                writer.writerow({"part": part, **row})


def _fmt(value, digits=3, suffix="") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    lines = [f"Card: **{env.get('device')}**; torch {env.get('torch')}, triton {env.get('triton')}, CUDA "
             f"{env.get('cuda')}, cuDNN {env.get('cudnn')}, splitz_fast {env.get('splitz_fast')}, Python "
             f"{env.get('python')}; TF32 matmul {env.get('tf32_matmul')} / cuDNN {env.get('tf32_cudnn')} (PyTorch "
             "defaults, the same for ours and the loop).", ""]
    targets = data.get("parts", {}).get("targets")
    if targets:
        s = targets["settings"]
        searches = sorted({f"{r['gamma_search']} γ search, {r['bound_method']} bound" for r in targets["rows"]
                           if "gamma_search" in r}) or ["—"]
        lines += [f"### SPEC §5 targets end to end (`python -m benchmarks.targets`, {targets.get('started')})", "",
                  f"CERTIFY with n0 = {'per row (quick)' if s.get('quick') else s['n0']}, α = {s['alpha']}, σ = {s['sigma']}, "
                  f"sound bound and γ search included ({'; '.join(searches)}); {s['images']} image(s) per row after one warm-up image (excluded), seconds "
                  "per image = wall time of the set / images. Ours: `Smoother.certify_many` (engine batch measured; "
                  "bf16 rows run a bf16 `f_R`, a different base classifier). **Cohen et al. algorithm (naive loop)**: "
                  "their `Smooth.certify` as written (`x.repeat` → the whole fp32 eager model → counts on the host "
                  "→ Clopper–Pearson) plus the same sound radius search, its fastest batch, timed in the same process."
                  + (" **Quick mode: smoke-test numbers, not results.**" if s.get("quick") else ""), "",
                  floor_note(s), "",
                  "| workload, n | split | f_R | ours (s/image) | Cohen et al. algorithm (naive loop), s/image (batch) "
                  f"| vs loop (≥ {VS_LOOP_TARGET:g}×) | certified (γ evals; loop's) | GFLOP / sample "
                  "| activation MB / sample (unfused / fused) | compute floor (s/image) "
                  "| memory floor (s/image; unfused / fused) | ours ÷ floor "
                  f"| ours ÷ fused floor (≤ {FUSED_FLOOR_TARGET:g}×) | time target (s/image) "
                  f"| met: time / ≥ {VS_LOOP_TARGET:g}× loop / ≤ {FUSED_FLOOR_TARGET:g}× fused floor "
                  "| compiled in timed region | f_R as CUDA graph (eager → graph per batch); fused copy (plain → fused); "
                  "compiled copy (current → compiled) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in targets["rows"]:
            name = f"{r.get('label')}, {r.get('n', 0):,}"
            if r.get("status") != "ok":
                lines.append(f"| {name} | s = {r.get('split')} | {r.get('precision', '—')} | {r.get('status')}: "
                             f"{r.get('error', '')} |" + " |" * 13)
                continue
            lines.append(
                f"| {name} ({r['weights']} weights, {r['inputs']}) | s = {r['split']} | {r['precision']} | "
                f"{_fmt(r['ours_s_per_image'], 4)} | {_fmt(r['naive_s_per_image'], 4)} ({r['naive_batch']}) | "
                f"{_fmt(r.get('ratio_vs_naive'), 2, '×')} | {r['certified']}/{r['images']} "
                f"({r['gamma_evaluations_mean']:.1f}; {r.get('naive_certified')}) | "
                f"{_sig(r.get('flops_per_sample'), 1e9)} | {_sig(r.get('activation_bytes_per_sample'), 1e6)} / "
                f"{_sig(r.get('fused_activation_bytes_per_sample'), 1e6)} | {_sig(r.get('compute_floor_s'))} | "
                f"{_sig(r.get('memory_floor_s'))} / {_sig(r.get('fused_memory_floor_s'))} | "
                f"{_fmt(r.get('ours_over_floor'), 1, '×')} | {_fmt(r.get('ours_over_fused_floor'), 1, '×')} | "
                f"≤ {_fmt(r.get('target_s'), 4)} ({r.get('target_rule', '—')}) | "
                f"{_verdict(r.get('target_met'))} / {_verdict(r.get('vs_loop_met'))} / "
                f"{_verdict(r.get('fused_floor_met'))} | {compiled_cell(r)} | {graph_cell(r)} |")
        rs_vs_splitz = splitz_over_rs(targets["rows"])
        if rs_vs_splitz:
            lines += ["", f"SPLITZ (s = 1) vs RS (s = 0) certification time, same model and device (target ≤ "
                      f"{SPLITZ_OVER_RS_TARGET}×):",
                      "", "| workload | f_R | RS s/image | SPLITZ s/image | SPLITZ / RS |", "|---|---|---|---|---|"]
            lines += [f"| {label} | {precision} | {rs:.4f} | {splitz:.4f} | {splitz / rs:.2f}× |"
                      for label, precision, rs, splitz in rs_vs_splitz]
        lines.append("")
    native = data.get("parts", {}).get("native")
    if native:
        lines += [f"### Settings and kernels compared on the device (`--part native`, {native.get('started')})", "",
                  "A/B rows: the setting under test, then the baseline; kernel rows: the CUDA kernel of csrc/, then "
                  "Triton, then eager PyTorch.", "",
                  "| what | setting under test / CUDA kernel | baseline / Triton | eager reference | speedup |",
                  "|---|---|---|---|---|"]
        for r in native["rows"]:
            if r.get("status") != "ok":
                lines.append(f"| {r.get('what')} | {r.get('status')} {r.get('error', '')} | | | |")
            elif "cuda_ms" in r:
                lines.append(f"| {r['what']} | {r['cuda_ms']:.3f} ms{write_cell(r, 'cuda')} | {r['triton_ms']:.3f} ms"
                             f"{write_cell(r, 'triton')} | {r['reference_ms']:.3f} ms | {r['cuda_vs_triton']:.2f}× |")
            elif "compared" in r:  # an A/B row: the second setting in the first column, its speedup last
                lines.append(ab_cell(r))
            else:
                lines.append(f"| {r['what']} | {r['status']} in {r.get('seconds', 0):.1f} s | | | |")
        lines.append("")
    return "\n".join(lines)


def write_cell(row: dict, kernel: str) -> str:
    """A noise kernel's write bandwidth after its time: `` (0.78 TB/s written, 25 % of copy)``, the fraction marked
    where the row's best kernel misses WRITE_BANDWIDTH_TARGET; empty for a row that writes no batch."""
    if "bytes_written" not in row:
        return ""
    fraction = row.get(f"{kernel}_of_copy_bandwidth")
    share = "" if fraction is None else f", {fraction:.0%} of copy" + ("" if row["write_bandwidth_met"] else " **(< "
                                                                        f"{WRITE_BANDWIDTH_TARGET:.0%})**")
    return f" ({row[f'{kernel}_write_Bps'] / 1e12:.2f} TB/s written{share})"


def ab_cell(row: dict) -> str:
    """The markdown line of an A/B row (``compared = [first, second]`` settings, each timed in seconds per image or,
    for a single bound, milliseconds): the second setting, the first, and the first's time over the second's."""
    first, second = row["compared"]
    unit, what = ("s/image", f"{row['what']} ({row['images']} images)") if "images" in row else ("ms", row["what"])
    digits = 4 if unit == "s/image" else 2

    def cell(label: str) -> str:
        value = row[f"{label}_s_per_image" if unit == "s/image" else f"{label}_ms"]
        return f"{label.replace('_', ' ')} {value:.{digits}f} {unit}"

    note = f" (bounds {row['bound_relative_difference']:.1e} apart)" if "bound_relative_difference" in row else ""
    return (f"| {what} | {cell(second)} | {cell(first)} | — | {row[row['speedup_key']]:.2f}× ({second.replace('_', ' ')} "
            f"vs {first.replace('_', ' ')}){note} |")


def _sig(value, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value / scale:.3g}"


def _verdict(value) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def compiled_cell(row: dict) -> str:
    """``no``, or what the timed region compiled (ours; the loop's too if its timed region compiled)."""
    parts = []
    for prefix, who in (("", ""), ("naive_", "loop: ")):
        if row.get(f"{prefix}compiled_in_timed_region"):
            c = row.get(f"{prefix}timed_region_compiles", {})
            what = [f"{k.replace('_', ' ')} {v if not isinstance(v, list) else len(v)}" for k, v in c.items()
                    if v and k != "warmup_batch_shapes"]
            parts.append(f"**{who}yes** ({', '.join(what)})")
    return "; ".join(parts) or "no"


def floor_note(settings: dict) -> str:
    """What the cost and floor columns are (benchmarks/floor.py) and which card figures this run used."""
    card = settings.get("card")
    bandwidth = settings.get("copy_bandwidth_Bps")
    where = ("no card figures for this device: floors —" if not card else
             f"card figures: {card['name']} ({card['source']}): {card['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
             f"{card['tf32_flops'] / 1e12:.0f} TF32, {card['fp32_flops'] / 1e12:.0f} fp32; memory "
             + (f"{bandwidth / 1e12:.2f} TB/s measured (1 GiB `copy_`, read + write) in this run" if bandwidth else
                f"{card['bandwidth'] / 1e12:.2f} TB/s, {card['bandwidth_source']}"))
    return ("Cost and floors (benchmarks/floor.py), per sample of `f_R` (the whole model at s = 0): FLOPs counted by "
            "`torch.utils.flop_counter.FlopCounterMode`; activation bytes = elements written by every aten op of "
            "the forward (views excluded, in-place ops included; f_R's input excluded) × the row's element size; "
            "fused = only the last output of each conv/linear + BN + pointwise (ReLU, bias, residual add) + pool "
            "chain. Per image of n0 + n samples: compute floor = FLOPs at the card's dense peak for the row's "
            "precision (bf16, TF32 or IEEE fp32, as the engine runs f_R); memory floor = activations "
            "written once and read once at the card's bandwidth; floor = max(compute, memory), fused floor = "
            f"max(compute, fused memory). {where}. Compiled in timed region: dynamo compiles, Triton JIT compiles or "
            "new Triton cache files during the timed run, or f_R batch shapes it saw that the warm-up did not (cuDNN "
            "benchmark mode would autotune them; benchmarks/compile_watch.py).")


def splitz_over_rs(rows) -> list[tuple[str, str, float, float]]:
    times = {(r["label"], r["precision"], r["split"]): r["ours_s_per_image"] for r in rows if r.get("status") == "ok"}
    return [(label, precision, rs, times[(label, precision, 1)])
            for (label, precision, split), rs in times.items() if split == 0 and (label, precision, 1) in times]


def _select(workloads, keys: str, parser) -> list:
    """The workloads named by ``keys`` (comma-separated), in that order; a parser error names the known keys."""
    by_key = {w.key: w for w in workloads}
    chosen = [k for k in keys.split(",") if k]
    unknown = [k for k in chosen if k not in by_key]
    if unknown or not chosen:
        parser.error(f"--workloads must name some of {', '.join(by_key)}, got {keys!r}")
    return [by_key[k] for k in chosen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-out", help="folder for targets.json, targets.csv, targets.md")
    parser.add_argument("--part", choices=("targets", "native", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke test (not results)")
    parser.add_argument("--images", type=int, default=None, help="images per row (default 3; 1 with --quick)")
    parser.add_argument("--budget", type=float, default=1e9,
                        help="seconds after which a part starts no new model (the shell's timeout is the hard limit)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(w.key for w in FULL),
                        help="comma-separated workload keys of the targets part, in the order to run them")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated f_R precisions of the targets part")
    args = parser.parse_args(argv)
    workloads = _select(QUICK if args.quick else FULL, args.workloads, parser)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if not precisions or any(p not in PRECISIONS for p in precisions):
        parser.error(f"--precisions must name some of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    device = torch.device(args.device)
    images = args.images or (1 if args.quick else 3)
    out = Path(args.out)
    for part in ("targets", "native") if args.part == "all" else (args.part,):
        start = time.monotonic()
        settings = dict(n0=N0, alpha=ALPHA, sigma=SIGMA, images=images, warmup_images=1, quick=args.quick,
                        budget_s=args.budget)
        bandwidth = None
        if part == "targets":
            settings.update(workloads=[w.key for w in workloads], precisions=list(precisions))
            card = card_for(device_name(device)) if device.type == "cuda" else None
            bandwidth = measure_copy_bandwidth(device)  # None off CUDA
            settings.update(card=asdict(card) if card else None, copy_bandwidth_Bps=bandwidth,
                            tf32_conv=torch.backends.cudnn.allow_tf32,
                            tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        recorder = Recorder(out, part, settings)
        print(f"[{now()}] part {part} on {device_name(device)}, torch {torch.__version__}"
              + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
        if part == "targets":
            run_targets(recorder, workloads, images, device, args.quick, start + args.budget, bandwidth, precisions)
        else:
            run_native(recorder, images, device, args.quick, start + args.budget)
        recorder.finish(time.monotonic() - start)
    print(f"[{now()}] wrote {out / 'targets.json'}, targets.csv, targets.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
