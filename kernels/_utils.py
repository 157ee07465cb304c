"""Helpers the kernel files share (one place, not a copy per op file)."""
from __future__ import annotations

import torch


def gamma_vector(gamma: float | torch.Tensor | None, z: torch.Tensor) -> torch.Tensor | None:
    """``gamma`` (a float, a 0-d tensor or one value per sample) as a contiguous ``[B]`` vector in ``z``'s dtype and
    device, ``B = z.shape[0]``; ``None`` stays ``None``."""
    if gamma is None:
        return None
    # A Python float goes through float64, never torch's float32 default: a γ rounded down would bound a smaller ball.
    g = gamma if isinstance(gamma, torch.Tensor) else torch.as_tensor(gamma, dtype=torch.float64)
    g = g.detach().to(device=z.device, dtype=z.dtype).flatten()
    if g.numel() == 1:
        g = g.expand(z.shape[0])
    if g.numel() != z.shape[0]:
        raise ValueError(f"gamma must be a scalar or have one value per sample ({z.shape[0]}), got {g.numel()}")
    return g.contiguous()


def check_launch_device(name: str, t: torch.Tensor, kernel) -> None:
    """Refuse a launch of a Triton ``kernel`` (jitted by its op file's ``_kernels()``, so one kernel of a file stands
    for all of them) on ``t`` outside CUDA, unless Triton wrapped the kernel for its interpreter."""
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if t.device.type != "cuda" and not interpreted:
        raise ValueError(f"{name} is on {t.device}: the Triton kernels run on CUDA tensors (or on CPU tensors when "
                         "TRITON_INTERPRET=1 is set before the first launch); use the *_reference function elsewhere")
