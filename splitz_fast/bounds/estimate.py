"""The training estimate of ``L(x, γ)`` (:func:`lipschitz_estimate`): masked power iteration, differentiable
w.r.t. the weights of ``f_L``, warm-started across steps (:class:`PowerIterationState`). The paper protocols use it
too. It is a *lower* estimate, never a certificate: the certified bounds are :mod:`splitz_fast.bounds.lipschitz`'s.
"""
from __future__ import annotations

import copy

import torch

from .intervals import BallBounds, ball_bounds
from .lipschitz import _layer_shapes
from ..model.modules import LeftHalf
from .operators import MaskedAffine
from ..kernels import conv_power, select_composite


class PowerIterationState:
    """Warm-start vectors for :func:`lipschitz_estimate`, one per affine layer of ``f_L`` (shape ``[*in_shape_k]``),
    shared by all inputs — no per-example state. Keep one instance across training steps."""

    def __init__(self) -> None:
        self.vectors: list[torch.Tensor | None] = []

    def get(self, k: int) -> torch.Tensor | None:
        return self.vectors[k] if k < len(self.vectors) else None

    def set(self, k: int, v: torch.Tensor) -> None:
        while len(self.vectors) <= k:
            self.vectors.append(None)
        self.vectors[k] = v.detach()

    def absorb_batch(self, k: int, v: torch.Tensor) -> None:
        """Warm start of layer ``k`` from one batch's final power vectors ``v: [B, *in_shape]``: their mean, unit
        length. (Data-parallel training overrides this to take the mean over every rank's rows:
        :class:`splitz_fast.training.parallel.DataParallelGroup`.)"""
        mean = v.mean(0)
        self.set(k, mean / mean.norm().clamp_min(1e-30))


def lipschitz_estimate(
    left: LeftHalf,
    x: torch.Tensor,
    gamma: float | torch.Tensor,
    *,
    power_iters: int = 5,
    state: PowerIterationState | None = None,
    generator: torch.Generator | None = None,
    bounds: BallBounds | None = None,
) -> torch.Tensor:
    """Training estimate of ``L(x, γ)``: masked power iteration, differentiable w.r.t. the weights of ``f_L``.

    ``bounds``: the ball bounds of ``x`` if the caller has them already (only ``masks``, ``in_masks`` and
    ``input_scale`` are read; the training step's fused first layer, :func:`splitz_fast.training.loss.splitz_loss`, leaves
    ``lower``/``upper`` empty); computed by :func:`~splitz_fast.bounds.intervals.ball_bounds` in the estimate's dtype otherwise.

    **Not an upper bound** (power iteration under-estimates spectral norms); never use it in a certificate.
    The masks are hard indicators without gradient; ``power_iters`` power steps run without gradient from the warm-start
    vectors in ``state`` (random on first use), and the returned ``[B]`` tensor is ``Π_k ‖A_k v_k‖`` with gradient
    flowing through ``A_k``'s weights (the standard spectral-norm gradient at convergence).
    """
    batch = x.shape[0]
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if left.depth == 0:
        return torch.ones(batch, dtype=dtype, device=x.device)
    if bounds is None:
        bounds = ball_bounds(left, x, gamma, dtype=dtype)
    scale = bounds.input_scale
    shapes = _layer_shapes(left, tuple(x.shape[1:]))
    # Convolution factors with few taps per output run fused per image on the CPU (kernels/conv_power.py: the power
    # step and the norm without materialising the masked activation); the others through MaskedAffine.
    conv_backend = select_composite(conv_power.OP_NAME, x.device)
    estimate = torch.ones(batch, dtype=dtype, device=x.device)
    for k, layer in enumerate(left.layers):
        in_shape = shapes[k]
        v0 = state.get(k) if state is not None else None
        if v0 is None or tuple(v0.shape) != in_shape:
            v0 = torch.randn(in_shape, dtype=dtype, device=x.device, generator=generator)
        v = v0.to(dtype).expand(batch, *in_shape).clone()
        if conv_backend == "native" and conv_power.native_conv_ok(layer):
            weight = layer.weight.to(dtype)
            out_mask = bounds.masks[k]
            factor = conv_power.input_factor(bounds.in_mask(k), scale if k == 0 else None, in_shape, dtype)
            with torch.no_grad():
                for _ in range(power_iters):
                    v = conv_power.masked_conv_gram(v, weight.detach(), layer, out_mask=out_mask, in_factor=factor,
                                                    backend="native")
                    v = v / v.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, *([1] * (v.ndim - 1)))
            norm = conv_power.masked_conv_norm(v, weight, layer, out_mask=out_mask, in_factor=factor, backend="native")
        else:
            op = MaskedAffine(layer, in_shape, out_mask=bounds.masks[k], in_mask=bounds.in_mask(k),
                              in_scale=scale if k == 0 else None, batch=batch, dtype=dtype)
            with torch.no_grad():
                frozen = copy.copy(op)  # the same operator on detached weights: the power steps carry no gradient
                frozen.weight = op.weight.detach()
                for _ in range(power_iters):
                    v = frozen.gram_matvec(v)
                    v = v / v.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, *([1] * (v.ndim - 1)))
            norm = op.matvec(v).flatten(1).norm(dim=1)
        estimate = estimate * norm / v.flatten(1).norm(dim=1).clamp_min(1e-30)
        if state is not None:
            state.absorb_batch(k, v)
    return estimate
