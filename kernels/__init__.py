"""Fused kernels of splitz_fast, shipped as ``splitz_fast.kernels``, and the backend dispatch.

Every op will have one file here (Triton kernels, launcher, ``autograd.Function``) next to its pure-PyTorch reference
in ``splitz_fast`` — the reference is both the CPU path and the test oracle. The Triton ops are not written yet
(issue #4); today every op runs its reference implementation, and forcing ``SPLITZ_BACKEND=triton`` is an error
rather than a silent fallback.
"""
from __future__ import annotations

import os

import torch

BACKEND_ENV = "SPLITZ_BACKEND"
BACKENDS = ("auto", "reference", "triton")
TRITON_OPS: frozenset[str] = frozenset()  # names of ops with a Triton implementation


def select_backend(op: str, device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for ``op`` on ``device``; ``SPLITZ_BACKEND`` forces one (default ``auto``:
    Triton on CUDA where the op has a kernel, the reference elsewhere)."""
    choice = os.environ.get(BACKEND_ENV, "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
        return "reference"
    has_kernel = op in TRITON_OPS
    if choice == "triton":
        if not has_kernel:
            raise NotImplementedError(f"{BACKEND_ENV}=triton, but op {op!r} has no Triton kernel yet")
        return "triton"
    return "triton" if has_kernel and device.type == "cuda" else "reference"
