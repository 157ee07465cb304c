"""Noise draws and vote counting of the sampling engine (SPEC §2 soundness, §5 speed): ``noisy_latents_triton`` and
``count_votes_triton``, each a Triton kernel with its launcher, beside the pure-PyTorch references
``noisy_latents_reference`` and ``count_votes_reference`` (the test oracles and the fallback path), and
``noisy_latents_native``, the launcher of the C++ kernel of ``csrc/noise_cpu.cpp`` (the CPU path), and
``noisy_latents_cuda`` / ``count_votes_cuda``, the launchers of the CUDA kernels of ``csrc/noise_votes_cuda.cu``
(``SPLITZ_BACKEND=native`` on CUDA tensors; ``auto`` uses the Triton kernels there until measured otherwise).

``noisy_latents_triton(latent, num, σ, seed, offset) -> [num, *latent.shape]``
    ``latent + σ z`` with ``z ~ N(0, I)`` drawn **in float32** from a counter-based Philox4x32-10 stream
    (``tl.randint4x``) and the sum formed in float32; only then is the result cast to ``out_dtype`` (float32,
    bfloat16 or float16) on store. That cast is part of the base classifier ``f_R`` and keeps the smoothing guarantee
    (Voráček & Hein 2023); noise drawn or added in low precision would not. The latent is broadcast over the sample
    dimension inside the kernel (no ``latent.repeat``), and 4-D outputs can be written directly in channels_last.

``count_votes_triton(logits [b, C], counts [C])``
    ``counts += bincount(argmax(logits, 1), minlength=C)`` in place, on the device, without a host sync: ties go to
    the lowest index and a NaN counts as the maximum (the first NaN of a row wins), both as ``torch.argmax``.

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
  kernels of ``csrc/``, and the PyTorch reference here), the normals agree up to the rounding of ln, cos and sin
  (float32 ulps);
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

OPS = ("noisy_latents", "count_votes")  # op names for splitz_fast.kernels.TRITON_OPS
NOISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COUNT_DTYPES = (torch.int64, torch.int32)
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


def _count_votes_kernel(
    logits_ptr, counts_ptr, rows, classes, stride_r, stride_c,
    VALUE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    LOCAL_HIST: tl.constexpr,
):
    """Row argmax of ``BLOCK_R`` rows (scan over column chunks of ``BLOCK_C``), then either one block-local
    histogram of ``BLOCK_H >= classes`` bins added with one masked atomic per non-empty bin (``LOCAL_HIST``) or one
    atomic per row. ``VALUE`` is the comparison dtype (float32, or float64 for float64 logits)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    row_ptr = logits_ptr + r.to(tl.int64)[:, None] * stride_r
    best = tl.full([BLOCK_R], float("-inf"), VALUE)
    best_idx = tl.zeros([BLOCK_R], dtype=tl.int32)
    first_nan = tl.zeros([BLOCK_R], dtype=tl.int32) + classes
    for start in range(0, classes, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        valid = rmask[:, None] & (cols < classes)[None, :]
        x = tl.load(row_ptr + cols.to(tl.int64)[None, :] * stride_c, mask=valid, other=float("-inf")).to(VALUE)
        is_nan = (x != x) & valid
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols[None, :], classes), axis=1))
        ordinary = valid & (x == x)
        x = tl.where(ordinary, x, float("-inf"))
        chunk_max = tl.max(x, axis=1)
        chunk_idx = tl.min(tl.where(ordinary & (x == chunk_max[:, None]), cols[None, :], classes), axis=1)
        better = chunk_max > best  # strict: an equal maximum in a later chunk keeps the lower index
        best = tl.where(better, chunk_max, best)
        best_idx = tl.where(better, chunk_idx, best_idx)
    vote = tl.where(first_nan < classes, first_nan, best_idx)  # all -inf rows keep index 0, like torch.argmax
    if LOCAL_HIST:
        bins = tl.arange(0, BLOCK_H)
        hist = tl.sum(((vote[:, None] == bins[None, :]) & rmask[:, None]).to(tl.int32), axis=0)
        tl.atomic_add(counts_ptr + bins, hist.to(counts_ptr.dtype.element_ty), mask=(hist > 0) & (bins < classes),
                      sem="relaxed")
    else:
        ones = tl.full([BLOCK_R], 1, dtype=counts_ptr.dtype.element_ty)
        tl.atomic_add(counts_ptr + vote, ones, mask=rmask, sem="relaxed")


