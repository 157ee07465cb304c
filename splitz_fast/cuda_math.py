"""The CUDA math settings a computation runs under, set for its duration and restored after, one thread at a time.

``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.benchmark``
are process-wide and read when an operation is launched. The latent ``f_L(x)`` must be computed in IEEE float32 (the
function the Lipschitz bound describes, to float32 rounding; PyTorch's default lets cuDNN convolutions use TF32, about
1e-3 relative error) while the sampling engine may launch ``f_R`` in TF32 on another thread (``precision="tf32"``), so
every setting is made and undone under one lock: the launches inside one block see only that block's settings.
Off CUDA nothing is touched and no lock is taken.
"""
from __future__ import annotations

import threading

import torch

_SETTINGS_LOCK = threading.RLock()


class cuda_math:
    """While the block runs on a CUDA ``device``: TF32 for convolutions and matmuls exactly when ``tf32``, and
    ``cudnn.benchmark`` (autotuned algorithms, for static shapes) when ``benchmark`` (``None``: as it is); the previous
    settings are restored afterwards. Blocks of different threads run one after another; a thread may nest them."""

    def __init__(self, device: torch.device, tf32: bool, benchmark: bool | None = True):
        self.active, self.tf32, self.benchmark = torch.device(device).type == "cuda", tf32, benchmark

    def __enter__(self):
        if self.active:
            _SETTINGS_LOCK.acquire()
            self.previous = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                             torch.backends.cuda.matmul.allow_tf32)
            if self.benchmark is not None:
                torch.backends.cudnn.benchmark = self.benchmark
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = self.tf32
        return self

    def __exit__(self, *exc):
        if self.active:
            (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32) = self.previous
            _SETTINGS_LOCK.release()


def ieee_float32(device: torch.device) -> cuda_math:
    """IEEE float32 convolutions and matmuls on a CUDA ``device`` (no TF32), cuDNN's algorithm choice left as the user
    set it: for ``f_L(x)``, one input at a time."""
    return cuda_math(device, tf32=False, benchmark=None)


__all__ = ["cuda_math", "ieee_float32"]
