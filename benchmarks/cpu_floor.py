"""The least time a certification can take on this CPU, measured: ``f_R``'s own heavy layers each timed alone, in
every layout the CPU offers, at the precision of the row (benchmarks/test_bench_certify.py's floor columns).

**What is measured** (:func:`cpu_floor`): each ``Conv2d`` and ``Linear`` of ``f_R`` (the layers that carry its FLOPs)
at the input shape it sees in one forward of a sample, run alone on a batch of random rows of that shape — the row's
dtype (float32, or bfloat16 with the weights cast once: the form oneDNN's bf16 kernels take), contiguous (NCHW) and
channels_last for convolutions, at the engine's batch and at smaller ones (:func:`floor_batches`: a large batch can
cost a layer more per row, e.g. a first convolution whose output no longer stays in cache) — under
``torch.inference_mode`` with the process's thread count, the best of :data:`ROUNDS` rounds of at least
:data:`ROUND_S` seconds each, after a warm-up call. The **layer floor** per sample is the sum over the layers of the
best (layout, batch)'s seconds per row: no implementation of this ``f_R`` on this CPU, in this precision, with torch's
kernels, computes those layers faster at any of those batches, whatever it does with the rest. Not in it: ReLUs,
pools, flattening, the votes (cheap next to the layers, and fusable away), so the floor is a lower bound, not an
estimate of what eager PyTorch can reach.

**The RNG floor** per sample: the latent's element count over the normals per second of the faster of torch's CPU
generator (benchmarks/floor.py's ``measure_normal_rate``) and the library's own C++ noise kernels, which the engine
samples with where they are built (Philox + Box–Muller, in float32 — the noise is drawn in float32 at every
precision): the plain one (``noisy_latents_native``, every noisy element written) and the one that max-pools 2×2 as
it draws (``noisy_latents_maxpool2_native``, a quarter written: the drawing rate with the least writing, what the
engine reaches on an ``f_R`` that starts with that pool).

**Floor per image** = ``(n0 + n) × (layer floor + RNG floor)``; the benchmark reports its time as a multiple of it.
Also per layer: its FLOPs per sample (2 per multiply-accumulate), the GFLOP/s of each layout (at its best batch) and
which layout and batch won — the layout a prepared ``f_R`` should run each layer in on this CPU.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

# benchmarks/ is on sys.path (conftest, the package's __init__): the sibling module by bare name
from floor import measure_normal_rate

ROUNDS = 3
ROUND_S = 0.05
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def heavy_layers(right: nn.Module, latent: torch.Tensor) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """``(name, layer, input shape of one sample)`` of each ``Conv2d`` / ``Linear`` of ``right`` in the order one
    forward of ``latent`` (a single latent, no batch dimension) runs them."""
    seen: list[tuple[str, nn.Module, tuple[int, ...]]] = []
    names = {module: name for name, module in right.named_modules()}
    handles = [module.register_forward_pre_hook(
        lambda module, args: seen.append((names[module], module, tuple(args[0].shape[1:]))))
        for module in right.modules() if type(module) in (nn.Conv2d, nn.Linear)]
    try:
        with torch.inference_mode():
            right(latent.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _layouts(layer: nn.Module) -> tuple[torch.memory_format, ...]:
    if isinstance(layer, nn.Conv2d):
        return torch.contiguous_format, torch.channels_last
    return (torch.contiguous_format,)


def seconds_per_row(layer: nn.Module, input_shape: tuple[int, ...], batch: int, dtype: torch.dtype,
                    layout: torch.memory_format) -> float:
    """Seconds per row of ``layer`` alone (a copy in ``dtype`` and ``layout``) on a batch of ``batch`` random rows of
    ``input_shape``: the best of :data:`ROUNDS` rounds of at least :data:`ROUND_S` s, after one warm-up call."""
    copied = copy.deepcopy(layer).to(dtype)
    x = torch.randn(batch, *input_shape).to(dtype)
    if layout is torch.channels_last:
        copied, x = copied.to(memory_format=layout), x.contiguous(memory_format=layout)
    best = float("inf")
    with torch.inference_mode():
        copied(x)
        for _ in range(ROUNDS):
            calls, start = 0, time.perf_counter()
            while calls < 2 or time.perf_counter() - start < ROUND_S:
                copied(x)
                calls += 1
            best = min(best, (time.perf_counter() - start) / calls)
    return best / batch


def floor_batches(batch: int) -> tuple[int, ...]:
    """The batches each layer of the floor is timed at: the engine's ``batch`` and those of 64 and 256 below it."""
    return tuple(sorted({batch, *(b for b in (64, 256) if b < batch)}))


