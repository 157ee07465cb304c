"""Monte Carlo throughput of our sampling engine against a faithful Cohen-style loop, and the cost of a SPLITZ
training step against a Gaussian-augmentation step, each baseline run in the same process on the same model.

Cohen-style loop (what the published SPLITZ/Cohen code does per batch): ``x.repeat(b)`` → the full model including
``f_L`` → add noise after ``f_L`` → ``f_R`` → ``argmax`` → ``.cpu().numpy()`` → Python vote counting.
Our engine: ``f_L(x)`` once, float32 noise added to it, ``f_R``, votes counted on the device, one sync per input.
Models: LeNet on MNIST shapes and ResNet-110 on CIFAR-10 shapes, on CUDA when there is one (else the CPU).
Run: ``pytest benchmarks/ --benchmark-only -s``; ``SPLITZ_BENCH_SAMPLES`` sets the samples per input for LeNet
(default 10,000; ResNet-110 uses a tenth of it on the CPU, all of it on a GPU).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import splitz_fast as sz
from splitz_fast.lipschitz import PowerIterationState
from splitz_fast.smoothing import NoiseStream
from splitz_fast.training import TrainConfig, splitz_loss

from conftest import DEVICE, QUICK, synchronize

SAMPLES = int(os.environ.get("SPLITZ_BENCH_SAMPLES", "200" if QUICK else "10000"))
COHEN_DEFAULT_BATCH = 1000  # locuslab/smoothing's certify.py default; the baseline runs at both and keeps its best
SIGMA = 0.5
# name → (builder, input shape, samples, our batch); small LeNet batches are fastest on a CPU (cache-resident).
MODELS = {
    "lenet": (sz.lenet, (1, 28, 28), SAMPLES, 100 if DEVICE.type == "cpu" else 10_000),
    "cifar_resnet110": (lambda split_index: sz.cifar_resnet(110, split_index=split_index), (3, 32, 32),
                        SAMPLES if DEVICE.type == "cuda" else max(20, SAMPLES // 10),
                        100 if DEVICE.type == "cpu" else 2_000),
}
if QUICK:
    MODELS.pop("cifar_resnet110")


def cohen_style_counts(model: sz.SplitModel, x: torch.Tensor, num: int, batch: int, sigma: float) -> np.ndarray:
    """The baseline: repeat the input, run the whole model per batch, copy predictions to the host, count in Python."""
    counts = np.zeros(model.num_classes, dtype=int)
    remaining = num
    with torch.no_grad():
        while remaining > 0:
            b = min(batch, remaining)
            inputs = x.unsqueeze(0).repeat((b,) + (1,) * x.ndim)
            latent = model.left(inputs)
            predictions = model.right(latent + sigma * torch.randn_like(latent)).argmax(1).cpu().numpy()
            for p in predictions:
                counts[p] += 1
            remaining -= b
    return counts


def _time(fn, repeats: int = 1 if QUICK else 3) -> float:
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("split_index", [0, 1])
@pytest.mark.parametrize("name", list(MODELS))
def test_sampling_throughput_vs_cohen_loop(benchmark, record_env, name, split_index, precision):
    """Our engine with f_R in ``precision`` (bf16: a different base classifier, labelled as such) against the
    fp32 Cohen-style loop."""
    build, shape, samples, batch = MODELS[name]
    torch.manual_seed(0)
    model = build(split_index=split_index).eval().to(DEVICE)
    x = torch.rand(*shape, device=DEVICE)
    smoother = sz.Smoother(model, SIGMA, precision=precision)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    baseline_by_batch = {b: _time(lambda b=b: cohen_style_counts(model, x, samples, b, SIGMA))
                         for b in sorted({batch, COHEN_DEFAULT_BATCH})}
    baseline_batch = min(baseline_by_batch, key=baseline_by_batch.get)
    baseline_s = baseline_by_batch[baseline_batch]

    def ours():
        with smoother._evaluating():
            noise = NoiseStream(0, gen)
            return smoother.sample_counts(smoother.latent(x), samples, batch, noise).cpu()

    counts = benchmark.pedantic(ours, rounds=1 if QUICK else 3, iterations=1)
    ours_s = benchmark.stats.stats.median
    assert int(counts.sum()) == samples
    ratio = baseline_s / ours_s
    record_env.update(model=name, precision=precision, samples=samples, batch=batch,
                      ours_samples_per_s=samples / ours_s,
                      baseline_samples_per_s={b: samples / t for b, t in baseline_by_batch.items()},
                      ratio_vs_best_cohen_loop=ratio)
    per_batch = ", ".join(f"batch {b}: {samples / t:,.0f}" for b, t in baseline_by_batch.items())
    print(f"\n{name} s={split_index} on {DEVICE.type}: ours ({precision} f_R) {samples / ours_s:,.0f} samples/s "
          f"(batch {batch}); "
          f"Cohen-style loop {per_batch} samples/s; ratio vs its best {ratio:.2f}x ({samples} samples per input)")


def test_splitz_training_step_vs_gaussian_augmentation_step(benchmark, record_env):
    torch.manual_seed(0)
    x = torch.rand(256, 1, 28, 28, device=DEVICE)
    y = torch.randint(0, 10, (256,), device=DEVICE)
    config = TrainConfig(sigma=0.75, batch_size=256, power_iters=5)

    def make_step(split_index):
        model = sz.lenet(split_index=split_index).to(DEVICE)
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
        state = PowerIterationState()

        def step():
            loss, _ = splitz_loss(model, x, y, config, 0.8, state)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            synchronize()
        step()  # warm-up
        return step

    rs_step = make_step(0)
    rs_s = _time(rs_step, repeats=1 if QUICK else 5)
    benchmark.pedantic(make_step(1), rounds=1 if QUICK else 5, iterations=1)
    splitz_s = benchmark.stats.stats.median
    record_env.update(rs_step_s=rs_s, splitz_step_s=splitz_s, ratio_vs_rs=splitz_s / rs_s)
    print(f"\nLeNet batch 256, Q=1, 5 power steps: SPLITZ step {splitz_s * 1e3:.0f} ms, Gaussian-augmentation step "
          f"{rs_s * 1e3:.0f} ms, ratio {splitz_s / rs_s:.2f}x (target <= 1.3x)")
