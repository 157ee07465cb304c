"""SPEC §5's GPU targets, end to end: seconds per certified image (CERTIFY with n0 = 100, the sound bound and the
γ search included) for LeNet/MNIST, ResNet-110/CIFAR-10 and ResNet-50/ImageNet shapes, and the time of a sound
``L(x, γ)`` for a CIFAR-10 first layer; each against an fp32 eager naive loop (``x.repeat`` → full model → ``.cpu()``
→ Python counting) timed in the same run on the same model. CUDA only (skipped elsewhere: CPU figures are in
test_bench_certify.py). Untrained weights: the time of a pass does not depend on them, only the radius does.

Run on a GPU: ``pytest benchmarks/test_bench_targets.py --benchmark-only -s``.
"""
from __future__ import annotations

import time

import pytest
import torch

import splitz_fast as sz
from test_bench_certify import cohen_style_counts

from conftest import DEVICE, QUICK, synchronize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="the SPEC §5 targets are for a GPU")]

ALPHA = 0.001
# name → (builder, input shape, n, our noise batch, target seconds per image)
TARGETS = {
    "mnist-lenet": (lambda: sz.lenet(split_index=1), (1, 28, 28), 100_000, 50_000, 0.005),
    "cifar10-resnet110": (lambda: sz.cifar_resnet(110, split_index=1), (3, 32, 32), 100_000, 10_000, 0.5),
    "imagenet-resnet50": (lambda: sz.imagenet_resnet50(split_index=1), (3, 224, 224), 10_000, 500, 0.3),
}
NAIVE_BATCH = 1000  # Cohen's certify.py default
IMAGES = 1 if QUICK else 3


def _per_image(fn, images: int) -> float:
    fn(0)  # warm-up: cuDNN/Triton autotuning and compilation are not part of the steady state
    synchronize()
    start = time.perf_counter()
    for i in range(images):
        fn(i + 1)
    synchronize()
    return (time.perf_counter() - start) / images


@pytest.mark.parametrize("gamma_search", ["bisection", "one-step"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_certify_seconds_per_image_vs_naive_loop(benchmark, record_env, name, precision, gamma_search):
    """``gamma_search``: the default bisection (10 bound evaluations per image) or the paper's one-step search (3)."""
    build, shape, n, batch, target_s = TARGETS[name]
    torch.manual_seed(0)
    model = build().eval().to(DEVICE)
    xs = torch.rand(IMAGES + 1, *shape, device=DEVICE)
    smoother = sz.Smoother(model, 0.5, precision=precision, gamma_search=gamma_search)
    naive_s = _per_image(lambda i: cohen_style_counts(model, xs[i], 100 + n, NAIVE_BATCH, 0.5), IMAGES)
    ours_s = _per_image(lambda i: smoother.certify(xs[i], n0=100, n=n, alpha=ALPHA, batch_size=batch, seed=i),
                        IMAGES)
    result = benchmark.pedantic(lambda: smoother.certify(xs[0], 100, n, ALPHA, batch, 0), rounds=1, iterations=1)
    record_env.update(model=name, n=n, batch=batch, precision=precision, gamma_search=gamma_search,
                      ours_s_per_image=ours_s,
                      naive_fp32_s_per_image=naive_s, ratio_vs_naive=naive_s / ours_s, target_s=target_s,
                      bound=result.bound_kind)
    verdict = "met" if ours_s <= target_s and naive_s / ours_s >= 5 else "NOT met"
    print(f"\n{name} n={n:,} {precision} {gamma_search} on {torch.cuda.get_device_name(0)}: ours {ours_s:.4f} "
          f"s/image, naive fp32 loop {naive_s:.4f} s/image, {naive_s / ours_s:.1f}x; target <= {target_s} s and >= 5x: "
          f"{verdict}")


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
