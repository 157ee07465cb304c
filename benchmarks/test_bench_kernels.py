"""Each Triton op against its PyTorch reference (cuDNN/cuBLAS/torch.randn underneath), and the CUDA kernels of csrc/
against both, timed in the same process on the same inputs — the numbers that decide whether ``select_backend`` should
send an op to Triton (or to the CUDA kernel) on CUDA.

Shapes are the ones the library runs: the LeNet/MNIST first convolution (1→32, 3×3, pad 1, 28×28) and the CIFAR
ResNet stem (3→16, 3×3, pad 1, 32×32); a training batch of 256 for the masked products (forward, adjoint, and
forward+backward as in the training estimate); one image and a batch of 64 for the fused first-layer bound in float64
(the certificate's precision); 10,000 noisy copies of a LeNet latent plus the vote count for the sampling ops.
CUDA only: on a CPU the reference is the only path. Run: ``pytest benchmarks/test_bench_kernels.py --benchmark-only -s``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from splitz_fast.kernels.first_layer_bounds import first_layer_bounds
from splitz_fast.kernels.masked_conv2d import masked_conv2d
from splitz_fast.kernels.noise import noisy_latents_triton
from splitz_fast.kernels.votes import count_votes_triton, count_votes_reference

from conftest import DEVICE, QUICK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton vs reference needs CUDA")]

CONVS = {"lenet-conv1": (1, 32, 28), "cifar-stem": (3, 16, 32)}  # name → (C_in, C_out, spatial size)
REPEATS = 5 if QUICK else 50


def _cuda_ms(fn) -> float:
    """Median milliseconds of ``fn`` over REPEATS runs, timed with CUDA events after three warm-ups (compilation and
    autotuning excluded)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _compare(benchmark, record_env, label: str, triton_fn, reference_fn) -> None:
    triton_ms, reference_ms = _cuda_ms(triton_fn), _cuda_ms(reference_fn)
    benchmark.pedantic(triton_fn, rounds=1, iterations=1)
    record_env.update(op=label, triton_ms=triton_ms, reference_ms=reference_ms, speedup=reference_ms / triton_ms)
    print(f"\n{label} on {torch.cuda.get_device_name(0)}: triton {triton_ms:.3f} ms, reference {reference_ms:.3f} ms, "
          f"triton speedup {reference_ms / triton_ms:.2f}x")


def _conv_case(name: str, batch: int = 256):
    c_in, c_out, size = CONVS[name]
    torch.manual_seed(0)
    layer = nn.Conv2d(c_in, c_out, 3, padding=1).to(DEVICE)
    v = torch.randn(batch, c_in, size, size, device=DEVICE)
    u = torch.randn(batch, c_out, size, size, device=DEVICE)
    mask = torch.rand(batch, c_out, size, size, device=DEVICE) < 0.6  # per-sample varying mask
    return layer, v, u, mask


@pytest.mark.parametrize("direction", ["forward", "adjoint", "forward+backward"])
@pytest.mark.parametrize("name", list(CONVS))
def test_masked_conv2d_triton_vs_cudnn(benchmark, record_env, name, direction):
    layer, v, u, mask = _conv_case(name)
    weight = layer.weight.detach()
    if direction == "forward+backward":
        weight = weight.clone().requires_grad_(True)
        v = v.clone().requires_grad_(True)

    def run(backend):
        if direction == "forward":
            return lambda: masked_conv2d(v, weight, layer, out_mask=mask, backend=backend)
        if direction == "adjoint":
            return lambda: masked_conv2d(u, weight, layer, out_mask=mask, transpose=True, in_size=v.shape[-2:],
                                         backend=backend)

        def step():
            out = masked_conv2d(v, weight, layer, out_mask=mask, backend=backend)
            out.square().sum().backward()
        return step

    _compare(benchmark, record_env, f"masked_conv2d {name} batch {v.shape[0]} {direction}", run("triton"),
             run("reference"))


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("name", list(CONVS))
def test_first_layer_bounds_triton_vs_reference(benchmark, record_env, name, batch):
    c_in, c_out, size = CONVS[name]
    torch.manual_seed(0)
    layer = nn.Conv2d(c_in, c_out, 3, padding=1).to(DEVICE).double()
    x = torch.rand(batch, c_in, size, size, device=DEVICE, dtype=torch.float64)

    def run(backend):
        return lambda: first_layer_bounds(x, layer, 0.5, 1.0, rel_rounding=1e-12, need_next=True, backend=backend)

    _compare(benchmark, record_env, f"first_layer_bounds {name} batch {batch} float64", run("triton"),
             run("reference"))


