"""The training step's first layer of ``f_L`` after its affine part: the clipped ReLU and the varying mask, one pass.

Given the first layer's pre-activation ``z`` (``[B, *S]``, computed once by the layer itself) the op returns

    latent = min(relu(z), θ)                                   f_L(x) for a one-layer f_L (gradient to z and θ)
    mask   = (z + γ_b·r > 0) & (z − γ_b·r < θ)                 the varying mask over the ball ‖x' − x‖ ≤ γ_b

with ``r`` the first layer's row norms ``‖w_i D‖₂`` (:func:`splitz_fast.bounds.intervals.first_layer_row_norms`, shared by the
batch) — the mask of :func:`splitz_fast.bounds.intervals.ball_bounds`'s first layer as the training estimate computes it
(float32, no rounding margin: the estimate's masks need not be rigorous). The reference runs the clipped ReLU
(:class:`splitz_fast.model.modules.ClippedReLU`'s ops) and the interval step (:func:`.interval_clip.interval_clip_reference`)
— about ten passes over ``[B, *S]`` forward and backward; the native kernel (``csrc/train_cpu.cpp``) reads ``z``
once and writes the latent and a ``uint8`` mask, and its backward is one pass (torch's rules: relu passes where its
output is > 0, minimum passes where ``relu(z) < θ`` and splits a tie in half). Both compute the mask with the same
float operations in the same order (``γ_b·r``, then ``z ± ·``, then the comparisons), so on the same ``z`` the masks
are identical, as are the latents.

Shapes: ``z`` ``[B, *S]`` float32/float64; ``r`` ``[*S]`` or ``[1, *S]``; ``gamma`` scalar or ``[B]`` (raw input
units); ``theta`` any shape :func:`.thresholds.normalize_threshold` accepts (a learnable θ gets its gradient).
Outputs: ``latent`` like ``z`` (contiguous), ``mask`` ``[B, *S]`` bool.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import gamma_vector
from .interval_clip import interval_clip_reference
from .thresholds import normalize_threshold

__all__ = ["clip_mask", "clip_mask_native", "clip_mask_reference"]

OP_NAME = "clip_mask"


def _check(z: torch.Tensor, r: torch.Tensor, theta) -> None:
    if not isinstance(z, torch.Tensor) or z.ndim < 2 or z.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"z must be a float32/float64 [B, ...] tensor, got {getattr(z, 'shape', type(z))}")
    sample = tuple(z.shape[1:])
    if not isinstance(r, torch.Tensor) or tuple(r.shape) not in (sample, (1, *sample)):
        raise ValueError(f"r must have shape {sample} or {(1, *sample)} (shared by the batch), got "
                         f"{tuple(getattr(r, 'shape', ()))}")
    if theta is None:
        raise ValueError("theta is required: the op is the clipped ReLU's (a layer without activation has no mask)")


def clip_mask_reference(z: torch.Tensor, r: torch.Tensor, gamma: float | torch.Tensor,
                        theta: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op in PyTorch: ``ClippedReLU``'s forward (differentiable) and the interval step's mask."""
    _check(z, r, theta)
    th = normalize_threshold(torch.as_tensor(theta, device=z.device), tuple(z.shape[1:])).to(z.dtype)
    latent = torch.minimum(F.relu(z), th)
    mask = interval_clip_reference(z.detach(), r, theta, gamma=gamma, need_next=False).mask
    return latent, mask


class _ClipMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, theta_vec, r_vec, g, module):
        z2 = z.detach().reshape(z.shape[0], -1).contiguous()
        theta_c = theta_vec.detach().contiguous()
        latent, mask = module.clip_mask_forward(z2, r_vec, g, theta_c)
        ctx.save_for_backward(z2, theta_c)
        ctx.module, ctx.shape = module, z.shape
        mask = mask.view(z.shape).view(torch.bool)
        ctx.mark_non_differentiable(mask)
        return latent.view(z.shape), mask

    @staticmethod
    def backward(ctx, grad_latent, grad_mask):
        z2, theta_c = ctx.saved_tensors
        need_theta = ctx.needs_input_grad[1]
        grad = grad_latent.reshape(z2.shape).to(z2.dtype).contiguous()
        grad_z, grad_theta = ctx.module.clip_backward(z2, grad, theta_c, need_theta)
        grad_z = grad_z.view(ctx.shape) if ctx.needs_input_grad[0] else None
        grad_theta = grad_theta.sum(0) if need_theta else None
        return grad_z, grad_theta, None, None, None


def clip_mask_native(z: torch.Tensor, r: torch.Tensor, gamma: float | torch.Tensor,
                     theta: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op by the C++ kernel (CPU tensors), an ``autograd.Function`` (gradients to ``z`` and a learnable ``θ``)."""
    from .native import train_module

    _check(z, r, theta)
    if z.device.type != "cpu":
        raise ValueError(f"z is on {z.device}: the native clip_mask kernel runs on CPU tensors")
    module = train_module()
    if module is None:
        raise RuntimeError("the native training kernels of splitz_fast (csrc/train_cpu.cpp) are not available on this "
                           "machine (see the warning above); use clip_mask_reference")
    sample = tuple(z.shape[1:])
    th = normalize_threshold(torch.as_tensor(theta, device=z.device), sample).to(z.dtype)
    theta_vec = th.expand(sample).reshape(-1)  # differentiable: a learnable θ's gradient is summed back by autograd
    r_vec = r.detach().to(z.dtype).reshape(-1).contiguous()
    g = gamma_vector(gamma, z)
    return _ClipMask.apply(z, theta_vec, r_vec, g, module)


def clip_mask(z: torch.Tensor, r: torch.Tensor, gamma: float | torch.Tensor, theta: float | torch.Tensor, *,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point: ``backend`` ``"native"`` / ``"reference"``, or ``None`` for
    ``select_backend("clip_mask", z.device)`` (``SPLITZ_BACKEND`` overrides)."""
    if backend is None:
        from . import select_backend
        backend = select_backend(OP_NAME, z.device)
    if backend == "native":
        return clip_mask_native(z, r, gamma, theta)
    if backend == "reference":
        return clip_mask_reference(z, r, gamma, theta)
    raise ValueError(f"backend must be 'native', 'reference' or None, got {backend!r}")
