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
against the plain one (:func:`.comparisons.run_fused_kernels_comparison`), ``torch.compile``, ``gamma_batch`` 4
against the bisection, the exact bound's pieces (the Gram built gathered against tap by tap, the squaring against the eigvalsh
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
import faulthandler
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from splitz_fast.cuda_math import convolutions_use_tf32, matmuls_use_tf32

# benchmarks/ is on sys.path (the package's __init__ puts it there): the benchmark modules by bare name
from floor import card_for, measure_copy_bandwidth, measure_normal_rate

from .comparisons import run_native
from .measure import Recorder, device_name, now, run_targets
from .workloads import ALPHA, FULL, N0, PRECISIONS, QUICK, SIGMA


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
    parser.add_argument("--append", action="store_true",
                        help="add the rows to the part's rows already in DIR/targets.json (one call per workload)")
    args = parser.parse_args(argv)
    # A stage stopped by the shell's `timeout` (SIGTERM) leaves every thread's stack in its log: the frame it hung in.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
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
        bandwidth = normal_rate = None
        if part == "targets":
            settings.update(workloads=[w.key for w in workloads], precisions=list(precisions))
            card = card_for(device_name(device)) if device.type == "cuda" else None
            bandwidth = measure_copy_bandwidth(device)  # None off CUDA
            normal_rate = measure_normal_rate(device, count=1 << 20 if args.quick else 1 << 25)
            settings.update(card=asdict(card) if card else None, copy_bandwidth_Bps=bandwidth, normal_rate=normal_rate,
                            tf32_conv=convolutions_use_tf32(), tf32_matmul=matmuls_use_tf32())
        recorder = Recorder(out, part, settings, append=args.append)
        print(f"[{now()}] part {part} on {device_name(device)}, torch {torch.__version__}"
              + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "")
              + (f"; torch's generator {normal_rate / 1e9:.2f} G normals/s" if normal_rate else ""), flush=True)
        if part == "targets":
            run_targets(recorder, workloads, images, device, args.quick, start + args.budget, bandwidth, precisions,
                        normal_rate)
        else:
            run_native(recorder, images, device, args.quick, start + args.budget)
        recorder.finish(time.monotonic() - start)
    print(f"[{now()}] wrote {out / 'targets.json'}, targets.csv, targets.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
