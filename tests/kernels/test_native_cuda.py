"""The CUDA kernels of csrc/noise_votes_cuda.cu: they compile wherever nvcc exists (CI has nvcc but no GPU, so the
compile-only check keeps the sources from rotting), the ``native`` backend reaches them on CUDA tensors, and on a GPU
they match the references beyond the shapes of tests/kernels/test_kernels_noise_votes.py (where every noise and vote test also
runs on them, ``native-cuda``).
"""
from __future__ import annotations

import shutil
import subprocess
import warnings

import pytest
import torch

from splitz_fast.kernels import BACKEND_ENV, select_backend
from splitz_fast.kernels.native_cuda import (
    binding_syntax_command,
    cuda_include_dir,
    cuda_module,
    nvcc_compile_command,
    nvcc_path,
)
from splitz_fast.kernels.noise import noisy_latents_cuda, noisy_latents_reference, noisy_latents_triton
from splitz_fast.kernels.votes import count_votes_cuda, count_votes_reference

CUDA = torch.cuda.is_available()


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


# ------------------------------------------------------------------------------------------------ compile only (CI)
@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda): the "
                    "CUDA sources cannot be compiled here")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """``nvcc -c`` of the kernels for sm_90 with the JIT build's flags (5-10 s: the .cu includes no torch header)."""
    target = tmp_path / "noise_votes_cuda.o"
    done = _run(nvcc_compile_command(target))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert target.stat().st_size > 0
    ours = [line for line in done.stderr.splitlines() if "warning" in line.lower() and "csrc" in line]
    assert not ours, done.stderr[-4000:]  # no warning in our sources (the toolchain's own notes are not ours)


@pytest.mark.slow
@pytest.mark.skipif(nvcc_path() is None or cuda_include_dir() is None or shutil.which("c++") is None,
                    reason="needs the CUDA headers (beside nvcc) and a C++ compiler")
def test_cuda_binding_compiles_against_torch():
    """The binding (csrc/noise_votes_cuda_bind.cpp) against the installed torch's C++ API and c10/cuda headers,
    syntax only (about 25 s of CPU: it parses torch/extension.h)."""
    done = _run(binding_syntax_command())
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


# --------------------------------------------------------------------------------------------- dispatch, no GPU
def test_native_backend_on_cuda_selects_the_cuda_kernels(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert select_backend("noisy_latents", cuda) == "native"
    assert select_backend("count_votes", cuda) == "native"
    assert select_backend("first_layer_bounds", cuda) == "reference"  # no CUDA kernel in csrc/
    assert select_backend("count_votes", cpu) == "reference"  # no native CPU vote kernel
    monkeypatch.setenv(BACKEND_ENV, "auto")  # auto keeps Triton on CUDA until the CUDA kernels are measured faster
    assert select_backend("noisy_latents", cuda) == "triton"
    assert select_backend("count_votes", cuda) == "triton"


def test_cuda_launchers_refuse_cpu_tensors_after_checking_arguments():
    latent = torch.randn(3, 4)
    with pytest.raises(ValueError, match="sigma"):
        noisy_latents_cuda(latent, 2, -1.0, 1, 0)
    with pytest.raises(ValueError, match="CUDA"):
        noisy_latents_cuda(latent, 2, 1.0, 1, 0)
    with pytest.raises(ValueError, match="bins"):
        count_votes_cuda(torch.randn(4, 10), torch.zeros(9, dtype=torch.int64))
    with pytest.raises(ValueError, match="CUDA"):
        count_votes_cuda(torch.randn(4, 10), torch.zeros(10, dtype=torch.int64))


@pytest.mark.skipif(CUDA, reason="checks the machine without CUDA")
def test_without_cuda_the_module_is_not_built_and_nothing_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_module() is None


# -------------------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("shape,channels_last", [((32, 28, 28), True), ((32, 28, 28), False), ((16, 7, 7), True),
                                                 ((3, 33, 33), False), ((25_088,), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_noise_matches_triton_and_reference_on_engine_shapes(shape, channels_last, dtype):
    """Engine-sized latents (LeNet split 1, a CIFAR block, a flat MLP latent), hundreds of samples at an offset whose
    counters use the high word: the CUDA kernel equals the Triton kernel and the reference up to the float32 rounding
    of ln / sin / cos (then the same cast)."""
    latent = torch.randn(shape, device="cuda")
    args = (latent, 300, 0.25, 2**64 - 7, 2**35 + 3)
    ours = noisy_latents_cuda(*args, out_dtype=dtype, channels_last=channels_last)
    for other in (noisy_latents_triton(*args, out_dtype=dtype, channels_last=channels_last),
                  noisy_latents_reference(*args, out_dtype=dtype, channels_last=channels_last)):
        assert ours.stride() == other.stride()
        tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # one bf16 ulp where the float32 sums round apart
        assert torch.allclose(ours.float(), other.float(), rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:
        with_z = (ours.double() - latent.double()) / 0.25
        assert with_z.abs().max() < 9.5 and abs(float(with_z.mean())) < 0.01 and abs(float(with_z.std()) - 1) < 0.01


@pytest.mark.parametrize("rows,classes", [(300_000, 10), (50_000, 100), (2_000, 9_000), (100_000, 1)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_votes_on_large_batches_and_many_classes(rows, classes):
    """Grid-stride rows (thread per row and warp per row) and more classes than the shared histogram holds."""
    gen = torch.Generator(device="cuda").manual_seed(rows + classes)
    logits = torch.randint(0, 3, (rows, classes), device="cuda", generator=gen).float()
    counts = torch.full((classes,), 7, dtype=torch.int64, device="cuda")
    count_votes_cuda(logits, counts)
    assert torch.equal(counts, count_votes_reference(logits, torch.full_like(counts, 7)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_engine_runs_on_the_cuda_kernels_when_forced(monkeypatch):
    """SPLITZ_BACKEND=native on a GPU: the sampling engine draws with noisy_latents_cuda and counts with
    count_votes_cuda (same Philox stream as the Triton default)."""
    import splitz_fast as sz
    from splitz_fast.sampling.engine import NoiseStream, SamplingEngine, SamplingJob

    monkeypatch.setenv(BACKEND_ENV, "native")
    torch.manual_seed(0)
    model = sz.lenet(split_index=1).eval().cuda()
    latent = model.left(torch.rand(1, 1, 28, 28, device="cuda")).detach()[0]
    stream = NoiseStream(0, torch.device("cuda"))
    assert stream._philox is noisy_latents_cuda and stream.source == "philox4x32-10"
    engine = SamplingEngine(model.right, model.num_classes, 0.5, torch.device("cuda"), "float32", compile=False)
    counts = torch.zeros(model.num_classes, dtype=torch.int64, device="cuda")
    engine.run([SamplingJob(latent, stream, 1000, counts)], 256)
    assert int(counts.sum()) == 1000 and stream.offset == 1000
