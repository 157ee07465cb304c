"""Noise draws (``noisy_latents_triton``) and vote counts (``count_votes_triton``): Triton and native kernels against their PyTorch
references. Every noise test runs on each implementation (the Triton kernel, the native C++ kernel, the reference).

Without CUDA the kernels run on CPU tensors under Triton's interpreter, which must be switched on before anything
wraps a Triton kernel: this file sets ``TRITON_INTERPRET=1`` first (a ``tests/conftest.py`` should do it for the
whole suite). Shapes are tiny because the interpreter is slow. The same checks run on CUDA tensors where a GPU exists
(``gpu`` marker), for the Triton kernels and for the CUDA kernels of csrc/noise_votes_cuda.cu (``native-cuda``).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

import pytest  # noqa: E402
from scipy import stats  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from splitz_fast.kernels import noise as noise_module  # noqa: E402  (the fixture `noise` is a backend of it)
from splitz_fast.kernels.native import native_available, native_module  # noqa: E402
from splitz_fast.kernels.native_cuda import cuda_module, cuda_native_available  # noqa: E402
from splitz_fast.kernels.noise import (  # noqa: E402
    noisy_latents_triton,
    noisy_latents_cuda,
    noisy_latents_native,
    noisy_latents_reference,
)
from splitz_fast.kernels.philox_reference import philox_words_reference, stream_normals_reference  # noqa: E402
from splitz_fast.kernels.votes import count_votes_cuda, count_votes_reference, count_votes_triton  # noqa: E402

CUDA = torch.cuda.is_available()
def _latent(shape, device, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device, dtype)


def _noise(draw, latent, num, sigma, seed, offset, **kw):
    """Standardized noise z = (out − latent) / σ of one call of ``draw``, in float64 on the CPU."""
    out = draw(latent, num, sigma, seed, offset, **kw)
    return ((out.double() - latent.double()) / sigma).cpu()


@dataclass(frozen=True)
class NoiseBackend:
    name: str
    fn: object  # noisy_latents_triton, noisy_latents_native, noisy_latents_cuda or noisy_latents_reference
    device: torch.device


NOISE_BACKENDS = [
    pytest.param(("triton", "cpu"), id="triton-interpreter",
                 marks=pytest.mark.skipif(CUDA, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param(("triton", "cuda"), id="triton-cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]),
    pytest.param(("native", "cpu"), id="native-cpu"),
    pytest.param(("native", "cuda"), id="native-cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]),
    pytest.param(("reference", "cpu"), id="reference-cpu"),
]


@pytest.fixture(params=NOISE_BACKENDS)
def noise(request):
    """One implementation of the noise op: every test of the noise section runs on each (fla-style)."""
    name, device = request.param
    if name == "native" and device == "cpu" and not native_available():
        pytest.skip("the native kernels could not be built here (test_native_kernels_build says why)")
    if name == "native" and device == "cuda":
        assert cuda_native_available(), "csrc/noise_votes_cuda.cu did not build on this GPU machine (see the warning)"
        return NoiseBackend("native-cuda", noisy_latents_cuda, torch.device(device))
    fn = {"triton": noisy_latents_triton, "native": noisy_latents_native, "reference": noisy_latents_reference}[name]
    return NoiseBackend(name, fn, torch.device(device))


# ------------------------------------------------------------------------------------------------------ noise draws
@pytest.mark.parametrize("shape,num,channels_last", [
    ((3, 5, 7), 3, False), ((3, 5, 7), 3, True), ((13,), 7, False), ((1,), 5, False), ((2, 1, 3), 1, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_poisoned_output_is_fully_written(noise, shape, num, channels_last, dtype):
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent(shape, device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full((num, *shape), math.nan, dtype=dtype, device=device).contiguous(memory_format=fmt)
    result = noisy_latents_triton(latent, num, 0.5, 11, 3, out_dtype=dtype, channels_last=channels_last, out=out)
    assert result is out and result.dtype == dtype and tuple(result.shape) == (num, *shape)
    assert torch.isfinite(result.float()).all()
    fresh = noisy_latents_triton(latent, num, 0.5, 11, 3, out_dtype=dtype, channels_last=channels_last)
    assert torch.equal(result, fresh)


def test_mean_and_std_match_latent_and_sigma(noise):
    noisy_latents_triton, device = noise.fn, noise.device
    num, sigma = 3000, 0.7
    latent = _latent((13,), device) * 3
    out = noisy_latents_triton(latent, num, sigma, 5, 0).double().cpu()
    lat = latent.double().cpu()
    # per coordinate: |mean − latent| within 5 standard errors, std within 5 standard errors of σ
    assert ((out.mean(0) - lat).abs() < 5 * sigma / math.sqrt(num)).all()
    assert ((out.std(0) / sigma - 1).abs() < 5 / math.sqrt(2 * num)).all()
    z = ((out - lat) / sigma).flatten()
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel())
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * z.numel())


def _anderson_darling_standard_normal(z):
    """A² of the sample against N(0, 1) itself (no estimated parameters; stable across SciPy versions)."""
    x = np.sort(z)
    n = x.size
    i = np.arange(1, n + 1)
    return float(-n - np.mean((2 * i - 1) * (stats.norm.logcdf(x) + stats.norm.logsf(x[::-1]))))


def test_noise_is_standard_normal(noise):
    noisy_latents_triton, device = noise.fn, noise.device
    z = _noise(noisy_latents_triton, _latent((3, 5, 7), device), 300, 0.25, 2024, 0).flatten().numpy()  # 31,500 draws
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert _anderson_darling_standard_normal(z) < 3.857  # the 1 % level for a fully specified null
    # tails: P(|z| > 2.5) = 1.24 %, P(|z| > 3.5) = 0.047 %
    for t in (2.5, 3.5):
        p = 2 * stats.norm.sf(t)
        frac = float((abs(z) > t).mean())
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / z.size), (t, frac, p)


def test_samples_and_coordinates_are_uncorrelated(noise):
    noisy_latents_triton, device = noise.fn, noise.device
    d = num = 200
    z = _noise(noisy_latents_triton, _latent((d,), device), num, 1.0, 99, 0)
    for matrix in (z, z.T):  # between samples, and between coordinates
        corr = torch.corrcoef(matrix)
        off = corr[~torch.eye(corr.shape[0], dtype=torch.bool)]
        assert abs(float(off.mean())) < 5 / math.sqrt(d * (d - 1) / 2) / math.sqrt(d)
        assert abs(float(off.pow(2).mean() * (d - 1)) - 1) < 0.1  # E r² ≈ 1/(d−1) under independence
    flat = z.flatten()  # neighbouring Philox counters
    lag1 = float(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1])
    assert abs(lag1) < 5 / math.sqrt(flat.numel())


def test_consecutive_calls_of_one_seed_are_independent(noise):
    """Selection draws (offset 0) and estimation draws (offset advanced by num) of one seed share nothing."""
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent((64,), device)
    first = _noise(noisy_latents_triton, latent, 100, 1.0, 7, 0).flatten()
    second = _noise(noisy_latents_triton, latent, 100, 1.0, 7, 100).flatten()
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 5 / math.sqrt(first.numel())


def test_seeds_and_offsets_select_distinct_streams(noise):
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent((16,), device)
    ref = noisy_latents_triton(latent, 4, 0.5, 123, 0)
    assert torch.equal(ref, noisy_latents_triton(latent, 4, 0.5, 123, 0))  # same (seed, offset): bitwise the same
    others = {
        "seed + 1": noisy_latents_triton(latent, 4, 0.5, 124, 0),
        "seed + 2**32 (high key word)": noisy_latents_triton(latent, 4, 0.5, 123 + 2**32, 0),
        "offset 4 (next samples)": noisy_latents_triton(latent, 4, 0.5, 123, 4),
        "Philox counter 2**32 (high counter word)": noisy_latents_triton(latent, 4, 0.5, 123, 2**33 // 16),
    }
    for name, other in others.items():
        assert not (ref == other).any(), name
    top = noisy_latents_triton(latent, 2, 0.5, 2**64 - 1, 2**64 // 16 - 2)  # largest key, last counters of the stream
    assert torch.isfinite(top).all()


def test_draws_do_not_depend_on_batching_or_layout(noise, monkeypatch):
    """Sample k of a seed is a function of (seed, k) only: any batching, launch chunking or layout gives it back."""
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent((3, 5, 7), device)
    whole = noisy_latents_triton(latent, 7, 0.5, 31, 2)
    parts = [noisy_latents_triton(latent, 1, 0.5, 31, 2), noisy_latents_triton(latent, 4, 0.5, 31, 3),
             noisy_latents_triton(latent, 2, 0.5, 31, 7)]
    assert torch.equal(whole, torch.cat(parts))
    channels_last = noisy_latents_triton(latent, 7, 0.5, 31, 2, channels_last=True)
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert not channels_last.is_contiguous()
    assert torch.equal(whole, channels_last)
    odd = _latent((3, 5, 5), device)  # odd H W and odd D: pairs straddle samples and channels
    assert torch.equal(noisy_latents_triton(odd, 5, 0.5, 31, 1), torch.cat([noisy_latents_triton(odd, 2, 0.5, 31, 1),
                                                                    noisy_latents_triton(odd, 3, 0.5, 31, 3)]))
    assert torch.equal(noisy_latents_triton(odd, 5, 0.5, 31, 1), noisy_latents_triton(odd, 5, 0.5, 31, 1, channels_last=True))
    even = _latent((4, 6, 6), device)  # even D and H W: pairs never straddle a sample or a channel
    even_whole = noisy_latents_triton(even, 7, 0.5, 31, 2)
    assert torch.equal(even_whole, torch.cat([noisy_latents_triton(even, 3, 0.5, 31, 2),
                                              noisy_latents_triton(even, 4, 0.5, 31, 5)]))
    assert torch.equal(even_whole, noisy_latents_triton(even, 7, 0.5, 31, 2, channels_last=True))
    if noise.name.startswith("triton"):
        monkeypatch.setattr(noise_module, "_MAX_GRID_Y", 2)  # several launches of 2 samples
        assert torch.equal(whole, noisy_latents_triton(latent, 7, 0.5, 31, 2))
        assert torch.equal(whole, noisy_latents_triton(latent, 7, 0.5, 31, 2, channels_last=True))
        assert torch.equal(even_whole, noisy_latents_triton(even, 7, 0.5, 31, 2, channels_last=True))


@pytest.mark.skipif(CUDA, reason="CPU tensors need TRITON_INTERPRET=1")
def test_triton_draws_whole_pairs_with_one_philox_call_each(monkeypatch):
    """The pair kernel serves every latent whose pairs are whole (D even; H W even for channels_last), the one-element
    kernel the rest."""
    kernels = noise_module._kernels()

    class Counting:
        def __init__(self, kernel):
            self.kernel, self.launches = kernel, 0

        def __getitem__(self, grid):
            self.launches += 1
            return self.kernel[grid]

    pairs, single = Counting(kernels.noise_pairs), Counting(kernels.noise)
    monkeypatch.setattr(noise_module, "_kernels", lambda: kernels._replace(noise_pairs=pairs, noise=single))
    for shape, channels_last, paired in [((4, 6, 6), True, True), ((4, 6, 6), False, True), ((10,), False, True),
                                         ((2, 3, 4), True, True), ((2, 3, 3), True, False), ((2, 3, 3), False, True),
                                         ((3, 5, 7), True, False), ((9,), False, False)]:
        before = pairs.launches, single.launches
        noisy_latents_triton(_latent(shape, "cpu"), 3, 0.5, 1, 0, channels_last=channels_last)
        assert (pairs.launches - before[0], single.launches - before[1]) == ((1, 0) if paired else (0, 1)), shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_low_precision_output_is_the_float32_sum_cast_afterwards(noise, dtype, channels_last):
    """The noise and the sum are float32; the cast to bf16/fp16 is the only rounding (round to nearest even)."""
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent((4, 6, 5), device) * 50  # large values so that the cast rounds most elements
    for latent_dtype in (torch.float32, dtype):
        lat = latent.to(latent_dtype)
        full = noisy_latents_triton(lat, 9, 0.3, 77, 10, channels_last=channels_last)
        low = noisy_latents_triton(lat, 9, 0.3, 77, 10, out_dtype=dtype, channels_last=channels_last)
        assert low.dtype == dtype
        assert torch.equal(low, full.to(dtype))
        # the float32 output itself is latent + σ z formed in float32, not in the low-precision type
        assert not torch.equal(full, full.to(dtype).float())


def test_noise_input_validation(noise):
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent((3, 4), device)
    with pytest.raises(ValueError, match="sigma"):
        noisy_latents_triton(latent, 2, 0.0, 1, 0)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="sigma"):
            noisy_latents_triton(latent, 2, bad, 1, 0)
    with pytest.raises(ValueError, match="num"):
        noisy_latents_triton(latent, 0, 1.0, 1, 0)
    with pytest.raises(TypeError, match="num"):
        noisy_latents_triton(latent, 2.0, 1.0, 1, 0)
    for seed in (-1, 2**64, True, 1.0):
        with pytest.raises(ValueError, match="seed"):
            noisy_latents_triton(latent, 2, 1.0, seed, 0)
    for offset in (-1, 0.5):
        with pytest.raises(ValueError, match="offset"):
            noisy_latents_triton(latent, 2, 1.0, 1, offset)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        noisy_latents_triton(latent, 2, 1.0, 1, 2**64 // 12 - 1)
    with pytest.raises(TypeError, match="floating-point"):
        noisy_latents_triton(torch.ones(3, dtype=torch.int64, device=device), 2, 1.0, 1, 0)
    with pytest.raises(ValueError, match="out_dtype"):
        noisy_latents_triton(latent, 2, 1.0, 1, 0, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="channels_last"):
        noisy_latents_triton(latent, 2, 1.0, 1, 0, channels_last=True)
    with pytest.raises(ValueError, match="out must be"):
        noisy_latents_triton(latent, 2, 1.0, 1, 0, out=torch.empty(3, 3, 4, device=device))
    with pytest.raises(ValueError, match="out must be"):
        noisy_latents_triton(latent, 2, 1.0, 1, 0, out=torch.empty(2, 3, 4, device=device, dtype=torch.float16))


@pytest.mark.parametrize("shape,channels_last", [((3, 5, 7), False), ((3, 5, 7), True), ((4, 6, 6), True), ((9,), False),
                                                 ((16, 4, 6), True), ((1, 6, 6), True), ((4, 6, 6), False),
                                                 ((10,), False), ((2, 3, 4), True), ((2, 3, 3), False)])
@pytest.mark.parametrize("offset", [0, 3, 2**40 + 1, 2**64 // 400 - 9])  # the last: near the stream's end
def test_every_backend_draws_the_reference_stream(noise, shape, channels_last, offset):
    """Element j of sample k is z_t, t = (offset + k) D + j, of the documented stream (stream_normals_reference):
    equal up to the float32 rounding of ln / cos / sin (|Δz| <= 2e-6 (1 + |z|)), in either layout, for even and odd D
    and at offsets whose Philox counters use the high counter word. The channels_last shapes cover the native
    kernel's three store paths: pair rows (C >= 16, H W even), permuted (few channels or H W odd), and C = 1; the
    Triton kernel's pair form (D even, and H W even for channels_last) and its one-element form (the rest, e.g.
    (2, 3, 3) with D even but H W odd)."""
    noisy_latents_triton, device = noise.fn, noise.device
    latent = _latent(shape, device)
    num = 9
    numel = latent.numel()
    z = ((noisy_latents_triton(latent, num, 1.0, SEED_HIGH, offset, channels_last=channels_last).double()
          - latent.double()).cpu())
    want = stream_normals_reference(SEED_HIGH, offset * numel, num * numel).double().view(num, *shape)
    assert torch.all((z - want).abs() <= 2e-6 * (1 + want.abs())), float((z - want).abs().max())


SEED_HIGH = 2**64 - 2**32 + 12345  # both key words non-zero


def test_philox_words_match_random123_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (counter, key -> output): the reference implementation is
    Philox itself, not merely self-consistent. Only counters (c0, c1, 0, 0) are reachable here, so the vectors are
    recomputed for that form from the reference and checked against the native kernel and Triton."""
    counters = torch.tensor([0, 1, 2**32, 2**63 - 1, -1, -2**63], dtype=torch.int64)
    for seed in (0, 1, 2**32, 2**64 - 1, SEED_HIGH):
        ref = torch.stack(philox_words_reference(counters, seed), 1)
        assert ((ref >= 0) & (ref < 2**32)).all()
        if native_available():
            assert torch.equal(native_module().philox_words(counters, seed), ref)
        if CUDA:  # the device branch of philox.h (__umulhi), csrc/noise_votes_cuda.cu
            assert torch.equal(cuda_module().philox_words(counters.cuda(), seed).cpu(), ref)
    # Random123's published answer for Philox4x32-10, counter = key = 0: out = 6627e8d5 e169c58d bc57ac4c 9b00dbd8
    w0, w1, w2 = philox_words_reference(torch.zeros(1, dtype=torch.int64), 0)
    assert (int(w0), int(w1), int(w2)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C)


