"""The CUDA math settings a computation runs under, set for its duration and restored after, one thread at a time.

TF32 for cuDNN convolutions and CUDA matmuls (``torch.backends.cudnn.conv.fp32_precision`` and
``torch.backends.cuda.matmul.fp32_precision`` where torch has them, else the legacy ``allow_tf32`` flags) and
``torch.backends.cudnn.benchmark`` are process-wide and read when an operation is launched. The latent ``f_L(x)`` must be computed in IEEE float32 (the
function the Lipschitz bound describes, to float32 rounding; PyTorch's default lets cuDNN convolutions use TF32, about
1e-3 relative error) while the sampling engine may launch ``f_R`` in TF32 on another thread (``precision="tf32"``), so
every setting is made and undone under one lock: the launches inside one block see only that block's settings.
Off CUDA nothing is touched and no lock is taken.
"""
from __future__ import annotations

import threading

import torch

_SETTINGS_LOCK = threading.RLock()
# Where the running torch has the per-backend precision API (``fp32_precision``), only it is used: torch refuses to read
# the legacy ``allow_tf32`` flags once the two APIs have set different values, so a process never mixes them.
NEW_PRECISION_API = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def _effective(*levels) -> bool:
    """Whether TF32 is on for the first of ``levels`` (a backend's ``fp32_precision`` object, then its parents):
    ``"none"`` inherits from the next level, and ``"none"`` all the way up is IEEE float32."""
    for level in levels:
        precision = getattr(level, "fp32_precision", "none")
        if precision != "none":
            return precision == "tf32"
    return False


def convolutions_use_tf32() -> bool:
    """Whether cuDNN convolutions run float32 in TF32 now (either API, whichever the running torch has)."""
    if NEW_PRECISION_API:
        return _effective(torch.backends.cudnn.conv, torch.backends.cudnn, torch.backends)
    return torch.backends.cudnn.allow_tf32


def matmuls_use_tf32() -> bool:
    """Whether CUDA float32 matmuls run in TF32 now (either API)."""
    if NEW_PRECISION_API:
        return _effective(torch.backends.cuda.matmul, torch.backends)
    return torch.backends.cuda.matmul.allow_tf32


def _tf32_flags() -> tuple:
    """The TF32 settings as they are, to be put back by :func:`_restore_tf32_flags`."""
    if NEW_PRECISION_API:
        return torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def _restore_tf32_flags(flags: tuple) -> None:
    if NEW_PRECISION_API:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = flags
    else:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def _use_tf32(tf32: bool) -> None:
    if NEW_PRECISION_API:
        precision = "tf32" if tf32 else "ieee"
        torch.backends.cudnn.conv.fp32_precision = torch.backends.cuda.matmul.fp32_precision = precision
    else:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32


class cuda_math:
    """While the block runs on a CUDA ``device``: TF32 for convolutions and matmuls exactly when ``tf32``, and
    ``cudnn.benchmark`` (autotuned algorithms, for static shapes) when ``benchmark`` (``None``: as it is); the previous
    settings are restored afterwards. Blocks of different threads run one after another; a thread may nest them."""

    def __init__(self, device: torch.device, tf32: bool, benchmark: bool | None = True):
        self.active, self.tf32, self.benchmark = torch.device(device).type == "cuda", tf32, benchmark

    def __enter__(self):
        if self.active:
            _SETTINGS_LOCK.acquire()
            self.previous = torch.backends.cudnn.benchmark, _tf32_flags()
            if self.benchmark is not None:
                torch.backends.cudnn.benchmark = self.benchmark
            _use_tf32(self.tf32)
        return self

    def __exit__(self, *exc):
        if self.active:
            torch.backends.cudnn.benchmark, flags = self.previous
            _restore_tf32_flags(flags)
            _SETTINGS_LOCK.release()


def ieee_float32(device: torch.device) -> cuda_math:
    """IEEE float32 convolutions and matmuls on a CUDA ``device`` (no TF32), cuDNN's algorithm choice left as the user
    set it: for ``f_L(x)``, one input at a time."""
    return cuda_math(device, tf32=False, benchmark=None)


__all__ = ["NEW_PRECISION_API", "convolutions_use_tf32", "cuda_math", "ieee_float32", "matmuls_use_tf32"]
