"""SPEC §5's GPU targets, end to end: seconds per certified image (CERTIFY with n0 = 100, the sound bound and the
γ search included) for LeNet/MNIST, ResNet-110/CIFAR-10 and ResNet-50/ImageNet shapes at split 1, each against the
fp32 eager naive loop (``x.repeat`` → full model → ``.cpu()`` → Python counting) timed in the same run on the same
model — the measurement of :mod:`targets` (``python -m benchmarks.targets``, stage 1 of scripts/gpu_checks.sh, which
also runs split 0 and writes the table), here per γ search under pytest-benchmark; and the time of a sound
``L(x, γ)`` for a CIFAR-10 first layer. CUDA only (skipped elsewhere: CPU figures are in test_bench_certify.py).

Run on a GPU: ``pytest benchmarks/test_bench_targets.py --benchmark-only -s``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import splitz_fast as sz
from targets.measure import measure_group
from targets.report import summary
from targets.workloads import FULL, QUICK as QUICK_WORKLOADS

from conftest import DEVICE, QUICK, synchronize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="the SPEC §5 targets are for a GPU")]

IMAGES = 1 if QUICK else 3


@pytest.mark.parametrize("gamma_search", ["bisection", "one-step"])
@pytest.mark.parametrize("name", [w.key for w in FULL])
def test_certify_seconds_per_image_vs_naive_loop(benchmark, record_env, name, gamma_search):
    """``gamma_search``: the default bisection (10 bound evaluations per image) or the paper's one-step search (3);
    one row per ``f_R`` precision (fp32, bf16), both against the same fp32 naive loop."""
    (workload,) = [w for w in (QUICK_WORKLOADS if QUICK else FULL) if w.key == name]
    workload = dataclasses.replace(workload, options={**workload.options, "gamma_search": gamma_search})
    rows = benchmark.pedantic(lambda: list(measure_group(workload, 1, IMAGES, DEVICE, QUICK)), rounds=1,
                              iterations=1)
    record_env.update(rows=rows)
    for row in rows:
        print("\n" + summary(row))
    assert all(row["status"] == "ok" for row in rows), rows


def test_sound_first_layer_bound_cifar10(benchmark, record_env):
    torch.manual_seed(0)
    left = sz.cifar_resnet(110, split_index=1).left.to(DEVICE)
    x = torch.rand(1, 3, 32, 32, device=DEVICE)

    def bound():
        value = sz.lipschitz_bound(left, x, 0.5, method="exact")
        synchronize()
        return value

    bound()  # warm-up
    result = benchmark.pedantic(bound, rounds=1 if QUICK else 5, iterations=1)
    seconds = benchmark.stats.stats.median
    record_env.update(bound=float(result.value[0]), seconds=seconds, target_s=0.010)
    print(f"\nCIFAR-10 first layer, exact sound L on {torch.cuda.get_device_name(0)}: {seconds * 1e3:.1f} ms "
          f"(target <= 10 ms: {'met' if seconds <= 0.010 else 'NOT met'})")
