"""Noise draws of the sampling engine (SPEC §2 soundness, §5 speed): ``noisy_latents_triton``, a Triton kernel with
its launcher, beside the pure-PyTorch reference ``noisy_latents_reference`` (the test oracle and the fallback path),
and ``noisy_latents_native``, the launcher of the C++ kernel of ``csrc/noise_cpu.cpp`` (the CPU path), and
``noisy_latents_cuda``, the launcher of the CUDA kernel of ``csrc/noise_votes_cuda.cu`` (``SPLITZ_BACKEND=native`` on
CUDA tensors; ``auto`` uses the Triton kernel there until measured otherwise); and ``noisy_latents_maxpool2_*``, the
same draw through a 2x2 max pool in one pass (Triton, native C++, reference). The vote counts of the same engine are
:mod:`splitz_fast.kernels.votes`; the PyTorch Philox stream that the references and tests draw from is
:mod:`splitz_fast.kernels.philox_reference`.

``noisy_latents_triton(latent, num, σ, seed, offset) -> [num, *latent.shape]``
    ``latent + σ z`` with ``z ~ N(0, I)`` drawn **in float32** from a counter-based Philox4x32-10 stream
    (``tl.randint4x``) and the sum formed in float32; only then is the result cast to ``out_dtype`` (float32,
    bfloat16 or float16) on store. That cast is part of the base classifier ``f_R`` and keeps the smoothing guarantee
    (Voráček & Hein 2023); noise drawn or added in low precision would not. The latent is broadcast over the sample
    dimension inside the kernel (no ``latent.repeat``), and 4-D outputs can be written directly in channels_last.

The Philox stream (the contract that makes selection and estimation draws independent; csrc/philox.h has the same)
--------------------------------------------------------------------------------------------------------------------
The noise of one seed is a sequence of N(0, 1) numbers ``z_t``, ``t = 0, 1, 2, ...``. Element ``j`` (row-major index
into ``latent``, ``0 <= j < D = latent.numel()``) of sample ``k`` (``0 <= k < num``) of a call is ``z_t`` with
``t = (offset + k) * D + j``, and nothing else uses it. The pair ``(z_2i, z_2i+1)`` is one Box–Muller transform of
one Philox4x32-10 call at counter ``i`` (``tl.randint4x``: counter words ``(lo32(i), hi32(i), 0, 0)``, key
``(lo32(seed), hi32(seed))``): with its words ``w0, w1, w2``,

    u1 = w0 2^-32 + (w1 + 1/2) 2^-64 in (0, 1],   u2 = w2 2^-32 - 1/2 in [-1/2, 1/2),
    z_2i = sqrt(-2 ln u1) cos(2π u2),   z_2i+1 = sqrt(-2 ln u1) sin(2π u2),

two independent standard normals. ``u1`` has **64** random bits, so ``|z|`` reaches 9.4 instead of the 5.7 that
``tl.randn`` allows (it clamps ``u1 >= 1e-7``; a latent of 8·10⁵ coordinates would then miss ``|z| > 5.7`` in about
1 % of the samples). Samples drawn under one seed are independent as long as the **caller** never reuses a sample
index ``offset + k``: start a seed at ``offset = 0`` and advance ``offset += num`` after every call (selection draws
``[0, n0)``, estimation draws ``[n0, n0 + n)``, and so on). Consequences:

* the draws are a pure function of ``(latent, σ, seed, sample index)``: splitting ``num`` samples into batches of any
  size gives bitwise the same samples (tested), and so do channels_last and contiguous outputs;
* every backend draws the same stream: the Philox words are bit-identical (Triton, the native CPU and CUDA
  kernels of ``csrc/``, and the PyTorch reference of :mod:`splitz_fast.kernels.philox_reference`), the normals agree
  up to the rounding of ln, cos and sin (float32 ulps);
* ``(offset + num) * D`` must stay at most ``2**64`` (checked).

The Triton kernel computes each Philox call once, for both normals of its pair, where the pairs are whole: ``D`` even
and, for channels_last outputs, an even ``H·W`` (then ``z_2i`` and ``z_2i+1`` are neighbouring pixels of one channel,
one pixel apart in storage, and each of the two stores of a tile is contiguous). Elsewhere (odd sizes, where a pair
may straddle two samples) it computes one element per lane and so runs each Philox call twice. The Philox rounds and
the Box–Muller transcendentals, not memory, bound the one-element form on a GPU (measured on an H100: LeNet's split-1
noise at about a sixth of the card's bandwidth). The CPU kernel runs it once per pair.

Where the kernels run: CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before the first launch (the
kernels are jitted lazily at their first launch, so importing this module never imports Triton and never fails
where Triton is missing). Only Triton features present in Triton 3.6 are used.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from splitz_fast._checks import check_count, check_positive

from ._utils import check_launch_device
from .philox_reference import stream_normals_reference

OPS = ("noisy_latents", "noisy_latents_maxpool2")  # op names for splitz_fast.kernels.TRITON_OPS
NOISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_U64 = 2**64
_MAX_GRID_Y = 65535

tl = None  # triton.language, bound by _kernels() at the first launch (the jitted functions resolve it as a global)


# ---------------------------------------------------------------------------------------------------- Triton kernels
# Plain functions here, wrapped by triton.jit in _kernels(): Triton decides between the compiler and the interpreter
# (TRITON_INTERPRET) when a function is wrapped, so wrapping happens at the first launch, not at import.

def _philox_normals(seed, pair):
    """``(z_2i, z_2i+1)``: both normals of the Philox call at counter ``pair = i`` (the module docstring's stream)."""
    w0, w1, w2, _ = tl.randint4x(seed, pair)
    # u1 in (0, 1] from 64 bits: (w0 + (w1 + 1/2) 2^-32) 2^-32; u2 in [-1/2, 1/2) from 32 bits.
    u1 = w0.to(tl.float32) * 2.3283064365386963e-10 + (w1.to(tl.float32) + 0.5) * 5.421010862427522e-20
    u1 = tl.minimum(u1, 1.0)
    u2 = w2.to(tl.float32) * 2.3283064365386963e-10 - 0.5
    # max(., 0): an approximate log may return a tiny positive value just below u1 = 1 (sqrt would give NaN)
    radius = tl.sqrt(tl.maximum(-2.0 * tl.log(u1), 0.0))
    angle = 6.283185307179586 * u2
    return radius * tl.cos(angle), radius * tl.sin(angle)


def _store_sample(ptrs, value, mask, BF16: tl.constexpr):
    """Store the float32 ``value`` at ``ptrs`` in their dtype: the only rounding to a narrower type."""
    if BF16:
        # float32 -> bfloat16, round to nearest even on the bit pattern (torch's rule; NaN -> canonical NaN). Spelt
        # out because Triton's interpreter truncates this cast, while compiled Triton rounds to nearest even.
        bits = value.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        rounded = tl.where(value != value, 0x7FC0, rounded).to(tl.uint16)
        tl.store(ptrs, rounded.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


def _stream_base(seed_lo, seed_hi, base_lo, base_hi):
    """The Philox key and the launch's first stream index, from their signed 32-bit halves."""
    seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    base = (base_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | base_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    return seed, base


def _noisy_latents_kernel(
    latent_ptr, out_ptr, num, numel, channels, spatial, sigma,
    seed_lo, seed_hi, base_lo, base_hi,
    CHANNELS_LAST: tl.constexpr, BF16: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """A ``[BLOCK_S samples, BLOCK_E storage positions]`` tile of the output ``[num, numel]`` (per-sample storage
    order). For channels_last outputs ``channels = C`` and ``spatial = H * W`` of the latent ``[C, H, W]``. Seed and
    the stream index of the launch's first element arrive as signed 32-bit halves so that one compiled variant serves
    every value."""
    q = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # storage position within a sample (int32)
    k = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # sample index within the launch
    emask = q < numel
    mask = (k < num)[:, None] & emask[None, :]
    if CHANNELS_LAST:  # storage order (H, W, C) -> logical row-major index over (C, H, W)
        j = (q % channels) * spatial + q // channels
    else:
        j = q
    seed, base = _stream_base(seed_lo, seed_hi, base_lo, base_hi)
    row = k.to(tl.int64)[:, None] * numel
    t = base + (row + j.to(tl.int64)[None, :]).to(tl.uint64)  # stream index (offset + k) * numel + j
    even, odd = _philox_normals(seed, t >> 1)  # one Philox call per pair (z_2i, z_2i+1)
    z = tl.where((t & 1) == 1, odd, even)
    lat = tl.load(latent_ptr + j, mask=emask, other=0.0).to(tl.float32)[None, :]
    value = lat + sigma * z  # float32; the store's cast is the only rounding to a narrower type
    _store_sample(out_ptr + (row + q[None, :]), value, mask, BF16)


def _noisy_latent_pairs_kernel(
    latent_ptr, out_ptr, num, numel, channels, spatial, sigma,
    seed_lo, seed_hi, base_lo, base_hi,
    CHANNELS_LAST: tl.constexpr, BF16: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """:func:`_noisy_latents_kernel`'s output from one Philox call per pair: a ``[BLOCK_S samples, BLOCK_P pairs]``
    tile, pair ``m`` of a sample holding its logical elements ``j0 = 2m'`` and ``j0 + 1`` (both normals of the call at
    counter ``t0 / 2``). Needs ``numel`` even (then ``t0`` is even: the launch's first index is a multiple of it) and,
    for channels_last, an even ``spatial = H·W``: pair ``m`` is then the pixels ``2⌊m/C⌋`` and ``2⌊m/C⌋ + 1`` of
    channel ``m mod C``, at storage positions ``q0`` and ``q0 + C``. The same values as the one-element kernel, bit
    for bit (the same words, the same float32 operations)."""
    m = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # pair index within a sample (int32)
    k = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # sample index within the launch
    pmask = m < numel // 2
    mask = (k < num)[:, None] & pmask[None, :]
    if CHANNELS_LAST:  # storage (H, W, C): the pair is two horizontally adjacent pixels of channel c
        c = m % channels
        pixel = (m // channels) * 2
        j0 = c * spatial + pixel
        q0 = pixel * channels + c
        q1 = q0 + channels
    else:
        j0 = 2 * m
        q0 = j0
        q1 = j0 + 1
    seed, base = _stream_base(seed_lo, seed_hi, base_lo, base_hi)
    row = k.to(tl.int64)[:, None] * numel
    t0 = base + (row + j0.to(tl.int64)[None, :]).to(tl.uint64)  # even: stream index of the pair's first element
    even, odd = _philox_normals(seed, t0 >> 1)
    lat0 = tl.load(latent_ptr + j0, mask=pmask, other=0.0).to(tl.float32)[None, :]
    lat1 = tl.load(latent_ptr + j0 + 1, mask=pmask, other=0.0).to(tl.float32)[None, :]
    _store_sample(out_ptr + (row + q0[None, :]), lat0 + sigma * even, mask, BF16)
    _store_sample(out_ptr + (row + q1[None, :]), lat1 + sigma * odd, mask, BF16)


def _max_nan(a, b):
    """Elementwise max where a NaN wins, as ``F.max_pool2d``."""
    return tl.where((a > b) | (a != a), a, b)


def _noisy_row_pair_max(latent_ptr, j, emask, t, seed, sigma):
    """``max(latent[j] + σ z_t, latent[j+1] + σ z_t+1)`` for even ``t``: one Philox call gives both normals."""
    left, right = _philox_normals(seed, t >> 1)
    lat_left = tl.load(latent_ptr + j, mask=emask, other=0.0).to(tl.float32)[None, :]
    lat_right = tl.load(latent_ptr + j + 1, mask=emask, other=0.0).to(tl.float32)[None, :]
    return _max_nan(lat_left + sigma * left, lat_right + sigma * right)


def _noisy_maxpool2_kernel(
    latent_ptr, out_ptr, num, pooled, channels, height, width, sigma,
    seed_lo, seed_hi, base_lo, base_hi,
    BF16: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """A ``[BLOCK_S samples, BLOCK_E pooled positions]`` tile of the channels_last output ``[num, C, H/2, W/2]``
    (storage order ``(h, w, c)``). Each output is the max of the 2x2 window of the samples the unfused kernel draws:
    with ``H`` and ``W`` even a window row is the stream pair ``(z_2i, z_2i+1)``, so the window costs two Philox calls
    and the full-size noisy sample is never written."""
    q = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # pooled storage position within a sample (int32)
    k = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # sample index within the launch
    emask = q < pooled
    mask = (k < num)[:, None] & emask[None, :]
    half_width = width // 2
    c = q % channels
    h = (q // channels) // half_width
    w = (q // channels) % half_width
    j = c * (height * width) + (2 * h) * width + 2 * w  # the window's top-left element, row-major over (C, H, W)
    seed, base = _stream_base(seed_lo, seed_hi, base_lo, base_hi)
    row = k.to(tl.int64)[:, None] * (channels * height * width)
    t = base + (row + j.to(tl.int64)[None, :]).to(tl.uint64)  # even: C·H·W, the base and j are
    top = _noisy_row_pair_max(latent_ptr, j, emask, t, seed, sigma)
    bottom = _noisy_row_pair_max(latent_ptr, j + width, emask, t + width, seed, sigma)
    _store_sample(out_ptr + (k.to(tl.int64)[:, None] * pooled + q[None, :]), _max_nan(top, bottom), mask, BF16)


#: The kernels' integer and float arguments never specialised on: the stream's values change every launch, and the
#: sample count with the last, shorter batch of a window; neither may compile a new variant inside a timed run
#: (Triton specialises integers on ``== 1`` and on divisibility by 16).
UNSPECIALIZED_ARGS = ("num", "sigma", "seed_lo", "seed_hi", "base_lo", "base_hi")


class _Kernels(NamedTuple):
    triton: object
    noise: object
    noise_pairs: object
    noise_maxpool2: object


@functools.cache
def _kernels() -> _Kernels:
    """The jitted kernels (built once, at the first launch)."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise RuntimeError("the Triton kernels of splitz_fast.kernels.noise need the `triton` package; use "
                           "noisy_latents_reference (SPLITZ_BACKEND=reference)") from exc
    tl = language
    # The device functions the kernels call, jitted under their own names (the kernels resolve them as globals).
    global _philox_normals, _store_sample, _stream_base, _max_nan, _noisy_row_pair_max
    _philox_normals, _store_sample, _stream_base = map(triton.jit, (_philox_normals, _store_sample, _stream_base))
    _max_nan, _noisy_row_pair_max = triton.jit(_max_nan), triton.jit(_noisy_row_pair_max)
    noise = triton.jit(_noisy_latents_kernel, do_not_specialize=UNSPECIALIZED_ARGS)
    pairs = triton.jit(_noisy_latent_pairs_kernel, do_not_specialize=UNSPECIALIZED_ARGS)
    pooled = triton.jit(_noisy_maxpool2_kernel, do_not_specialize=UNSPECIALIZED_ARGS)
    return _Kernels(triton, noise, pairs, pooled)


def _check_launch_device(name: str, t: torch.Tensor) -> None:
    check_launch_device(name, t, _kernels().noise_maxpool2)  # one kernel stands for all


def _split32(value: int) -> tuple[int, int]:
    """A value in [0, 2**64) as (low, high) 32-bit halves, each reinterpreted as a signed int32."""
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return (lo - 2**32 if lo >= 2**31 else lo), (hi - 2**32 if hi >= 2**31 else hi)


# ------------------------------------------------------------------------------------------------------ noise draws
def _check_noise_args(latent, num, sigma, out_dtype, channels_last) -> float:
    if not isinstance(latent, torch.Tensor):
        raise TypeError(f"latent must be a torch.Tensor, got {type(latent).__name__}")
    if not latent.is_floating_point():
        raise TypeError(f"latent must be a floating-point tensor, got dtype {latent.dtype}")
    if latent.numel() == 0:
        raise ValueError(f"latent must have at least one element, got shape {tuple(latent.shape)}")
    check_count("num", num)
    sigma = check_positive("sigma", sigma)
    if out_dtype not in NOISE_DTYPES:
        raise ValueError(f"out_dtype must be one of {NOISE_DTYPES}, got {out_dtype}")
    if not isinstance(channels_last, bool):
        raise TypeError(f"channels_last must be a bool, got {type(channels_last).__name__}")
    if channels_last and latent.ndim != 3:
        raise ValueError(f"channels_last needs a [C, H, W] latent (4-D output), got shape {tuple(latent.shape)}")
    return sigma


def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def _check_stream_args(latent, num, sigma, seed, offset, out_dtype, channels_last) -> float:
    """The checks shared by every backend of the noise op (Triton, C++, CUDA, reference); returns σ as a float."""
    sigma = _check_noise_args(latent, num, sigma, out_dtype, channels_last)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _U64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an integer >= 0 (the index of the first sample in the stream), got {offset!r}")
    numel = latent.numel()
    if numel >= 2**31:
        raise ValueError(f"latent has {numel} elements; the kernels index one sample with 32-bit integers (< 2**31)")
    if (offset + num) * numel > _U64:
        raise ValueError(f"offset + num = {offset + num} samples of {numel} elements exceed the 2**64 numbers of one "
                         "seed's stream; start a new seed")
    return sigma


def _output(latent, num, out_dtype, channels_last, out) -> torch.Tensor:
    """``out`` checked against the output contract, or a new output tensor."""
    fmt = _memory_format(channels_last)
    shape = (num, *latent.shape)
    if out is None:
        return torch.empty(shape, dtype=out_dtype, device=latent.device, memory_format=fmt)
    if (tuple(out.shape) != shape or out.dtype != out_dtype or out.device != latent.device
            or not out.is_contiguous(memory_format=fmt)):
        raise ValueError(f"out must be a dense {'channels_last' if channels_last else 'contiguous'} tensor of shape "
                         f"{shape}, dtype {out_dtype} on {latent.device}; got {tuple(out.shape)}, {out.dtype} on "
                         f"{out.device}")
    return out


def noisy_latents_triton(
    latent: torch.Tensor,
    num: int,
    sigma: float,
    seed: int,
    offset: int,
    out_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``num`` noisy copies of one latent, ``latent + σ z`` with ``z ~ N(0, I)``, by the Triton kernel.

    Args:
        latent: ``f_L(x)`` of one input, any shape ``S`` (e.g. ``[C, H, W]``), any float dtype (read as float32).
        num: number of samples ``>= 1``.
        sigma: noise level σ, finite ``> 0``, in latent units.
        seed: Philox key, an integer in ``[0, 2**64)``.
        offset: index of the first sample in the seed's stream, ``>= 0``; element ``j`` of sample ``k`` is the stream's
            number ``z_t``, ``t = (offset + k) * D + j`` (``D = latent.numel()``). Advance it by ``num`` after each call
            (see the module docstring): reusing an index reuses its noise.
        out_dtype: float32 (default), bfloat16 or float16. The noise and the sum are float32 whatever this is.
        channels_last: write the ``[num, C, H, W]`` output in channels_last memory format (3-D latents only).
        out: optional preallocated output (e.g. a static buffer reused across batches) of shape ``[num, *S]``,
            dtype ``out_dtype``, on the latent's device, dense in the requested memory format.

    Returns:
        ``[num, *S]`` tensor of dtype ``out_dtype`` on the latent's device. Non-finite latents are not checked
        (that would need a host sync); they propagate.
    """
    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, channels_last)
    out = _output(latent, num, out_dtype, channels_last, out)
    numel = latent.numel()
    _check_launch_device("latent", latent)
    triton = _kernels().triton
    source = latent.detach().contiguous()
    channels, spatial = (latent.shape[0], latent.shape[1] * latent.shape[2]) if channels_last else (1, numel)
    seed_lo, seed_hi = _split32(seed)
    pairs = numel % 2 == 0 and spatial % 2 == 0  # whole pairs in every sample (module docstring)
    kernel = _kernels().noise_pairs if pairs else _kernels().noise
    width = numel // 2 if pairs else numel  # pairs or elements per sample
    block_e = min(triton.next_power_of_2(width), 1024 // (1 + pairs))  # 1024 output elements per program
    block_s = max(1, 1024 // (1 + pairs) // block_e)
    chunk = block_s * _MAX_GRID_Y  # samples per launch (the grid's second axis is limited to 65535 blocks)
    flat = out.as_strided((num, numel), (numel, 1))  # the dense storage, one row per sample, whatever the layout
    blocks = {"BLOCK_P" if pairs else "BLOCK_E": block_e, "BLOCK_S": block_s}
    for start in range(0, num, chunk):
        rows = min(chunk, num - start)
        base_lo, base_hi = _split32(((offset + start) * numel) % _U64)  # the stream index of the launch's first element
        kernel[(triton.cdiv(width, block_e), triton.cdiv(rows, block_s))](
            source, flat[start:], rows, numel, channels, spatial, sigma, seed_lo, seed_hi, base_lo, base_hi,
            CHANNELS_LAST=channels_last, BF16=out_dtype == torch.bfloat16, **blocks,
        )
    return out


def noisy_latents_native(
    latent: torch.Tensor,
    num: int,
    sigma: float,
    seed: int,
    offset: int,
    out_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`noisy_latents_triton` by the C++ kernel of ``csrc/noise_cpu.cpp`` (CPU tensors; multi-threaded with torch's
    intra-op threads): same arguments, same stream, same output contract. Raises ``RuntimeError`` where the extension
    could not be built (see :mod:`splitz_fast.kernels.native`)."""
    from .native import native_module

    return _extension_noise(native_module, "cpu", "the native kernels of splitz_fast (csrc/noise_cpu.cpp)", latent,
                            num, sigma, seed, offset, out_dtype, channels_last, out)


def noisy_latents_cuda(
    latent: torch.Tensor,
    num: int,
    sigma: float,
    seed: int,
    offset: int,
    out_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`noisy_latents_triton` by the CUDA kernel of ``csrc/noise_votes_cuda.cu`` (CUDA tensors): same arguments, same
    stream, same output contract (``out=``, float32/bfloat16/float16, channels_last). One thread per Philox call (both
    normals of the pair used, where the Triton kernel runs each call twice). Selected by ``SPLITZ_BACKEND=native`` on
    CUDA tensors; ``auto`` keeps the Triton kernel (faster on an H100, ``AUTO_CUDA_NATIVE_OPS``). Raises ``RuntimeError``
    where the extension could not be built (see :mod:`splitz_fast.kernels.native_cuda`)."""
    from .native_cuda import cuda_module

    return _extension_noise(cuda_module, "cuda", "the CUDA kernels of splitz_fast (csrc/noise_votes_cuda.cu)", latent,
                            num, sigma, seed, offset, out_dtype, channels_last, out)


def _extension_noise(load_module, device_type: str, what: str, latent, num, sigma, seed, offset, out_dtype,
                     channels_last, out) -> torch.Tensor:
    """The launch shared by the compiled extensions' noise ops: the contract's checks first (a bad argument never
    triggers a build), then the extension (built on first use), then its ``noisy_latents`` into ``out``."""
    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, channels_last)
    if latent.device.type != device_type:
        raise ValueError(f"latent is on {latent.device}: {what} run on {device_type.upper()} tensors")
    out = _output(latent, num, out_dtype, channels_last, out)
    module = load_module()
    if module is None:
        raise RuntimeError(f"{what} are not available on this machine (see the warning above); use "
                           "noisy_latents_reference (SPLITZ_BACKEND=reference)")
    module.noisy_latents(latent.detach().float().contiguous(), out, sigma, seed, offset, channels_last)
    return out


def _pooled_output(latent, num, out_dtype, out) -> torch.Tensor:
    if latent.ndim != 3 or latent.shape[1] % 2 or latent.shape[2] % 2:
        raise ValueError(f"the fused 2x2 max pool needs a [C, H, W] latent with H and W even, got {tuple(latent.shape)}")
    shape = (num, latent.shape[0], latent.shape[1] // 2, latent.shape[2] // 2)
    if out is None:
        return torch.empty(shape, dtype=out_dtype, device=latent.device, memory_format=torch.channels_last)
    if (tuple(out.shape) != shape or out.dtype != out_dtype or out.device != latent.device
            or not out.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(f"out must be a dense channels_last tensor of shape {shape}, dtype {out_dtype} on "
                         f"{latent.device}; got {tuple(out.shape)}, {out.dtype} on {out.device}")
    return out


def noisy_latents_maxpool2_triton(
    latent: torch.Tensor, num: int, sigma: float, seed: int, offset: int, out_dtype: torch.dtype = torch.float32,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``max_pool2d(noisy_latents_triton(latent, num, σ, seed, offset, out_dtype, channels_last=True), 2)`` in one pass
    of a Triton kernel that never writes the full-size batch (the same numbers, as
    :func:`noisy_latents_maxpool2_native`, whose contract it shares: ``[C, H, W]`` latents with ``H``, ``W`` even, output
    ``[num, C, H/2, W/2]`` channels_last). It reads each window's two Philox pairs once, where the unfused kernel runs
    every Philox call twice and writes four times the output."""
    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, True)
    out = _pooled_output(latent, num, out_dtype, out)
    _check_launch_device("latent", latent)
    triton, kernel = _kernels().triton, _kernels().noise_maxpool2
    channels, height, width = latent.shape
    numel, pooled = latent.numel(), latent.numel() // 4
    seed_lo, seed_hi = _split32(seed)
    block_e = min(triton.next_power_of_2(pooled), 512)
    block_s = max(1, 512 // block_e)
    chunk = block_s * _MAX_GRID_Y
    flat = out.as_strided((num, pooled), (pooled, 1))  # the dense channels_last storage, one row per sample
    source = latent.detach().contiguous()
    for start in range(0, num, chunk):
        rows = min(chunk, num - start)
        base_lo, base_hi = _split32(((offset + start) * numel) % _U64)
        kernel[(triton.cdiv(pooled, block_e), triton.cdiv(rows, block_s))](
            source, flat[start:], rows, pooled, channels, height, width, sigma, seed_lo, seed_hi, base_lo, base_hi,
            BF16=out_dtype == torch.bfloat16, BLOCK_S=block_s, BLOCK_E=block_e,
        )
    return out


def noisy_latents_maxpool2_native(
    latent: torch.Tensor, num: int, sigma: float, seed: int, offset: int, out_dtype: torch.dtype = torch.float32,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``max_pool2d(noisy_latents_triton(latent, num, σ, seed, offset, out_dtype, channels_last=True), 2)`` in one pass of the
    C++ kernel, which never writes the full-size batch: for an ``f_R`` that starts with a 2x2 max pool of stride 2
    (LeNet's split 1), the sampling engine draws this and runs the rest of ``f_R``. The same numbers: the 2x2 windows
    take the max of the same float32 sums, and that max commutes with the final (monotone) cast. ``[C, H, W]`` latents
    with ``H``, ``W`` even; the output is ``[num, C, H/2, W/2]`` channels_last."""
    from .native import native_module

    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, True)
    if latent.device.type != "cpu":
        raise ValueError(f"latent is on {latent.device}: the native noise kernel runs on CPU tensors")
    out = _pooled_output(latent, num, out_dtype, out)
    module = native_module()
    if module is None:
        raise RuntimeError("the native kernels of splitz_fast (csrc/) are not available on this machine (see the "
                           "warning above)")
    module.noisy_latents_maxpool2(latent.detach().float().contiguous(), out, sigma, seed, offset)
    return out


def noisy_latents_maxpool2_reference(
    latent: torch.Tensor, num: int, sigma: float, seed: int, offset: int, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`noisy_latents_maxpool2_native` in PyTorch: the reference noisy latents, then ``F.max_pool2d(., 2)``."""
    noisy = noisy_latents_reference(latent, num, sigma, seed, offset, out_dtype, channels_last=True)
    return torch.nn.functional.max_pool2d(noisy, 2)


def noisy_latents_reference(
    latent: torch.Tensor,
    num: int,
    sigma: float,
    seed: int,
    offset: int,
    out_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`noisy_latents_triton` in PyTorch on any device: the same stream
    (:func:`.philox_reference.stream_normals_reference`), the sum in float32, then the cast to ``out_dtype`` /
    channels_last. The test oracle, and the fallback where neither Triton nor the native kernels run (about 10x slower
    than the native CPU kernel; it materialises int64 temporaries)."""
    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, channels_last)
    out = _output(latent, num, out_dtype, channels_last, out)
    numel = latent.numel()
    z = stream_normals_reference(seed, offset * numel, num * numel, latent.device).view(num, *latent.shape)
    noisy = torch.add(latent.detach().float(), z, alpha=sigma)  # σz rounded to float32, then the float32 sum
    return out.copy_(noisy)

