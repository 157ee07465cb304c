"""SPEC §5's target table end to end, each row against a faithful naive Cohen-style loop in the same process.

``python -m benchmarks.targets --out DIR`` (from the repository root) measures, in this order:

``--part targets`` (stage 1 of scripts/gpu_checks.sh): for each workload, split s = 0 (RS) then s = 1 (SPLITZ),

1. the naive loop (benchmarks/test_bench_certify.py: ``cohen_style_certify``: per input ``x.repeat(b)`` → the whole
   fp32 eager model → ``.cpu()`` → Python vote counting, n0 selection then n estimation draws, Clopper–Pearson, and
   the same sound radius search as ours for every certified input), at each of the workload's batch sizes, its
   fastest batch kept as the baseline;
2. ours, ``Smoother(model, σ, precision=p).certify_many(images, n0, n, α)`` (the engine path, sound bound and γ
   search included, batch measured by the engine) for p = float32 then bfloat16 (bf16 ``f_R`` is a different base
   classifier, labelled; its baseline is the same fp32 loop);

   workloads: MNIST LeNet n = 10⁵ (advertorch's clean-trained weights and real MNIST test digits where those offline
   packages are installed, else random weights and inputs: the row says which), CIFAR-10 ResNet-110 n = 10⁵ and
   ImageNet-shaped ResNet-50 (3×224×224) n = 10⁴, both with random weights and synthetic uniform inputs (the time of
   a pass does not depend on the weights; whether an input is certified, and so runs the radius search, does: each
   row records how many were certified). n0 = 100, α = 0.001, σ = 0.25, ``--images`` inputs per row (default 3),
   each timing after one warm-up (a separate input, excluded: compilation, autotuning, the engine's batch
   measurement), seconds per image = wall time of the whole set / images, CUDA synchronized around each timing.

``--part native`` (stage 2): the CUDA kernels of csrc/noise_votes_cuda.cu against the Triton kernels (and eager
PyTorch): the kernel cases of benchmarks/test_bench_kernels.py (noise into 10,000 LeNet latents fp32/bf16,
channels_last/contiguous; vote counts), then LeNet s = 1 CERTIFY end to end with ``SPLITZ_BACKEND=native`` against
``auto`` (Triton), fp32 and bf16. CUDA only (recorded as skipped elsewhere).

Every part merges its rows into DIR/targets.json (environment: device name, torch, triton, CUDA, TF32 settings) and
rewrites DIR/targets.csv and DIR/targets.md (tables ready to paste into benchmarks/RESULTS.md, the card named) after
every row, so a part stopped by its time limit keeps the rows it finished. A row that fails records its error and the
next row runs. ``--quick``: tiny sizes (LeNet n = 200, ResNet-20 for ResNet-110, ResNet-50 at 3×32×32, one image, the cheap bound) so
the whole path runs on a CPU in a test (tests/test_gpu_checks.py); its timings are smoke-test numbers, never results.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark modules import each other by bare name, as under pytest
    sys.path.insert(0, str(HERE))

import splitz_fast as sz  # noqa: E402
from splitz_fast.smoothing import DEFAULT_MAX_BATCH  # noqa: E402
from conftest import environment  # noqa: E402
from test_bench_certify import cohen_style_certify  # noqa: E402  (the faithful naive loop, shared)

N0, ALPHA, SIGMA = 100, 0.001, 0.25
PRECISIONS = ("float32", "bfloat16")


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    model: str  # a name of sz.MODELS
    shape: tuple[int, ...]
    n: int
    naive_batches: tuple[int, ...]  # the loop's batch sizes; its fastest is the baseline
    targets: dict = field(default_factory=dict)  # precision → SPEC §5 target, seconds per image
    n0: int = N0
    mnist: bool = False  # trained LeNet and real MNIST digits where available
    options: dict = field(default_factory=dict)  # BoundOptions fields besides the defaults (quick mode only)


# SPEC §5 (one H100/H200): LeNet ≤ 20 ms (n = 10⁵, sound bound included); ResNet-110 n = 10⁵ ≤ 0.5 s fp32 / 0.3 s
# bf16; ResNet-50 n = 10⁴ ≤ 0.8 s fp32 / 0.4 s bf16. Batch 1000 is Cohen's certify.py default, 400 his ImageNet runs'.
FULL = (
    Workload("mnist-lenet", "MNIST LeNet", "lenet", (1, 28, 28), 100_000, (1000, 10_000),
             {"float32": 0.020, "bfloat16": 0.020}, mnist=True),
    Workload("cifar10-resnet110", "CIFAR-10 ResNet-110", "cifar_resnet110", (3, 32, 32), 100_000, (1000,),
             {"float32": 0.5, "bfloat16": 0.3}),
    Workload("imagenet-resnet50", "ImageNet ResNet-50 (3×224×224)", "imagenet_resnet50", (3, 224, 224), 10_000,
             (400,), {"float32": 0.8, "bfloat16": 0.4}),
)
# Quick mode (a CPU smoke test of the whole path): tiny n, small inputs, and the one-step γ search over the
# probabilistic bound (ten exact bounds take seconds on 2 shared CPU cores).
CHEAP_BOUND = {"gamma_search": "one-step", "bound_method": "probabilistic"}
QUICK = (
    Workload("mnist-lenet", "MNIST LeNet (quick)", "lenet", (1, 28, 28), 200, (100,),
             {"float32": 0.020, "bfloat16": 0.020}, mnist=True, options=CHEAP_BOUND),
    Workload("cifar10-resnet110", "CIFAR-10 ResNet-20 (quick stand-in for ResNet-110)", "cifar_resnet20",
             (3, 32, 32), 20, (10,), {"float32": 0.5, "bfloat16": 0.3}, n0=10, options=CHEAP_BOUND),
    Workload("imagenet-resnet50", "ResNet-50 at 3×32×32 (quick)", "imagenet_resnet50", (3, 32, 32), 10, (10,),
             {"float32": 0.8, "bfloat16": 0.4}, n0=5, options=CHEAP_BOUND),
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
            from splitz_fast.data import load_mnist

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
                  precisions=PRECISIONS, naive: bool = True):
    """Yield one row per precision for ``(workload, split)``: ours vs the fp32 naive loop (timed once, first)."""
    model, xs, weights, inputs = load_inputs(workload, split, images + 1, device)
    warm, data = xs[:1], xs[1:]
    n0, n = workload.n0, workload.n
    max_batch = 32 if quick else DEFAULT_MAX_BATCH
    bound_options = sz.BoundOptions(**workload.options)
    reference = sz.Smoother(model, SIGMA, bound_options=bound_options)

    def radius(x, p_lower):  # the same sound radius search as ours, for every input the loop certifies
        reference.radius_search.search(x, sz.latent_radius(SIGMA, p_lower), None)

    naive_by_batch, naive_predictions, naive_errors = {}, [], {}
    for b in workload.naive_batches if naive else ():
        try:  # a batch the loop cannot run (memory) is recorded; its other batches and ours still run
            cohen_style_certify(model, warm, n0, min(n, 2 * b), ALPHA, b, radius, sigma=SIGMA)  # warm-up
            naive_by_batch[b] = timed(lambda b=b: naive_predictions.append(cohen_style_certify(
                model, data, n0, n, ALPHA, b, radius, sigma=SIGMA)), device) / images
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
                   backend=os.environ.get("SPLITZ_BACKEND", "auto"), naive_precision="float32",
                   naive_s_per_image=naive_s, naive_batch=naive_batch,
                   naive_certified=(sum(p != sz.ABSTAIN for p in naive_predictions[-1]) if naive_predictions
                                    else None),
                   naive_s_per_image_by_batch={str(b): s for b, s in naive_by_batch.items()},
                   naive_errors=naive_errors,
                   target_s=workload.targets.get(precision))
        smoother = None
        try:
            smoother = sz.Smoother(model, SIGMA, bound_options=bound_options, precision=precision,
                                   max_batch_size=max_batch)
            start = time.perf_counter()
            list(smoother.certify_many(warm, n0, n, ALPHA, seeds=[10_000]))  # warm-up, batch measurement
            row["setup_s"] = time.perf_counter() - start
            results = []
            seconds = timed(lambda: results.extend(smoother.certify_many(data, n0, n, ALPHA,
                                                                         seeds=range(images))), device)
            certified = [r for r in results if r.prediction != sz.ABSTAIN]
            row.update(status="ok", ours_s_per_image=seconds / images,
                       engine_batch=smoother.engine().batch_size(smoother.latent(data[0]).shape, max_batch),
                       certified=len(certified),
                       gamma_evaluations_mean=(sum(r.gamma_evaluations for r in certified) / len(certified)
                                               if certified else 0.0),
                       bound_kind=certified[0].bound_kind if certified else "none")
            if naive_s:
                row["ratio_vs_naive"] = naive_s / row["ours_s_per_image"]
            if row["target_s"] is not None:
                row["target_met"] = row["ours_s_per_image"] <= row["target_s"]
        except Exception as exc:  # a failed row is recorded; the next one runs
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        yield row
        del smoother
        if device.type == "cuda":
            torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else environment()["device"]


def run_targets(recorder: Recorder, workloads, images: int, device: torch.device, quick: bool, deadline: float):
    for workload in workloads:
        for split in (0, 1):
            if time.monotonic() > deadline:
                recorder.add(dict(workload=workload.key, label=workload.label, n=workload.n, split=split,
                                  status="skipped", error="the part's --budget was spent"))
                continue
            print(f"[{now()}] {workload.label}, s = {split}, n = {workload.n:,}", flush=True)
            try:
                for row in measure_group(workload, split, images, device, quick):
                    print("  " + summary(row), flush=True)
                    recorder.add(row)
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
    return (f"{row['label']} s={row['split']} {row['precision']}: ours {row['ours_s_per_image']:.4f} s/image, naive "
            f"{row['naive_s_per_image'] or float('nan'):.4f} s/image (batch {row['naive_batch']}), "
            f"{ratio or float('nan'):.2f}x, certified {row['certified']}/{row['images']}, target "
            f"{row['target_s']} s: {'met' if row.get('target_met') else 'NOT met'}")


# ----------------------------------------------------------------------------------------------- native vs Triton
def run_native(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    if device.type != "cuda":
        recorder.add(dict(what="native CUDA vs Triton", status="skipped", error="needs CUDA"))
        return
    from splitz_fast.kernels.native_cuda import cuda_native_available

    start = time.perf_counter()
    available = cuda_native_available()  # builds csrc/noise_votes_cuda.cu on first use (stage 2 builds it first)
    recorder.add(dict(what="build or load csrc/noise_votes_cuda.cu", status="ok" if available else "error",
                      seconds=time.perf_counter() - start))
    if not available:
        return
    from test_bench_kernels import CUDA_KERNEL_CASES, cuda_kernel_case

    for case in CUDA_KERNEL_CASES:
        row = dict(what=f"kernel: {case}", device=device_name(device))
        try:
            result = cuda_kernel_case(case, 1000 if quick else 10_000)
            result.pop("run")  # the timed callable (pytest-benchmark's round)
            row.update(result, status="ok")
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)
    lenet = (QUICK if quick else FULL)[0]
    for precision in PRECISIONS:
        row = dict(what=f"LeNet s=1 CERTIFY n={lenet.n:,} {precision}: SPLITZ_BACKEND=native vs auto (Triton)",
                   device=device_name(device), images=images)
        try:
            for backend in ("auto", "native"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the part's --budget was spent")
                os.environ["SPLITZ_BACKEND"] = backend
                (measured,) = measure_group(lenet, 1, images, device, quick, precisions=(precision,), naive=False)
                if measured.get("status") != "ok":
                    raise RuntimeError(measured.get("error"))
                row[f"{backend}_s_per_image"] = measured["ours_s_per_image"]
            row.update(status="ok", native_speedup=row["auto_s_per_image"] / row["native_s_per_image"])
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        finally:
            os.environ.pop("SPLITZ_BACKEND", None)
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)


# ----------------------------------------------------------------------------------------------------- outputs
CSV_FIELDS = ("part", "workload", "label", "model", "split", "precision", "n0", "n", "images", "weights", "inputs",
              "device", "backend", "status", "ours_s_per_image", "naive_s_per_image", "naive_batch",
              "ratio_vs_naive", "target_s", "target_met", "engine_batch", "setup_s", "certified", "naive_certified",
              "gamma_evaluations_mean", "what", "cuda_ms", "triton_ms", "reference_ms", "cuda_vs_triton",
              "auto_s_per_image", "native_s_per_image", "native_speedup", "error")


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
                  "bf16 rows run a bf16 `f_R`, a different base classifier). Naive: the fp32 eager Cohen-style loop "
                  "(`x.repeat` → whole model → `.cpu()` → Python counting, the same radius search), its fastest "
                  "batch, timed in the same process." + (" **Quick mode: smoke-test numbers, not results.**"
                                                          if s.get("quick") else ""), "",
                  "| workload, n | split | f_R | ours (s/image) | naive loop (batch) | ratio | certified (γ evals; loop's) | target | met |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in targets["rows"]:
            name = f"{r.get('label')}, {r.get('n', 0):,}"
            if r.get("status") != "ok":
                lines.append(f"| {name} | s = {r.get('split')} | {r.get('precision', '—')} | {r.get('status')}: "
                             f"{r.get('error', '')} | | | | | |")
                continue
            lines.append(
                f"| {name} ({r['weights']} weights, {r['inputs']}) | s = {r['split']} | {r['precision']} | "
                f"{_fmt(r['ours_s_per_image'], 4)} | {_fmt(r['naive_s_per_image'], 4)} ({r['naive_batch']}) | "
                f"{_fmt(r.get('ratio_vs_naive'), 2, '×')} | {r['certified']}/{r['images']} "
                f"({r['gamma_evaluations_mean']:.1f}; {r.get('naive_certified')}) | ≤ {r['target_s']} s | "
                f"{'yes' if r.get('target_met') else '**no**'} |")
        rs_vs_splitz = splitz_over_rs(targets["rows"])
        if rs_vs_splitz:
            lines += ["", "SPLITZ (s = 1) vs RS (s = 0) certification time, same model and device (target ≤ 1.2×):",
                      "", "| workload | f_R | RS s/image | SPLITZ s/image | SPLITZ / RS |", "|---|---|---|---|---|"]
            lines += [f"| {label} | {precision} | {rs:.4f} | {splitz:.4f} | {splitz / rs:.2f}× |"
                      for label, precision, rs, splitz in rs_vs_splitz]
        lines.append("")
    native = data.get("parts", {}).get("native")
    if native:
        lines += [f"### Native CUDA kernels (csrc/noise_votes_cuda.cu) vs Triton ({native.get('started')})", "",
                  "| what | CUDA / native | Triton / auto | eager reference | native speedup vs Triton |",
                  "|---|---|---|---|---|"]
        for r in native["rows"]:
            if r.get("status") != "ok":
                lines.append(f"| {r.get('what')} | {r.get('status')} {r.get('error', '')} | | | |")
            elif "cuda_ms" in r:
                lines.append(f"| {r['what']} | {r['cuda_ms']:.3f} ms | {r['triton_ms']:.3f} ms | "
                             f"{r['reference_ms']:.3f} ms | {r['cuda_vs_triton']:.2f}× |")
            elif "native_speedup" in r:
                lines.append(f"| {r['what']} ({r['images']} images) | {r['native_s_per_image']:.4f} s/image | "
                             f"{r['auto_s_per_image']:.4f} s/image | — | {r['native_speedup']:.2f}× |")
            else:
                lines.append(f"| {r['what']} | {r['status']} in {r.get('seconds', 0):.1f} s | | | |")
        lines.append("")
    return "\n".join(lines)


def splitz_over_rs(rows) -> list[tuple[str, str, float, float]]:
    times = {(r["label"], r["precision"], r["split"]): r["ours_s_per_image"] for r in rows if r.get("status") == "ok"}
    return [(label, precision, rs, times[(label, precision, 1)])
            for (label, precision, split), rs in times.items() if split == 0 and (label, precision, 1) in times]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-out", help="folder for targets.json, targets.csv, targets.md")
    parser.add_argument("--part", choices=("targets", "native", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke test (not results)")
    parser.add_argument("--images", type=int, default=None, help="images per row (default 3; 1 with --quick)")
    parser.add_argument("--budget", type=float, default=1e9,
                        help="seconds after which a part starts no new model (the shell's timeout is the hard limit)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    images = args.images or (1 if args.quick else 3)
    out = Path(args.out)
    for part in ("targets", "native") if args.part == "all" else (args.part,):
        start = time.monotonic()
        settings = dict(n0=N0, alpha=ALPHA, sigma=SIGMA, images=images, warmup_images=1, quick=args.quick,
                        budget_s=args.budget)
        recorder = Recorder(out, part, settings)
        print(f"[{now()}] part {part} on {device_name(device)}, torch {torch.__version__}", flush=True)
        if part == "targets":
            run_targets(recorder, QUICK if args.quick else FULL, images, device, args.quick, start + args.budget)
        else:
            run_native(recorder, images, device, args.quick, start + args.budget)
        recorder.finish(time.monotonic() - start)
    print(f"[{now()}] wrote {out / 'targets.json'}, targets.csv, targets.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