def test_stream_reference_is_two_box_muller_normals_per_philox_call():
    """z_2i, z_2i+1 = r cos θ, r sin θ of one call: so z_2i² + z_2i+1² = −2 ln u1 of that call, and an odd start
    begins with the sine of its pair."""
    z = stream_normals_reference(5, 10, 8).double()
    w0, w1, _ = philox_words_reference(torch.arange(5, 9), 5)
    u1 = (w0.double() + (w1.double() + 0.5) / 2**32) / 2**32
    assert torch.allclose(z[0::2] ** 2 + z[1::2] ** 2, -2 * torch.log(u1), rtol=1e-5)
    assert torch.equal(stream_normals_reference(5, 11, 3), z[1:4].float())


def test_reference_path_output_contract():
    latent = _latent((2, 3, 5), "cpu", dtype=torch.float16)
    out = noisy_latents_reference(latent, 6, 0.5, 3, 4, torch.bfloat16, channels_last=True)
    assert out.shape == (6, 2, 3, 5) and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last)
    z = stream_normals_reference(3, 4 * 30, 6 * 30).view(6, 2, 3, 5)
    assert torch.equal(out, (latent.float() + 0.5 * z).to(torch.bfloat16))
    with pytest.raises(ValueError, match="sigma"):
        noisy_latents_reference(latent, 6, -0.5, 3, 0)


