"""The Philox4x32-10 noise stream in pure PyTorch (SPEC §2 soundness): ``philox_words_reference`` (the Philox words at
given counters) and ``stream_normals_reference`` (the stream's N(0, 1) numbers ``z_t``), the oracle that every
backend of the noise op (:mod:`splitz_fast.kernels.noise`: Triton, the native CPU and CUDA kernels of ``csrc/``) and
the training noise (:mod:`splitz_fast.kernels.train_noise`) are tested against, and what their references draw from.
The stream contract is :mod:`splitz_fast.kernels.noise`'s module docstring (``csrc/philox.h`` has the same). Beside
it ``standard_normal``, the ``torch.randn`` draws of the fallback stream (no Philox contract: the torch generator's).
"""
from __future__ import annotations

import torch

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
    oracle of the Triton and native kernels (the stream of :mod:`splitz_fast.kernels.noise`'s module docstring)."""
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
