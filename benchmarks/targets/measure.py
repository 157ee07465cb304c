"""The measurement of the target table: timing, the inputs, the environment record, the rows of the targets part
(``measure_group``, ``run_targets``) and the :class:`Recorder` that merges them into DIR/targets.json and rewrites
the tables after every row."""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import torch

import splitz_fast as sz
from splitz_fast.certify.windows import WINDOW_BATCHES
from splitz_fast.cuda_math import convolutions_use_tf32, matmuls_use_tf32
from splitz_fast.kernels import conv_relu_pool
# benchmarks/ is on sys.path (the package's __init__ puts it there): the benchmark modules by bare name
from compile_watch import BatchShapes, CompileCounter, timed_region_record
from conftest import environment
from floor import card_for, count_cost, floors, rng_floor
from test_bench_certify import cohen_style_certify  # (the faithful naive loop, shared)

from .report import markdown, summary, write_csv
from .workloads import ALPHA, BASELINE, PRECISIONS, SIGMA, Workload, assess, targets_for


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


MISSING_PACKAGES = "run `make gpu-wheels` and carry .whl to the GPU machine"


def load_inputs(workload: Workload, split: int, count: int, device: torch.device, quick: bool):
    """``(model, inputs [count, *shape], weights label, inputs label)``; the first input is the warm-up.

    An MNIST workload runs advertorch's trained LeNet on real test digits (SPEC §4's offline packages): the SPEC row
    is about that model, so without the packages the row fails, saying how to carry them, rather than time random
    weights. Only ``quick`` (a CPU smoke test of the path, never a result) falls back to random weights and inputs."""
    from splitz_fast.data.packages import DatasetUnavailableError, load_mnist

    torch.manual_seed(0)
    weights, inputs = "random", "synthetic uniform [0, 1]"
    model = sz.build_model(workload.model, split_index=split)
    xs = torch.rand(count, *workload.shape)
    if workload.mnist:
        try:
            model = sz.build_model(workload.model, split_index=split, pretrained=True)
            xs = load_mnist("test")[0][:count].clone()
            weights, inputs = "advertorch clean-trained", "MNIST test digits"
        except DatasetUnavailableError as exc:  # the offline packages are absent
            if not quick:
                raise RuntimeError(f"no trained LeNet or MNIST digits ({error_text(exc)}): {MISSING_PACKAGES}") from exc
            print(f"  (quick mode without the offline packages: {error_text(exc)}; random weights, synthetic "
                  "inputs)", flush=True)
    if model.input_shape not in (None, workload.shape):  # quick mode's small inputs for ResNet-50
        model.left.input_shape = tuple(workload.shape)
    return model.eval().to(device), xs.to(device), weights, inputs


class Recorder:
    """The parts' shared output: DIR/targets.json (merged by part), targets.csv and targets.md, rewritten per row."""

    def __init__(self, out: Path, part: str, settings: dict, *, append: bool = False):
        """``append``: this call's rows follow those the part already has in DIR/targets.json (the shell runs stage 1
        one workload per process, each under its own deadline); otherwise the part starts empty."""
        self.out, self.part = out, part
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "targets.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data["environment"] = environment_record()
        parts = self.data.setdefault("parts", {})
        earlier = parts.get(part) if append else None
        if earlier is None:
            parts[part] = {"settings": settings, "rows": [], "started": now()}
        else:
            for key in ("workloads", "precisions"):  # the settings of the calls together
                if key in settings:
                    earlier["settings"][key] = [*earlier["settings"].get(key, []),
                                                *(k for k in settings[key] if k not in earlier["settings"].get(key, []))]
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
               tf32_matmul=matmuls_use_tf32(), tf32_cudnn=convolutions_use_tf32(),
               cudnn_benchmark=torch.backends.cudnn.benchmark, splitz_backend=os.environ.get("SPLITZ_BACKEND", "auto"))
    return env


def measure_group(workload: Workload, split: int, images: int, device: torch.device, quick: bool,
                  precisions=PRECISIONS, naive: bool = True, bandwidth: float | None = None,
                  rs_times: dict | None = None, cuda_graphs: bool | None = None, compile: bool | None = None,
                  bound_options: dict | None = None, fused_kernels: bool | None = None,
                  normal_rate: float | None = None):
    """Yield one row per precision for ``(workload, split)``: ours vs the fp32 naive loop (timed once, first), with
    ``f_R``'s counted cost per sample and the card's floors. ``bandwidth``: the copy bandwidth measured in this run
    (bytes/s; the card table's figure otherwise). ``rs_times``: precision → this model's s = 0 time, for the s = 1
    target. ``cuda_graphs``: the Smoother's setting (default: decided by measurement); each row records what the
    engine decided. ``compile``: the Smoother's ``torch.compile`` setting (default: the library's, which compiles only
    after a minute of eager sampling at one batch size, so not within a row; what it decided is recorded in
    ``compiled``). ``bound_options``: BoundOptions fields
    set on top of the workload's (for A/B rows). ``fused_kernels``: the Smoother's setting (default: decided by
    measurement, recorded like the graphs). ``normal_rate``: the normals per second torch's generator drew in this
    run (benchmarks/floor.py's measure_normal_rate): the RNG floor of each row, in its floors and the s = 1 target."""
    model, xs, weights, inputs = load_inputs(workload, split, images + 1, device, quick)
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
    rng = rng_floor(reference.latent(warm[0]).numel(), n0 + n, normal_rate) if normal_rate else {}

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
        row.update(rng)
        row.update(targets_for(workload, split, precision, rs_times, rng.get("rng_floor_s")))
        if naive_batch is not None:
            row.update(timed_region_record(naive_regions[naive_batch], prefix="naive_"))
        if cost is not None:
            row.update(cost.record())
            row.update(floors(cost, precision, n0 + n, card, bandwidth, rng.get("rng_floor_s", 0.0)))
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
    return engine.graphs.records()


def fusion_record(engine) -> list[dict]:
    """What the engine decided about its fused ``f_R`` copy, per layout and batch it sampled (empty off CUDA, or where
    nothing fuses)."""
    return engine.fusion.records()


def compile_record(engine) -> list[dict]:
    """What the engine decided about ``torch.compile`` of ``f_R``, per layout, copy and batch where it compiled (with
    ``compile_s``, the first compiled call); empty where it never did (``compile=False``, or the default's minute of
    eager sampling not reached)."""
    return engine.compiling.records()


def error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else environment()["device"]


def run_targets(recorder: Recorder, workloads, images: int, device: torch.device, quick: bool, deadline: float,
                bandwidth: float | None = None, precisions=PRECISIONS, normal_rate: float | None = None):
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
                                         rs_times=rs_times if split else None, normal_rate=normal_rate):
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
