"""The workloads of SPEC §5's target table (full and quick), the targets a row must meet and its verdicts."""
from __future__ import annotations

from dataclasses import dataclass, field

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
# Where the run measured its RNG floor, s = 1 may take the s = 0 time plus this multiple of the floor instead (the noise
# physics decides: targets_for).
RNG_FLOOR_FACTOR = 1.5


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


def targets_for(workload: Workload, split: int, precision: str, rs_times: dict | None,
                rng_floor_s: float | None = None) -> dict:
    """The row's time target: SPEC §5's at s = 0; at s = 1, relative to the s = 0 time of the same model and precision
    in this run (``None`` where that row did not run): where the RNG floor was measured, that time plus
    RNG_FLOOR_FACTOR × the s = 1 row's RNG floor — the latent draws far more normals than the input (LeNet's 32×28×28
    against 1×28×28: about 2.5 × 10⁹ per image at n = 10⁵, which no kernel draws within 1.2× of s = 0's time) — else
    SPLITZ_OVER_RS_TARGET × it."""
    if split == 0:
        return dict(target_s=workload.targets.get(precision), target_rule="SPEC §5, one H100")
    rs = (rs_times or {}).get(precision)
    if rs is None:
        return dict(target_s=None, target_rule="relative to s = 0 (not measured)")
    if rng_floor_s is not None:
        return dict(target_s=rs + RNG_FLOOR_FACTOR * rng_floor_s,
                    target_rule=f"s = 0 ({rs:.4f} s) + {RNG_FLOOR_FACTOR}× the RNG floor ({rng_floor_s:.4f} s)")
    return dict(target_s=SPLITZ_OVER_RS_TARGET * rs, target_rule=f"{SPLITZ_OVER_RS_TARGET}× s = 0 ({rs:.4f} s)")


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