class _Kernels(NamedTuple):
    triton: object
    noise: object
    noise_pairs: object
    noise_maxpool2: object
    votes: object


@functools.cache
def _kernels() -> _Kernels:
    """The jitted kernels (built once, at the first launch)."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise RuntimeError("the Triton kernels of splitz_fast.kernels.noise_votes need the `triton` package; use "
                           "noisy_latents_reference / count_votes_reference (SPLITZ_BACKEND=reference)") from exc
    tl = language
    # The device functions the kernels call, jitted under their own names (the kernels resolve them as globals).
    global _philox_normals, _store_sample, _stream_base, _max_nan, _noisy_row_pair_max
    _philox_normals, _store_sample, _stream_base = map(triton.jit, (_philox_normals, _store_sample, _stream_base))
    _max_nan, _noisy_row_pair_max = triton.jit(_max_nan), triton.jit(_noisy_row_pair_max)
    stream_args = ["sigma", "seed_lo", "seed_hi", "base_lo", "base_hi"]
    noise = triton.jit(_noisy_latents_kernel, do_not_specialize=stream_args)
    pairs = triton.jit(_noisy_latent_pairs_kernel, do_not_specialize=stream_args)
    pooled = triton.jit(_noisy_maxpool2_kernel, do_not_specialize=stream_args)
    votes = triton.jit(_count_votes_kernel)
    return _Kernels(triton, noise, pairs, pooled, votes)


def _check_launch_device(name: str, t: torch.Tensor) -> None:
    interpreted = type(_kernels().votes).__name__ == "InterpretedFunction"  # one kernel stands for all
    if t.device.type != "cuda" and not interpreted:
        raise ValueError(f"{name} is on {t.device}: the Triton kernels run on CUDA tensors (or on CPU tensors when "
                         "TRITON_INTERPRET=1 is set before the first launch); use the *_reference function elsewhere")


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


_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(constant: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``constant * x`` for uint32 values held in int64 tensors, without overflowing
    int64: ``x`` is split into 16-bit halves, every partial product stays below 2**49."""
    low = constant * (x & 0xFFFF)
    mid = constant * (x >> 16) + (low >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def philox_words_reference(counters: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Words ``w0, w1, w2`` of Philox4x32-10 (Salmon et al. 2011) at the 64-bit ``counters`` (an int64 tensor read as
    uint64, two's complement) under the 64-bit key ``seed``, as int64 tensors with values in ``[0, 2**32)``: counter
    words ``(lo32, hi32, 0, 0)``, key words ``(lo32(seed), hi32(seed))`` — ``tl.randint4x``'s arrangement."""
    c0, c1 = counters & _MASK32, (counters >> 32) & _MASK32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, seed >> 32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2


def stream_normals_reference(seed: int, first: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stream's numbers ``z_t`` for ``t`` in ``[first, first + count)`` (float32, ``[count]``), in PyTorch: the
    oracle of the Triton and native kernels (module docstring)."""
    first_pair, last_pair = first >> 1, (first + count - 1) >> 1
    start = first_pair - 2**64 if first_pair >= 2**63 else first_pair  # the same 64 bits as a signed int64
    counters = torch.arange(last_pair - first_pair + 1, dtype=torch.int64, device=device) + start
    w0, w1, w2 = philox_words_reference(counters, seed)
    u1 = w0.float() * 2.3283064365386963e-10 + (w1.float() + 0.5) * 5.421010862427522e-20
    u1 = u1.clamp(max=1.0)
    u2 = w2.float() * 2.3283064365386963e-10 - 0.5
    radius = (-2.0 * torch.log(u1)).clamp(min=0.0).sqrt()
    angle = 6.283185307179586 * u2
    pairs = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1).flatten()
    skip = first & 1
    return pairs[skip:skip + count]


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
    """:func:`noisy_latents_triton` in PyTorch on any device: the same stream (:func:`stream_normals_reference`), the sum in
    float32, then the cast to ``out_dtype`` / channels_last. The test oracle, and the fallback where neither Triton nor
    the native kernels run (about 10x slower than the native CPU kernel; it materialises int64 temporaries)."""
    sigma = _check_stream_args(latent, num, sigma, seed, offset, out_dtype, channels_last)
    out = _output(latent, num, out_dtype, channels_last, out)
    numel = latent.numel()
    z = stream_normals_reference(seed, offset * numel, num * numel, latent.device).view(num, *latent.shape)
    noisy = torch.add(latent.detach().float(), z, alpha=sigma)  # σz rounded to float32, then the float32 sum
    return out.copy_(noisy)


def standard_normal(
    batch: int, shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device,
    channels_last: bool = False,
) -> torch.Tensor:
    """``[batch, *shape]`` float32 N(0, 1) draws from ``torch.randn``. With ``channels_last`` (``shape = (C, H, W)``)
    the numbers are drawn in NHWC order and viewed as NCHW, so the batch comes out channels_last without a copy —
    convolutions in ``f_R`` then take their faster NHWC path (CPU, LeNet: 1.4x the samples/s for SPLITZ, 1.9x for
    plain RS)."""
    if channels_last and len(shape) == 3:
        c, h, w = shape
        return torch.randn((batch, h, w, c), generator=generator, device=device, dtype=torch.float32).permute(0, 3, 1, 2)
    return torch.randn((batch, *shape), generator=generator, device=device, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------------ vote counts
def _check_votes_args(logits, counts) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(counts, torch.Tensor):
        raise TypeError("logits and counts must be torch.Tensors")
    if logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [batch, num_classes] tensor, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    if counts.ndim != 1 or counts.dtype not in COUNT_DTYPES:
        raise ValueError(f"counts must be a 1-D int64 or int32 tensor, got shape {tuple(counts.shape)} and dtype "
                         f"{counts.dtype}")
    if counts.numel() != logits.shape[1] or counts.numel() == 0:
        raise ValueError(f"counts has {counts.numel()} bins but logits have {logits.shape[1]} classes (need >= 1)")
    if counts.device != logits.device:
        raise ValueError(f"counts ({counts.device}) and logits ({logits.device}) must be on the same device")
    if not counts.is_contiguous():
        raise ValueError("counts must be contiguous (it is updated in place)")


def count_votes_triton(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``counts += bincount(argmax(logits, dim=1), minlength=C)`` in place by the Triton kernel; returns ``counts``.

    Args:
        logits: ``[b, C]`` scores, any float dtype and strides. Ties go to the lowest class index; a NaN counts as the
            maximum (the row's first NaN wins), as ``torch.argmax``.
        counts: ``[C]`` int64 or int32 histogram, contiguous, on the logits' device; accumulated atomically.
    """
    _check_votes_args(logits, counts)
    rows, classes = logits.shape
    if rows == 0:
        return counts
    _check_launch_device("logits", logits)
    triton, kernel = _kernels().triton, _kernels().votes
    block_c = min(triton.next_power_of_2(classes), 512)
    block_r = max(1, min(64, 4096 // block_c))
    block_h = triton.next_power_of_2(classes)
    value = tl.float64 if logits.dtype == torch.float64 else tl.float32
    kernel[(triton.cdiv(rows, block_r),)](
        logits, counts, rows, classes, logits.stride(0), logits.stride(1),
        VALUE=value, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_H=block_h, LOCAL_HIST=block_r * block_h <= 8192,
    )
    return counts


def count_votes_cuda(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`count_votes_triton` by the CUDA kernel of ``csrc/noise_votes_cuda.cu`` (CUDA tensors): same arguments, ties,
    NaN rule and in-place contract, no host sync. One thread per row up to 32 classes, one warp per row above; a
    shared-memory histogram per block. Selected by ``SPLITZ_BACKEND=native`` on CUDA tensors (``auto``: Triton)."""
    from .native_cuda import cuda_module

    _check_votes_args(logits, counts)
    if logits.device.type != "cuda":
        raise ValueError(f"logits are on {logits.device}: the CUDA vote kernel runs on CUDA tensors")
    if logits.shape[0] == 0:
        return counts
    module = cuda_module()
    if module is None:
        raise RuntimeError("the CUDA kernels of splitz_fast (csrc/noise_votes_cuda.cu) are not available here (see "
                           "the warning above); use count_votes_triton (Triton) or count_votes_reference")
    module.count_votes(logits.detach(), counts)
    return counts


def count_votes_reference(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of :func:`count_votes_triton` (``argmax`` + ``bincount``), same signature and in-place contract."""
    _check_votes_args(logits, counts)
    if logits.shape[0]:
        votes = torch.bincount(logits.argmax(dim=1), minlength=counts.numel())
        counts += votes.to(counts.dtype)
    return counts
