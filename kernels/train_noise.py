"""The training step's noisy latents: ``q`` noisy copies of every latent of a batch, differentiable in the latent.

    out[b·q + j] = latent[b] + σ · z_{b·q + j}        b < B, j < q;   ∂loss/∂latent[b] = Σ_j ∂loss/∂out[b·q + j]

``z_k`` is sample ``k`` of the Philox stream of ``csrc/philox.h`` (:mod:`.noise`' contract: element ``i`` of
sample ``k`` of a call at sample offset ``offset`` is ``z_t``, ``t = (offset + k)·D + i``, ``D`` = elements per latent,
``i`` row-major) under a 64-bit ``seed``. The SPLITZ training step (:func:`splitz_fast.training.loss.splitz_loss`) draws a
fresh ``seed`` from its ``torch.Generator`` every step (:func:`draw_seed`), so training stays reproducible from the
run's seed, and the certificate's noise (a different seed space, drawn by the smoother) is never reused.

Forward, in float32 whatever the latent's dtype: ``σ·z`` rounded, then the sum rounded (no FMA) — the native kernel
(C++, multi-threaded over the ``B·q`` rows) and the PyTorch reference compute the same float32 operations and differ
only by the rounding of ``ln``/``cos``/``sin`` in the Box–Muller step (a few ulps of ``z``). Backward: the gradient of
the ``q`` copies summed per latent (``[B, q, *S]`` summed over ``q``) on both backends.

Shapes: ``latent`` ``[B, *S]``; output ``[B·q, *S]`` float32, contiguous, or channels_last for ``[B, C, H, W]`` with
``channels_last=True``.
"""
from __future__ import annotations

import torch

from .philox_reference import stream_normals_reference

__all__ = ["draw_seed", "noisy_repeat", "noisy_repeat_native", "noisy_repeat_reference"]

OP_NAME = "train_noise"
_U64 = 2**64


def draw_seed(generator: torch.Generator | None, device: torch.device | str = "cpu") -> int:
    """A 64-bit stream seed from ``generator`` (two 32-bit draws of ``torch.randint``; the global generator when
    ``None``): one per training step."""
    words = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator, device=device).tolist()
    return (words[0] << 32) | words[1]


def _check(latent: torch.Tensor, q: int, sigma: float, seed: int, offset: int, channels_last: bool) -> float:
    if not isinstance(latent, torch.Tensor) or latent.ndim < 2 or not latent.is_floating_point():
        raise ValueError(f"latent must be a floating-point [B, ...] tensor, got {getattr(latent, 'shape', type(latent))}")
    if isinstance(q, bool) or not isinstance(q, int) or q < 1:
        raise ValueError(f"q (noise draws per latent) must be an integer >= 1, got {q!r}")
    sigma = float(sigma)
    if not sigma >= 0.0 or sigma == float("inf"):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _U64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an integer >= 0, got {offset!r}")
    numel = latent[0].numel() if latent.shape[0] else 0
    if numel >= 2**31:
        raise ValueError(f"one latent has {numel} elements; the kernels index one sample with 32-bit integers")
    if (offset + latent.shape[0] * q) * numel > _U64:
        raise ValueError("offset + B·q samples exceed the 2**64 numbers of one seed's stream; draw a new seed")
    if channels_last and latent.ndim != 4:
        raise ValueError(f"channels_last needs a [B, C, H, W] latent, got shape {tuple(latent.shape)}")
    return sigma


def _layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t.contiguous()


def noisy_repeat_reference(latent: torch.Tensor, q: int, sigma: float, seed: int, offset: int = 0,
                           channels_last: bool = False) -> torch.Tensor:
    """The op in PyTorch (differentiable through PyTorch's autograd): the stream by
    :func:`.philox_reference.stream_normals_reference`, then ``latent.repeat_interleave(q) + σz`` in float32."""
    sigma = _check(latent, q, sigma, seed, offset, channels_last)
    batch, sample = latent.shape[0], tuple(latent.shape[1:])
    numel = latent[0].numel() if batch else 0
    z = stream_normals_reference(seed, offset * numel, batch * q * numel, latent.device).view(batch * q, *sample)
    noisy = torch.add(latent.float().repeat_interleave(q, dim=0), z, alpha=sigma)
    return _layout(noisy, channels_last)


class _NoisyRepeat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, latent, q, sigma, seed_bits, offset, channels_last):
        from .native import train_module

        module = train_module()
        if module is None:
            raise RuntimeError("the native training kernels of splitz_fast (csrc/train_cpu.cpp) are not available on "
                               "this machine (see the warning above); use noisy_repeat_reference")
        src = latent.detach().float().contiguous()
        shape = (latent.shape[0] * q, *latent.shape[1:])
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        out = torch.empty(shape, dtype=torch.float32, device=latent.device, memory_format=fmt)
        module.train_noise(src, out, q, sigma, seed_bits, offset, channels_last)
        ctx.q, ctx.dtype = q, latent.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        batch_q = grad.shape[0]
        summed = grad.reshape(batch_q // ctx.q, ctx.q, *grad.shape[1:]).sum(1) if ctx.q > 1 else grad
        return summed.to(ctx.dtype), None, None, None, None, None


def noisy_repeat_native(latent: torch.Tensor, q: int, sigma: float, seed: int, offset: int = 0,
                        channels_last: bool = False) -> torch.Tensor:
    """The op by the C++ kernel of ``csrc/train_cpu.cpp`` (CPU tensors), an ``autograd.Function``."""
    sigma = _check(latent, q, sigma, seed, offset, channels_last)
    if latent.device.type != "cpu":
        raise ValueError(f"latent is on {latent.device}: the native training noise kernel runs on CPU tensors")
    # The seed's 64 bits as an int64: every argument of apply must convert to an int64 (the profiler records them).
    seed_bits = seed - _U64 if seed >= 2**63 else seed
    return _NoisyRepeat.apply(latent, q, sigma, seed_bits, offset, channels_last)


def noisy_repeat(latent: torch.Tensor, q: int, sigma: float, seed: int, offset: int = 0, channels_last: bool = False,
                 *, backend: str | None = None) -> torch.Tensor:
    """Dispatching entry point: ``backend`` ``"native"`` / ``"reference"``, or ``None`` for
    ``select_backend("train_noise", latent.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if backend is None:
        from . import select_backend
        backend = select_backend(OP_NAME, latent.device)
    if backend == "native":
        return noisy_repeat_native(latent, q, sigma, seed, offset, channels_last)
    if backend == "reference":
        return noisy_repeat_reference(latent, q, sigma, seed, offset, channels_last)
    raise ValueError(f"backend must be 'native', 'reference' or None, got {backend!r}")
