"""The one reading of a clipped-ReLU threshold θ, shared by the forward pass, the bound code and every kernel.

A certificate is only as good as the agreement between the function that runs (``ClippedReLU.forward``) and the
function that is bounded (``bounds.ball_bounds`` and the kernels under it): a θ read per row by one and per channel
by the other gives masks for thresholds the network does not use, and a "local" bound far below the true one. So
θ is interpreted in exactly one place, :func:`normalize_threshold`; everything else works from its result.

Accepted shapes, for an activation whose one-sample shape is ``S`` (``(C, H, W)`` for a convolution, ``(F,)`` for a
``Linear``):

* one element (``()``, ``(1,)``, ``(1, 1, 1)``, …): a scalar θ;
* 1-D ``(C,)`` with ``C = S[0]`` when ``len(S) > 1``: per channel (``ClippedReLU(shape=(C,))``'s convention — torch's
  own right-aligned broadcasting would read it per column, so any other 1-D length is refused rather than guessed);
* anything else with at most ``len(S)`` dims that broadcasts to ``S`` under torch's right-aligned rules: per element
  as broadcast (``(C, 1, 1)`` per channel, ``(1, H, W)`` per pixel, ``(H, 1)`` per row, ``(C, H, W)``, ``(F,)``, …).
"""
from __future__ import annotations

import torch

__all__ = ["normalize_threshold", "theta_mode", "theta_broadcast"]


def normalize_threshold(theta: float | torch.Tensor, sample_shape: tuple[int, ...]) -> torch.Tensor:
    """θ with ``len(sample_shape)`` dims (or 0 dims for a scalar), broadcasting against one sample exactly as the
    clipped ReLU applies it; raises ``ValueError`` for a shape that does not broadcast or is ambiguous.

    Differentiable (a learnable θ keeps its gradient); dtype and device are kept.
    """
    t = torch.as_tensor(theta)
    sample = tuple(sample_shape)
    if t.numel() == 1:
        return t.reshape(())
    if t.ndim == 1 and len(sample) > 1:
        if t.shape[0] != sample[0]:
            raise ValueError(
                f"a 1-D clipped-ReLU threshold theta is per channel, but it has {t.shape[0]} values for an activation with "
                f"{sample[0]} channels (sample shape {sample}); give per-row/per-column thresholds an explicit shape "
                f"such as (H, 1) or (1, 1, W)"
            )
        return t.view(-1, *([1] * (len(sample) - 1)))
    if t.ndim > len(sample):
        raise ValueError(f"clipped-ReLU threshold theta of shape {tuple(t.shape)} has more dims than the activation's "
                         f"sample shape {sample} (θ must not depend on the batch)")
    padded = t.view(*([1] * (len(sample) - t.ndim)), *t.shape)
    try:
        broadcast = torch.broadcast_shapes(padded.shape, sample)
    except RuntimeError:
        broadcast = None
    if broadcast != sample:
        raise ValueError(f"clipped-ReLU threshold theta of shape {tuple(t.shape)} does not broadcast to the activation's "
                         f"sample shape {sample}")
    return padded


def theta_mode(theta: float | torch.Tensor | None, z: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """θ in the compact form the kernels take, for pre-activations ``z: [B, *S]``: ``(mode, values)`` with mode 0 no
    activation (``None``), 1 scalar (``[1]``), 2 per channel (``[C]``, broadcast over dim 1), 3 per element (``[N]``,
    ``N = prod(S)``); values detached, contiguous, in ``z``'s dtype and device."""
    if theta is None:
        return 0, None
    sample = tuple(z.shape[1:])
    t = normalize_threshold(torch.as_tensor(theta).detach(), sample).to(device=z.device, dtype=z.dtype)
    if t.ndim == 0:
        return 1, t.reshape(1).contiguous()
    if len(sample) > 1 and t.shape[0] == sample[0] and all(d == 1 for d in t.shape[1:]):
        return 2, t.reshape(-1).contiguous()
    return 3, t.expand(sample).reshape(-1).contiguous()


def theta_broadcast(mode: int, values: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor | None:
    """The compact θ of :func:`theta_mode` shaped to broadcast against ``z: [B, *S]`` (``None`` for mode 0)."""
    if mode == 0:
        return None
    if mode == 1:
        return values.reshape(())
    if mode == 2:
        return values.view(-1, *([1] * (z.ndim - 2)))
    return values.view(z.shape[1:])