def _flops_per_row(layer: nn.Module, input_shape: tuple[int, ...]) -> float:
    if isinstance(layer, nn.Linear):
        return 2.0 * layer.in_features * layer.out_features
    out = layer(torch.zeros(1, *input_shape, dtype=layer.weight.dtype)).shape  # a single sample: cheap
    per_output = layer.in_channels // layer.groups * layer.kernel_size[0] * layer.kernel_size[1]
    return 2.0 * per_output * out[1:].numel()


def native_noise_rates(count: int = 1 << 22, rounds: int = ROUNDS) -> dict[str, float]:
    """Normals per second that the library's C++ noise kernels draw in one call of ``count`` of them (float32, the
    best of ``rounds`` after a warm-up), by kernel: ``native`` (every noisy element written) and ``native-pooled``
    (2×2 max-pooled as drawn); empty where the extension is not built."""
    from splitz_fast.kernels.native import native_available
    from splitz_fast.kernels.noise import noisy_latents_maxpool2_native, noisy_latents_native

    if not native_available():
        return {}
    latent = torch.zeros(16, 32, 32)
    kernels = {"native": noisy_latents_native, "native-pooled": noisy_latents_maxpool2_native}
    rates = {}
    for name, kernel in kernels.items():
        best = float("inf")
        for round_ in range(rounds + 1):
            start = time.perf_counter()
            kernel(latent, count // latent.numel(), 1.0, 0, round_ * count)
            if round_:  # the first call loads the extension
                best = min(best, time.perf_counter() - start)
        rates[name] = count / best
    return rates


def cpu_floor(right: nn.Module, latent: torch.Tensor, batch: int, precision: str, samples: int,
              normal_rate: float | None = None) -> dict:
    """The floor columns of one row: ``right`` (``f_R``, on the CPU) for ``latent`` (one sample's noisy input
    shape), each heavy layer timed at ``batch`` rows in ``precision`` (a key of :data:`DTYPES`) and every layout, and
    ``samples`` (n0 + n) samples per image. ``normal_rate``: the normals per second torch's CPU generator writes
    (measured here when not given)."""
    dtype = DTYPES[precision]
    layers, layer_floor = [], 0.0
    with torch.no_grad():
        for name, layer, shape in heavy_layers(right, latent):
            flops = _flops_per_row(layer, shape)
            times = {(("channels_last" if layout is torch.channels_last else "contiguous"), rows):
                     seconds_per_row(layer, shape, rows, dtype, layout)
                     for layout in _layouts(layer) for rows in floor_batches(batch)}
            (best_layout, best_batch) = min(times, key=times.get)
            layer_floor += times[best_layout, best_batch]
            by_layout = {layout: min(t for (lay, _), t in times.items() if lay == layout) for layout, _ in times}
            layers.append(dict(name=name, kind=type(layer).__name__, input_shape=list(shape), flops_per_sample=flops,
                               gflops_by_layout={k: flops / t / 1e9 for k, t in by_layout.items()},
                               best_layout=best_layout, best_batch=best_batch))
    if normal_rate is None:
        rates = {"torch": measure_normal_rate(torch.device("cpu"), count=1 << 22), **native_noise_rates()}
        source = max(rates, key=rates.get)
        normal_rate = rates[source]
    else:
        source = "given"
    rng = latent.numel() / normal_rate
    return dict(floor_precision=precision, floor_batch=batch, floor_threads=torch.get_num_threads(),
                layer_floor_s_per_sample=layer_floor, rng_floor_s_per_sample=rng, normal_rate=normal_rate,
                normal_rate_source=source, floor_s_per_image=samples * (layer_floor + rng), floor_layers=layers)


__all__ = ["cpu_floor", "floor_batches", "heavy_layers", "native_noise_rates", "seconds_per_row"]