def test_noise_and_votes_triton_vs_reference(benchmark, record_env):
    torch.manual_seed(0)
    latent = torch.rand(32, 28, 28, device=DEVICE)  # LeNet s=1 latent
    logits = torch.randn(10_000, 10, device=DEVICE)
    counts = torch.zeros(10, dtype=torch.int64, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def ours():
        noisy_latents_triton(latent, 10_000, 0.5, 0, 0)
        count_votes_triton(logits, counts)

    def reference():  # what eager PyTorch does: torch.randn in float32, the add, argmax + bincount
        torch.add(latent, torch.randn((10_000, *latent.shape), generator=gen, device=DEVICE), alpha=0.5)
        count_votes_reference(logits, counts)

    _compare(benchmark, record_env, "noisy_latents + count_votes_triton, 10,000 LeNet latents", ours, reference)


CUDA_KERNEL_CASES = ["noise fp32 channels_last", "noise fp32 contiguous", "noise bf16 channels_last",
                     "votes 10 classes", "votes 1000 classes"]


def cuda_kernel_case(case: str, samples: int) -> dict:
    """One case of :func:`test_cuda_kernels_vs_triton_vs_reference`: median CUDA-event milliseconds of the CUDA kernel,
    the Triton kernel and eager PyTorch on the same inputs (also run by ``python -m benchmarks.targets --part
    native``, stage 2 of scripts/gpu_checks.sh)."""
    from splitz_fast.kernels.native_cuda import cuda_native_available
    from splitz_fast.kernels.noise import noisy_latents_cuda
    from splitz_fast.kernels.votes import count_votes_cuda

    assert cuda_native_available(), "csrc/noise_votes_cuda.cu did not build here (see the warning)"
    torch.manual_seed(0)
    if case.startswith("noise"):
        dtype = torch.bfloat16 if "bf16" in case else torch.float32
        channels_last = "channels_last" in case
        latent = torch.rand(32, 28, 28, device=DEVICE)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        out = torch.empty((samples, 32, 28, 28), dtype=dtype, device=DEVICE, memory_format=fmt)
        gen = torch.Generator(device=DEVICE).manual_seed(0)

        def run(fn):
            return lambda: fn(latent, samples, 0.5, 0, 0, out_dtype=dtype, channels_last=channels_last, out=out)

        def reference():  # eager: torch.randn in float32, the add, the cast into the batch
            out.copy_(torch.add(latent, torch.randn((samples, 32, 28, 28), generator=gen, device=DEVICE), alpha=0.5))

        cuda_fn, triton_fn = run(noisy_latents_cuda), run(noisy_latents_triton)
    else:
        classes = int(case.split()[1])
        logits = torch.randn(samples, classes, device=DEVICE)
        counts = torch.zeros(classes, dtype=torch.int64, device=DEVICE)
        cuda_fn = lambda: count_votes_cuda(logits, counts)  # noqa: E731
        triton_fn = lambda: count_votes_triton(logits, counts)  # noqa: E731
        reference = lambda: count_votes_reference(logits, counts)  # noqa: E731
    cuda_ms, triton_ms, reference_ms = _cuda_ms(cuda_fn), _cuda_ms(triton_fn), _cuda_ms(reference)
    written = dict(bytes_written=out.numel() * out.element_size()) if case.startswith("noise") else {}
    return dict(op=f"{case}, {samples} rows", cuda_ms=cuda_ms, triton_ms=triton_ms, reference_ms=reference_ms,
                cuda_vs_triton=triton_ms / cuda_ms, cuda_vs_reference=reference_ms / cuda_ms, **written, run=cuda_fn)


@pytest.mark.parametrize("case", CUDA_KERNEL_CASES)
def test_cuda_kernels_vs_triton_vs_reference(benchmark, record_env, case):
    """The CUDA kernels of csrc/noise_votes_cuda.cu (``SPLITZ_BACKEND=native``) against the Triton kernels (the
    ``auto`` default on CUDA) and eager PyTorch, same inputs, same process: 10,000 noisy LeNet split-1 latents into a
    preallocated batch, or the vote count of 10,000 rows. Both ratios are recorded; ``auto`` should switch to the CUDA
    kernel (kernels/__init__.py: AUTO_CUDA_NATIVE_OPS) only where ``cuda_vs_triton`` > 1 on the GPU that matters."""
    samples = 1000 if QUICK else 10_000
    result = cuda_kernel_case(case, samples)
    benchmark.pedantic(result.pop("run"), rounds=1, iterations=1)
    record_env.update(result)
    print(f"\n{case}, {samples} rows on {torch.cuda.get_device_name(0)}: cuda {result['cuda_ms']:.3f} ms, triton "
          f"{result['triton_ms']:.3f} ms, reference {result['reference_ms']:.3f} ms; cuda speedup "
          f"{result['cuda_vs_triton']:.2f}x vs triton, {result['cuda_vs_reference']:.2f}x vs reference")