# ------------------------------------------------------------------------------------- noise through a 2x2 max pool
# The fused draw of noise and f_R's leading max pool: Triton (interpreter or CUDA) and the native CPU kernel, each the
# same numbers as its own unfused draw followed by F.max_pool2d (bitwise: max is exact and commutes with the cast).
POOLED_BACKENDS = [param for param in NOISE_BACKENDS if param.id in ("triton-interpreter", "triton-cuda", "native-cpu")]


@pytest.fixture(params=POOLED_BACKENDS)
def pooled(request):
    """``(fused draw, unfused draw of the same backend, device)``."""
    name, device = request.param
    if name == "native":
        if not native_available():
            pytest.skip("the native kernels could not be built here (test_native_kernels_build says why)")
        return noise_module.noisy_latents_maxpool2_native, noisy_latents_native, torch.device(device)
    return noise_module.noisy_latents_maxpool2_triton, noisy_latents_triton, torch.device(device)


@pytest.mark.parametrize("shape,num,seed,offset", [((3, 6, 4), 5, 2**40 + 3, 11), ((1, 2, 2), 3, 0, 0),
                                                   ((2, 8, 10), 4, 2**64 - 1, 2**20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pooled_draw_is_the_unfused_draw_max_pooled(pooled, shape, num, seed, offset, dtype):
    fused, unfused, device = pooled
    latent = _latent(shape, device, seed=num)
    out = torch.full((num, shape[0], shape[1] // 2, shape[2] // 2), float("nan"), dtype=dtype,
                     device=device).contiguous(memory_format=torch.channels_last)  # poisoned: every entry written
    got = fused(latent, num, 0.5, seed, offset, dtype, out=out)
    assert got is out and got.is_contiguous(memory_format=torch.channels_last)
    expected = torch.nn.functional.max_pool2d(unfused(latent, num, 0.5, seed, offset, dtype, channels_last=True), 2)
    assert torch.equal(got, expected)


def test_pooled_draw_does_not_depend_on_batching_and_propagates_nan(pooled):
    fused, _, device = pooled
    latent = _latent((2, 4, 6), device, seed=3)
    whole = fused(latent, 7, 0.25, 5, 3)
    assert torch.equal(whole, torch.cat([fused(latent, 3, 0.25, 5, 3), fused(latent, 4, 0.25, 5, 6)]))
    latent[1, 2, 5] = float("nan")  # window (1, 1, 2) of every sample, and no other
    poisoned = fused(latent, 2, 0.25, 5, 3)
    nan = poisoned.isnan()
    assert nan[:, 1, 1, 2].all() and int(nan.sum()) == 2


def test_pooled_draw_input_validation(pooled):
    fused, _, device = pooled
    with pytest.raises(ValueError, match="H and W even"):
        fused(_latent((2, 3, 4), device), 2, 0.5, 0, 0)
    with pytest.raises(ValueError, match="C, H, W"):
        fused(_latent((12,), device), 2, 0.5, 0, 0)
    with pytest.raises(ValueError, match="out must be a dense channels_last tensor"):
        fused(_latent((2, 4, 4), device), 2, 0.5, 0, 0, out=torch.empty(2, 2, 2, 2, device=device))
    with pytest.raises(ValueError, match="sigma"):
        fused(_latent((2, 4, 4), device), 2, 0.0, 0, 0)


def test_fused_pool_dispatch_follows_the_gpu_measurement(monkeypatch):
    """On CUDA ``auto`` fuses the noise and f_R's leading pool with the Triton kernel (measured faster on an H100);
    forcing Triton selects it too; on the CPU the native kernel fuses where it is built."""
    from splitz_fast.sampling.engine import pooled_noise_kernel

    cuda = torch.device("cuda")
    monkeypatch.setenv("SPLITZ_BACKEND", "auto")
    assert pooled_noise_kernel(cuda) is noise_module.noisy_latents_maxpool2_triton
    if native_available():
        assert pooled_noise_kernel(torch.device("cpu")) is noise_module.noisy_latents_maxpool2_native
    monkeypatch.setenv("SPLITZ_BACKEND", "triton")
    assert pooled_noise_kernel(cuda) is noise_module.noisy_latents_maxpool2_triton
    monkeypatch.setenv("SPLITZ_BACKEND", "reference")  # the torch generator's stream: no fused kernel draws it
    assert pooled_noise_kernel(cuda) is None and pooled_noise_kernel(torch.device("cpu")) is None


@pytest.mark.skipif(CUDA, reason="runs the Triton interpreter on CPU tensors")
def test_engine_samples_through_the_triton_pooled_draw_like_the_native_one(monkeypatch):
    """A split-1 LeNet-like model whose f_R starts with the 2x2 pool: CERTIFY with the Triton fused draw (forced, in
    the interpreter) gives exactly the counts and radius of the native fused draw (the same Philox samples)."""
    import torch.nn as nn

    import splitz_fast as sz

    if not native_available():
        pytest.skip("the native kernels could not be built here")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 3))
    model = sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 8, 8), threshold=1.0)
    x = torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(4))
    results = {}
    for backend in ("auto", "triton"):
        monkeypatch.setenv("SPLITZ_BACKEND", backend)
        smoother = sz.Smoother(model, 0.5, bound_options=sz.BoundOptions(bound_method="exact"))
        assert smoother.engine().pools_in_noise(torch.Size((4, 8, 8)))
        results[backend] = smoother.certify(x, 10, 200, 0.01, batch_size=64, seed=9)
    assert (results["auto"].count_a, results["auto"].prediction) == (results["triton"].count_a,
                                                                      results["triton"].prediction)
    assert results["auto"].radius == results["triton"].radius


