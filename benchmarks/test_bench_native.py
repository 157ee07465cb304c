"""The native CPU noise kernel (csrc/noise_cpu.cpp) against eager PyTorch, in the same process on the same latent:

* noise alone: ``noisy_latents_native`` (Philox + Box–Muller + add + channels_last store, torch's intra-op threads)
  against ``torch.randn`` in the engine's layout + ``torch.add`` (what the fallback path and a Cohen-style loop do);
* the sampling engine at LeNet split 1 (32 x 28 x 28 latents, fp32, eager f_R), samples/s with the native stream
  (``SPLITZ_BACKEND=auto``) against the same engine with the torch-generator fallback (``SPLITZ_BACKEND=reference``).

CPU only (on a GPU the Triton kernel draws the noise). Run: ``pytest benchmarks/test_bench_native.py --benchmark-only -s``.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import splitz_fast as sz
from splitz_fast.kernels.native import native_available
from splitz_fast.kernels.noise import noisy_latents_native
from splitz_fast.sampling.engine import NoiseStream, SamplingEngine, SamplingJob

from conftest import DEVICE, QUICK

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or not native_available(),
                                reason="the native noise kernel runs on the CPU and needs a C++ compiler")
NOISE_SAMPLES = 50 if QUICK else 2000
ENGINE_SAMPLES = 200 if QUICK else 10_000
REPEATS = 1 if QUICK else 5


def _best_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_native_noise_vs_torch_randn_and_add(benchmark, record_env):
    latent = torch.rand(32, 28, 28)  # LeNet split-1 latent, drawn channels_last as the engine does for conv f_R
    out = torch.empty((NOISE_SAMPLES, 32, 28, 28), memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(0)

    def native():
        noisy_latents_native(latent, NOISE_SAMPLES, 0.5, 1, 0, channels_last=True, out=out)

    def torch_randn_add():
        z = torch.randn((NOISE_SAMPLES, 28, 28, 32), generator=gen).permute(0, 3, 1, 2)  # NHWC draws, no copy
        torch.add(latent, z, alpha=0.5, out=z)

    native_s, torch_s = _best_seconds(native), _best_seconds(torch_randn_add)
    benchmark.pedantic(native, rounds=1, iterations=1)
    numbers = NOISE_SAMPLES * latent.numel()
    record_env.update(native_s=native_s, torch_s=torch_s, speedup=torch_s / native_s,
                      native_numbers_per_s=numbers / native_s, torch_numbers_per_s=numbers / torch_s)
    print(f"\nnoise, {NOISE_SAMPLES} LeNet latents channels_last, {torch.get_num_threads()} threads: native "
          f"{numbers / native_s / 1e6:.0f} M normals/s, torch.randn + add {numbers / torch_s / 1e6:.0f} M/s, "
          f"speedup {torch_s / native_s:.2f}x")


def _engine_samples_per_s(model: sz.SplitModel, latent: torch.Tensor) -> float:
    engine = SamplingEngine(model.right, model.num_classes, 0.5, torch.device("cpu"), "float32", compile=False)
    batch = engine.batch_size(latent.shape, 4096)
    counts = torch.zeros(model.num_classes, dtype=torch.int64)

    def run():
        engine.run([SamplingJob(latent, NoiseStream(0, torch.device("cpu")), ENGINE_SAMPLES, counts)], batch)

    return ENGINE_SAMPLES / _best_seconds(run, 1 if QUICK else 3)


def test_engine_sampling_native_vs_fallback_noise(benchmark, record_env, monkeypatch):
    torch.manual_seed(0)
    model = sz.lenet(split_index=1).eval()
    latent = model.left(torch.rand(1, 1, 28, 28)).detach()[0]
    rates = {}
    for backend in ("reference", "auto"):  # the fallback's torch generator, then the native Philox kernel
        monkeypatch.setenv("SPLITZ_BACKEND", backend)
        rates[backend] = _engine_samples_per_s(model, latent)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record_env.update(native_samples_per_s=rates["auto"], fallback_samples_per_s=rates["reference"],
                      speedup=rates["auto"] / rates["reference"])
    print(f"\nLeNet s=1 sampling (fp32, eager f_R, {torch.get_num_threads()} threads): native noise "
          f"{rates['auto']:.0f} samples/s, torch-generator noise {rates['reference']:.0f} samples/s, speedup "
          f"{rates['auto'] / rates['reference']:.2f}x")


def test_training_step_native_vs_reference(benchmark, record_env, monkeypatch):
    """The SPLITZ training step (LeNet split 1, batch 256, the default TrainConfig: Q = 1, 5 power steps, Adam step
    included) with the native training kernels (``SPLITZ_BACKEND=auto``: fused clipped ReLU + mask, fused masked-conv
    power steps and norm, Philox noise written channels_last) against the reference path (``SPLITZ_BACKEND=reference``:
    today's PyTorch ops and ``torch.randn`` noise), one model each, timed interleaved in this process."""
    from splitz_fast.training.config import TrainConfig
    from splitz_fast.training.loss import splitz_loss
    from splitz_fast.bounds.estimate import PowerIterationState

    if not native_available("conv_power"):
        pytest.skip("the native training kernels (csrc/train_cpu.cpp) could not be built")
    batch = 16 if QUICK else 256
    torch.manual_seed(0)
    x, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    config = TrainConfig(batch_size=batch)

    def make_step(backend):
        torch.manual_seed(0)
        model = sz.lenet(split_index=1)
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
        state, gen = PowerIterationState(), torch.Generator().manual_seed(1)

        def step():
            monkeypatch.setenv("SPLITZ_BACKEND", backend)
            loss, _ = splitz_loss(model, x, y, config, 0.8, state, gen)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        step()  # warm-up (and the extension's build or load)
        return step

    steps = {backend: make_step(backend) for backend in ("reference", "auto")}
    times: dict[str, list[float]] = {backend: [] for backend in steps}
    for _ in range(1 if QUICK else 7):  # interleaved: the shared machine's load hits both alike
        for backend, step in steps.items():
            start = time.perf_counter()
            step()
            times[backend].append(time.perf_counter() - start)
    benchmark.pedantic(steps["auto"], rounds=1, iterations=1)
    median = {backend: sorted(t)[len(t) // 2] for backend, t in times.items()}
    ratio = median["reference"] / median["auto"]
    record_env.update(native_step_s=median["auto"], reference_step_s=median["reference"], speedup=ratio,
                      native_steps_s=times["auto"], reference_steps_s=times["reference"],
                      threads=torch.get_num_threads(), batch=batch, load_average=os.getloadavg())
    print(f"\nSPLITZ training step, LeNet split 1, batch {batch}, {torch.get_num_threads()} threads, load "
          f"{os.getloadavg()[0]:.2f}: native {median['auto'] * 1e3:.0f} ms, reference {median['reference'] * 1e3:.0f} "
          f"ms (medians of {len(times['auto'])}, interleaved), speedup {ratio:.2f}x (target >= 1.5x)")
