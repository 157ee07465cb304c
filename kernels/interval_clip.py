"""Fused interval step of ``f_L``'s ball bounds: one elementwise pass per affine layer.

Given the pre-activation at the interval center ``z`` and a radius, it produces the pre-activation bounds, the
varying mask and the interval of the clipped-ReLU output that feeds the next layer — the body of the layer loop of
:func:`splitz_fast.bounds.intervals.ball_bounds`::

    r_eff  = gamma[b] · r          (or r, without gamma)
    total  = r_eff + margin        (margin optional)
    total  = total + rel_margin · r_eff   (rel_margin optional)
    lower  = z − total,  upper = z + total
    mask   = (upper > 0) & (lower < θ)          (all True without activation, θ = None)
    clip(v) = min(max(v, 0), θ)                 (identity without activation)
    center = (clip(lower) + clip(upper)) / 2,  radius = (clip(upper) − clip(lower)) / 2

Everything is evaluated in ``z``'s dtype, in exactly this order (the Triton kernel is compiled with
``enable_fp_fusion=False``, so no multiply-add is contracted into an FMA): on float64 inputs the kernel
reproduces the reference bit for bit up to the order of IEEE operations, which is the same. Soundness margins
(the caller's ``margin``/``rel_margin``, see ``bounds.ROUNDING_MARGIN``) are *inputs*: this op does not add any.

Shapes (``S`` is one sample's shape, e.g. ``(C, H, W)`` or ``(F,)``):

* ``z``: ``[B, *S]`` float32 / float64.
* ``r``: ``[B, *S]`` per-sample radius, or ``[*S]`` / ``[1, *S]`` shared by the batch (e.g. first-layer row norms
  ``‖w_i D‖₂``) — then usually with ``gamma: [B]`` (or a scalar), the per-sample ball radius.
* ``margin``: ``None``, ``[B, *S]`` or ``[*S]`` / ``[1, *S]``.
* ``theta``: ``None`` (layer without activation) or a threshold of any shape ``ClippedReLU`` accepts, read by
  :func:`.thresholds.normalize_threshold` exactly as the forward pass reads it (scalar, may be ``inf``; 1-D ``[C]``
  per channel; otherwise torch broadcasting against ``S``). θ must be ≥ 0 (not checked here;
  ``LeftHalf.check_structure`` does).

Outputs (:class:`IntervalClip`): ``lower``, ``upper``, ``center``, ``radius`` shaped like ``z`` in ``z``'s dtype,
``mask`` ``[B, *S]`` bool; ``center``/``radius`` are ``None`` when ``need_next=False`` (the last layer).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import interpreting
from ._utils import gamma_vector
from .thresholds import theta_broadcast, theta_mode

__all__ = [
    "IntervalClip",
    "interval_clip",
    "interval_clip_reference",
    "interval_clip_triton",
]

OP_NAME = "interval_clip"
_BLOCK = 1024
# Soundness: no mul+add contraction (FMA), so the float64 kernel performs exactly the reference's IEEE operations.
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


class IntervalClip(NamedTuple):
    """Outputs of one interval step (see module docstring)."""

    lower: torch.Tensor
    upper: torch.Tensor
    mask: torch.Tensor
    center: torch.Tensor | None
    radius: torch.Tensor | None


# --------------------------------------------------------------------------------------------------------------------
# Argument normalization shared by the reference and the Triton launcher
# --------------------------------------------------------------------------------------------------------------------

def _check_z(z: torch.Tensor) -> None:
    if not isinstance(z, torch.Tensor) or z.ndim < 2:
        raise ValueError(f"z must be a [B, *S] tensor with at least 2 dims, got {getattr(z, 'shape', type(z))}")
    if z.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"z must be float32 or float64, got {z.dtype}")


def _per_sample_or_shared(name: str, t: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` as ``[B, N]`` (per sample, True) or ``[N]`` (shared, False), in ``z``'s dtype, contiguous."""
    sample = tuple(z.shape[1:])
    t = t.detach().to(device=z.device, dtype=z.dtype)
    if tuple(t.shape) == tuple(z.shape):
        return t.reshape(z.shape[0], -1).contiguous(), True
    if tuple(t.shape) == sample or (t.ndim == z.ndim and t.shape[0] == 1 and tuple(t.shape[1:]) == sample):
        return t.reshape(-1).contiguous(), False
    raise ValueError(f"{name} must have shape {tuple(z.shape)}, {sample} or {(1, *sample)}, got {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------------------------------
# Reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def interval_clip_reference(
    z: torch.Tensor,
    r: torch.Tensor,
    theta: float | torch.Tensor | None = None,
    *,
    gamma: float | torch.Tensor | None = None,
    margin: torch.Tensor | None = None,
    rel_margin: float = 0.0,
    need_next: bool = True,
    out: IntervalClip | None = None,
) -> IntervalClip:
    """Pure-PyTorch interval step (see module docstring for shapes and semantics); ``out`` as in
    :func:`interval_clip_triton` (copied into when given)."""
    _check_z(z)
    z = z.detach()
    sample = tuple(z.shape[1:])
    batch = z.shape[0]
    r_t, r_per_sample = _per_sample_or_shared("r", r, z)
    r_eff = r_t.view(batch, *sample) if r_per_sample else r_t.view(1, *sample)
    g = gamma_vector(gamma, z)
    if g is not None:
        r_eff = g.view(-1, *([1] * len(sample))) * r_eff
    total = r_eff
    if margin is not None:
        m_t, m_per_sample = _per_sample_or_shared("margin", margin, z)
        total = total + (m_t.view(batch, *sample) if m_per_sample else m_t.view(1, *sample))
    if rel_margin:
        rel = torch.tensor(float(rel_margin), dtype=z.dtype, device=z.device)
        total = total + rel * r_eff
    lower = z - total
    upper = z + total
    mode, values = theta_mode(theta, z)
    if mode == 0:
        mask = torch.ones(z.shape, dtype=torch.bool, device=z.device)
        clo, cup = lower, upper
    else:
        th = theta_broadcast(mode, values, z)
        mask = (upper > 0) & (lower < th)
        clo = torch.minimum(lower.clamp_min(0), th)
        cup = torch.minimum(upper.clamp_min(0), th)
    center = radius = None
    if need_next:
        center = (clo + cup) / 2
        radius = (cup - clo) / 2
    result = IntervalClip(lower, upper, mask, center, radius)
    if out is None:
        return result
    for name, src in zip(IntervalClip._fields, result):
        dst = getattr(out, name)
        if src is not None:
            _check_out(name, dst, z, dst.dtype)
            dst.copy_(src)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Triton kernel (built lazily: importing this module never imports triton)
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def interval_clip_kernel(
        Z, R, GAMMA, MARGIN, REL, THETA,
        LO, UP, MASK, CEN, RAD,
        numel, N, C, INNER,
        R_PER_SAMPLE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_MARGIN: tl.constexpr,
        MARGIN_PER_SAMPLE: tl.constexpr, HAS_REL: tl.constexpr, THETA_MODE: tl.constexpr,
        NEED_NEXT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < numel
        b = offs // N
        j = offs - b * N
        z = tl.load(Z + offs, mask=inb, other=0.0)
        if R_PER_SAMPLE:
            r = tl.load(R + offs, mask=inb, other=0.0)
        else:
            r = tl.load(R + j, mask=inb, other=0.0)
        if HAS_GAMMA:
            g = tl.load(GAMMA + b, mask=inb, other=0.0)
            r = g * r
        total = r
        if HAS_MARGIN:
            if MARGIN_PER_SAMPLE:
                mg = tl.load(MARGIN + offs, mask=inb, other=0.0)
            else:
                mg = tl.load(MARGIN + j, mask=inb, other=0.0)
            total = total + mg
        if HAS_REL:
            rel = tl.load(REL)
            total = total + rel * r
        lo = z - total
        up = z + total
        tl.store(LO + offs, lo, mask=inb)
        tl.store(UP + offs, up, mask=inb)
        if THETA_MODE == 0:
            tl.store(MASK + offs, tl.full([BLOCK], 1, tl.uint8), mask=inb)
            clo = lo
            cup = up
        else:
            if THETA_MODE == 1:
                th = tl.load(THETA)
            elif THETA_MODE == 2:
                th = tl.load(THETA + (j // INNER) % C, mask=inb, other=0.0)
            else:
                th = tl.load(THETA + j, mask=inb, other=0.0)
            m = (up > 0.0) & (lo < th)
            tl.store(MASK + offs, m.to(tl.uint8), mask=inb)
            clo = tl.minimum(tl.maximum(lo, 0.0), th)
            cup = tl.minimum(tl.maximum(up, 0.0), th)
        if NEED_NEXT:
            tl.store(CEN + offs, (clo + cup) * 0.5, mask=inb)
            tl.store(RAD + offs, (cup - clo) * 0.5, mask=inb)

    return interval_clip_kernel


def _check_out(name: str, t: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != tuple(z.shape) or t.dtype != dtype or t.device != z.device or not t.is_contiguous():
        raise ValueError(f"out.{name} must be a contiguous {dtype} tensor of shape {tuple(z.shape)} on {z.device}")
    return t


@torch.no_grad()
def interval_clip_triton(
    z: torch.Tensor,
    r: torch.Tensor,
    theta: float | torch.Tensor | None = None,
    *,
    gamma: float | torch.Tensor | None = None,
    margin: torch.Tensor | None = None,
    rel_margin: float = 0.0,
    need_next: bool = True,
    out: IntervalClip | None = None,
) -> IntervalClip:
    """The fused Triton pass (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``out``: optional preallocated outputs (contiguous, shaped like ``z``; ``mask`` bool or uint8; ``center`` and
    ``radius`` may be ``None`` when ``need_next=False``), written in place and returned.
    """
    _check_z(z)
    if z.device.type != "cuda" and not interpreting():
        raise RuntimeError("interval_clip_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    z = z.detach().contiguous()
    batch = z.shape[0]
    n = math.prod(z.shape[1:])
    r_t, r_per_sample = _per_sample_or_shared("r", r, z)
    g = gamma_vector(gamma, z)
    m_t, m_per_sample = (None, False) if margin is None else _per_sample_or_shared("margin", margin, z)
    rel = None if not rel_margin else torch.tensor([float(rel_margin)], dtype=z.dtype, device=z.device)
    mode, theta_t = theta_mode(theta, z)
    channels = z.shape[1]
    inner = max(1, n // channels) if channels else 1

    if out is None:
        lower, upper = torch.empty_like(z), torch.empty_like(z)
        mask_u8 = torch.empty(z.shape, dtype=torch.uint8, device=z.device)
        mask = mask_u8.view(torch.bool)
        center = torch.empty_like(z) if need_next else None
        radius = torch.empty_like(z) if need_next else None
    else:
        lower = _check_out("lower", out.lower, z, z.dtype)
        upper = _check_out("upper", out.upper, z, z.dtype)
        mask = out.mask
        if mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"out.mask must be bool or uint8, got {mask.dtype}")
        _check_out("mask", mask, z, mask.dtype)
        mask_u8 = mask.view(torch.uint8)
        center = _check_out("center", out.center, z, z.dtype) if need_next else None
        radius = _check_out("radius", out.radius, z, z.dtype) if need_next else None

    numel = batch * n
    if numel == 0:
        return IntervalClip(lower, upper, mask, center, radius)
    dummy = z  # placeholder for absent pointers (never dereferenced: the constexpr flags drop those loads)
    kernel = _kernels()
    import triton  # the launch path only: importing this module never imports triton

    grid = (triton.cdiv(numel, _BLOCK),)
    kernel[grid](
        z, r_t, dummy if g is None else g, dummy if m_t is None else m_t, dummy if rel is None else rel,
        dummy if theta_t is None else theta_t,
        lower, upper, mask_u8, lower if center is None else center, upper if radius is None else radius,
        numel, n, channels, inner,
        R_PER_SAMPLE=r_per_sample, HAS_GAMMA=g is not None, HAS_MARGIN=m_t is not None,
        MARGIN_PER_SAMPLE=m_per_sample, HAS_REL=rel is not None, THETA_MODE=mode, NEED_NEXT=need_next,
        BLOCK=_BLOCK, **LAUNCH_OPTIONS,
    )
    return IntervalClip(lower, upper, mask, center, radius)


def interval_clip(
    z: torch.Tensor,
    r: torch.Tensor,
    theta: float | torch.Tensor | None = None,
    *,
    gamma: float | torch.Tensor | None = None,
    margin: torch.Tensor | None = None,
    rel_margin: float = 0.0,
    need_next: bool = True,
    out: IntervalClip | None = None,
    backend: str | None = None,
) -> IntervalClip:
    """Dispatching entry point: ``backend`` ``"triton"`` / ``"reference"``, or ``None`` for
    ``splitz_fast.kernels.select_backend("interval_clip", z.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if backend is None:
        from . import select_backend

        backend = select_backend(OP_NAME, z.device)
    if backend == "triton":
        return interval_clip_triton(z, r, theta, gamma=gamma, margin=margin, rel_margin=rel_margin,
                                    need_next=need_next, out=out)
    if backend == "reference":
        return interval_clip_reference(z, r, theta, gamma=gamma, margin=margin, rel_margin=rel_margin,
                                       need_next=need_next)
    raise ValueError(f"backend must be 'triton', 'reference' or None, got {backend!r}")