# ------------------------------------------------------------------------------------------------------ vote counts
# The vote kernels: Triton (interpreter or CUDA) and the CUDA kernel of csrc/ (no CPU one; the reference is the oracle).
VOTE_BACKENDS = [param for param in NOISE_BACKENDS if param.id in ("triton-interpreter", "triton-cuda", "native-cuda")]


@dataclass(frozen=True)
class VoteBackend:
    name: str
    fn: object  # count_votes_triton (Triton) or count_votes_cuda
    device: torch.device


@pytest.fixture(params=VOTE_BACKENDS)
def votes(request):
    """One kernel of the vote count: every test of the vote section runs on each (the reference is the oracle)."""
    name, device = request.param
    if name == "native":
        assert cuda_native_available(), "csrc/noise_votes_cuda.cu did not build on this GPU machine (see the warning)"
        return VoteBackend("native-cuda", count_votes_cuda, torch.device(device))
    return VoteBackend(name, count_votes_triton, torch.device(device))


def _logits_with_ties(rows, classes, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (rows, classes), generator=gen).float()  # few levels: many tied maxima
    logits[: rows // 3] = torch.randn(rows // 3, classes, generator=gen)  # and some rows without ties
    if rows > 2:
        logits[1] = 0.0  # a whole row tied: class 0
        logits[2, -1] = logits[2].max() + 1  # maximum at the last class
    return logits.to(device, dtype)


@pytest.mark.parametrize("classes,rows", [(3, 37), (10, 130), (10, 1), (1000, 21), (5000, 9), (1, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("count_dtype", [torch.int64, torch.int32])
def test_count_votes_matches_argmax_bincount(votes, classes, rows, dtype, count_dtype):
    count_votes_triton, device = votes.fn, votes.device
    logits = _logits_with_ties(rows, classes, device, dtype, seed=classes + rows)
    counts = torch.zeros(classes, dtype=count_dtype, device=device)
    assert count_votes_triton(logits, counts) is counts
    expected = torch.bincount(logits.argmax(dim=1), minlength=classes).to(count_dtype)
    assert torch.equal(counts, expected)
    assert torch.equal(count_votes_reference(logits, torch.zeros_like(counts)), expected)
    assert int(counts.sum()) == rows


@pytest.mark.parametrize("classes", [1000, 5000])
def test_ties_across_column_chunks_go_to_the_lowest_index(votes, classes):
    count_votes_triton, device = votes.fn, votes.device
    logits = torch.zeros(6, classes, device=device)
    pairs = [(100, 700), (511, 512), (0, classes - 1), (513, classes - 3), (2, 3), (classes - 2, classes - 1)]
    for row, (a, b) in enumerate(pairs):
        logits[row, a] = logits[row, b] = 5.0
    counts = count_votes_triton(logits, torch.zeros(classes, dtype=torch.int64, device=device))
    expected = torch.zeros(classes, dtype=torch.int64)
    for a, _ in pairs:
        expected[a] += 1
    assert torch.equal(counts.cpu(), expected)


@pytest.mark.parametrize("classes", [7, 1000])
def test_nan_and_infinite_scores_follow_torch_argmax(votes, classes):
    count_votes_triton, device = votes.fn, votes.device
    inf, nan = math.inf, math.nan
    logits = torch.randn(6, classes)
    logits[0] = -inf  # all -inf -> class 0
    logits[1, 3] = nan  # a NaN beats everything
    logits[2, 5], logits[2, 1] = nan, nan  # the first NaN wins
    logits[3, 2], logits[3, 4] = inf, inf  # tied +inf -> the lower index
    logits[4] = -inf
    logits[4, classes - 1] = nan
    logits[5, 6] = inf
    logits[5, 0] = nan
    counts = count_votes_triton(logits.to(device), torch.zeros(classes, dtype=torch.int64, device=device))
    expected = torch.bincount(logits.argmax(dim=1), minlength=classes)  # CPU torch.argmax is the oracle
    assert torch.equal(counts.cpu(), expected)
    assert int(counts.sum()) == 6


def test_count_votes_accumulates_across_calls(votes):
    count_votes_triton, device = votes.fn, votes.device
    counts = torch.tensor([5, 0, 2, 0, 1, 0, 0, 0, 0, 3], dtype=torch.int64, device=device)
    expected = counts.clone()
    for seed in range(3):
        logits = _logits_with_ties(40, 10, device, torch.float32, seed)
        count_votes_triton(logits, counts)
        count_votes_reference(logits, expected)
    assert torch.equal(counts, expected)
    assert int(counts.sum()) == 11 + 120
    unanimous = torch.zeros(300, 10, device=device)
    unanimous[:, 3] = 1.0  # every row votes for class 3: contended atomics on one bin
    before = int(counts[3])
    count_votes_triton(unanimous, counts)
    assert int(counts[3]) == before + 300 and int(counts.sum()) == 131 + 300


def test_count_votes_on_strided_logits(votes):
    count_votes_triton, device = votes.fn, votes.device
    base = torch.randn(24, 30, device=device)
    for logits in (base.T, base[::3, 1:20:2], base[:, :7]):
        counts = count_votes_triton(logits, torch.zeros(logits.shape[1], dtype=torch.int64, device=device))
        assert torch.equal(counts, torch.bincount(logits.argmax(1), minlength=logits.shape[1]))


def test_count_votes_validation(votes):
    count_votes_triton, device = votes.fn, votes.device
    logits = torch.randn(4, 10, device=device)
    empty = torch.zeros(0, 10, device=device)
    counts = torch.zeros(10, dtype=torch.int64, device=device)
    assert torch.equal(count_votes_triton(empty, counts), torch.zeros_like(counts))
    assert torch.equal(count_votes_reference(empty, counts), torch.zeros_like(counts))
    for fn in (count_votes_triton, count_votes_reference):
        with pytest.raises(ValueError, match="bins"):
            fn(logits, torch.zeros(9, dtype=torch.int64, device=device))
        with pytest.raises(ValueError, match="int64 or int32"):
            fn(logits, torch.zeros(10, device=device))
        with pytest.raises(ValueError, match="logits"):
            fn(logits[0], counts)
        with pytest.raises(ValueError, match="logits"):
            fn(torch.ones(4, 10, dtype=torch.int64, device=device), counts)
        with pytest.raises(ValueError, match="contiguous"):
            fn(logits, torch.zeros(20, dtype=torch.int64, device=device)[::2])
        with pytest.raises(TypeError):
            fn(logits.tolist(), counts)


def test_batch_dependent_arguments_are_never_specialised_on():
    """The sampling kernels' sample or row count (shorter in a window's last batch) and the noise stream's values are
    named to Triton as not to be specialised on, and every name is a parameter of each kernel that uses it (a
    misspelt name would be ignored; Triton would then compile a variant per batch remainder inside a timed run)."""
    import inspect

    from splitz_fast.kernels import conv_relu_pool, votes

    cases = ((noise_module, ("_noisy_latents_kernel", "_noisy_latent_pairs_kernel", "_noisy_maxpool2_kernel"), "num"),
             (votes, ("_count_votes_kernel",), "rows"))
    for module, names, batch_arg in cases:
        assert batch_arg in module.UNSPECIALIZED_ARGS
        for name in names:
            assert set(module.UNSPECIALIZED_ARGS) <= set(inspect.signature(getattr(module, name)).parameters), name
    assert conv_relu_pool.UNSPECIALIZED_ARGS == ("rows",)
    conv_relu_pool._kernel()  # builds it: the kernel function is a closure, its parameters checked through Triton
    kernel = conv_relu_pool._kernel()
    parameters = getattr(kernel, "arg_names", None) or list(inspect.signature(kernel.fn).parameters)
    assert "rows" in parameters
