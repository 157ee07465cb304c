"""Pre-activation bounds of ``f_L`` over the l2 ball ``B(x, γ)`` and the varying masks ``I^v``.

First affine layer: the exact ball bound ``w_i·x + b_i ± γ‖w_i‖₂`` with ``1/sd`` folded into ``w_i`` and, for a
convolution, ``‖w_i‖₂`` taken over the filter taps that land inside the image (zero padding stays zero in
standardized space, so padded taps never see the perturbation). Deeper layers: interval arithmetic in
center/radius form, ``c' = W c + b``, ``r' = |W| r``; a max-pool between layers pools the interval's ends
(:func:`pool_interval`).

For certificates everything is computed in float64 and every interval is widened by a margin that dominates the
rounding error of the sums that formed it (``1e-10 · (|W||h| + |b| + r)``, far above ``K·u₆₄`` for any layer with
fewer than 10⁵ terms per output), so a neuron is never declared constant because of rounding. A relative margin
cannot cover underflow, so a ball radius in ``(0, GAMMA_FLOOR)`` is bounded as the ball of radius ``GAMMA_FLOOR``
(a superset: its bound holds on the smaller ball); then ``γ‖w_i‖`` stays a normal float64 number for every weight
row of norm above 1e-200, and never rounds to an exact 0 that would declare a varying neuron constant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .._checks import check_tensor
from ..kernels import select_backend
from ..kernels.first_layer_bounds import first_layer_bounds
from ..kernels.interval_clip import interval_clip
from ..kernels.thresholds import theta_broadcast, theta_mode
from ..model.layers import rule_for
from ..model.modules import LeftHalf

# Relative widening of every interval (see module docstring).
ROUNDING_MARGIN = 1e-10
# The smallest positive ball radius bounded as given; smaller ones are bounded as this one (see module docstring).
GAMMA_FLOOR = 1e-100


def linear_part(layer: nn.Module, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the linear part of an affine layer (no bias), optionally with another weight (e.g. ``|W|`` or ``W²``)."""
    w = layer.weight if weight is None else weight
    return rule_for(layer).linear_part(layer, h, w.to(h.dtype))


def affine(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Apply the whole affine layer (bias included) in ``h``'s dtype."""
    out = linear_part(layer, h)
    if layer.bias is not None:
        b = layer.bias.to(h.dtype)
        out = out + (b.view(1, -1, 1, 1) if out.ndim == 4 else b)
    return out


def bias_magnitude(layer: nn.Module, like: torch.Tensor) -> torch.Tensor | float:
    if layer.bias is None:
        return 0.0
    b = layer.bias.detach().to(like.dtype).abs()
    return b.view(1, -1, 1, 1) if like.ndim == 4 else b


def input_scale(left: LeftHalf, x: torch.Tensor) -> torch.Tensor | None:
    """``1/sd`` shaped like one input ``[1, *input_shape]``, or ``None`` without standardization."""
    if left.standardize is None:
        return None
    return left.standardize.inverse_std(x).expand_as(x[:1]).to(x.dtype)


def first_layer_row_norms(layer: nn.Module, scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """‖w_i D‖₂ for every neuron ``i`` of the first layer, restricted to taps inside the input: ``[1, *out_shape]``.

    Computed as ``sqrt(W² ⊛ s²)`` where ``s`` is ``1/sd`` inside the image (1 without standardization) and the
    convolution's zero padding supplies the 0 outside it.
    """
    s2 = torch.ones_like(x[:1]) if scale is None else scale.square()
    w2 = layer.weight.detach().to(x.dtype).square()
    return linear_part(layer, s2, weight=w2).clamp_min(0).sqrt()


def squared_row_norms(layer: nn.Module, scale: torch.Tensor | None, input_shape: tuple[int, ...]) -> torch.Tensor:
    """``Σ_j W_ij² d_j²`` for every neuron ``i`` of a first layer, ``[1, *out_shape]``: ``‖w_i D‖₂²`` with ``D`` the
    input scale ``1/sd`` (``None``: 1) on ``input_shape`` and the taps outside the image left out (the convolution's
    zero padding); one convolution with ``W²`` in the weight's dtype, differentiable in the weights. For training
    objectives and measurements (certificates use :func:`first_layer_row_norms`, in float64 on detached weights)."""
    d2 = (torch.ones((1, *input_shape), dtype=layer.weight.dtype, device=layer.weight.device) if scale is None
          else scale.to(layer.weight.dtype).square())
    return linear_part(layer, d2, weight=layer.weight.square())


def masked_frobenius_sq(layer: nn.Module, masks: torch.Tensor, scale: torch.Tensor | None,
                        input_shape: tuple[int, ...]) -> torch.Tensor:
    """``‖M W D‖_F² = Σ_i m_i ‖w_i D‖₂²`` per input, ``[B]``: the squared Frobenius norm — the sum of the squared
    singular values — of a first layer's masked operator (``M`` the ``[B, *out_shape]`` varying mask; see
    :func:`squared_row_norms`). For measurements and training objectives; no certificate reads it."""
    rows = squared_row_norms(layer, scale, input_shape)
    return (rows * masks.to(rows.dtype)).flatten(1).sum(1)


@dataclass
class BallBounds:
    """Bounds of every pre-activation of ``f_L`` over ``B(x, γ)``.

    Attributes:
        lower, upper: per affine layer ``k``, ``[B, *shape_k]`` float64 bounds on the pre-activation ``z_k``.
        masks: per layer, ``[B, *shape_k]`` bool, True where the neuron is *varying* over the ball
            (``UB > 0`` and ``LB < θ``; all True for a layer without activation).
        input_scale: ``1/sd`` as ``[1, *input_shape]`` (``None`` without standardization), folded into layer 1.
        gamma: ``[B]`` float64 ball radii, in raw input units.
        in_masks: per layer, the varying mask of its input (see :meth:`in_mask`).
    """

    lower: list[torch.Tensor]
    upper: list[torch.Tensor]
    masks: list[torch.Tensor]
    input_scale: torch.Tensor | None
    gamma: torch.Tensor
    in_masks: list[torch.Tensor | None]

    def rows(self, start: int, stop: int) -> "BallBounds":
        """The bounds of inputs ``start .. stop − 1`` of the batch (every per-input tensor sliced, views)."""
        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return BallBounds(lower=[part(t) for t in self.lower], upper=[part(t) for t in self.upper],
                          masks=[part(t) for t in self.masks], input_scale=self.input_scale,
                          gamma=self.gamma[start:stop], in_masks=[part(t) for t in self.in_masks])

    def in_mask(self, k: int) -> torch.Tensor | None:
        """The varying mask of layer ``k``'s *input* (``None`` for the first layer): the previous layer's mask, or,
        after a max-pool, :func:`pool_interval`'s mask of the pooled activations."""
        return self.in_masks[k]


def _as_gamma(gamma: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    # Checked where γ is given (the radius search's are host tensors): no device sync for it.
    g = torch.as_tensor(gamma, dtype=torch.float64).flatten()
    if g.numel() == 1:
        g = g.expand(batch)
    if g.numel() != batch:
        raise ValueError(f"gamma must be a scalar or have one value per input ({batch}), got {g.numel()} values")
    if not bool((torch.isfinite(g) & (g >= 0)).all()):
        raise ValueError("gamma must be finite and >= 0")
    g = torch.where(g > 0, g.clamp(min=GAMMA_FLOOR), g)  # a fresh tensor: the caller's γ is never written
    return g.to(device)


def _first_layer(left: LeftHalf, layer: nn.Module, x: torch.Tensor, gamma: torch.Tensor, theta, rigorous: bool,
                 need_next: bool):
    """Layer 1 of :func:`ball_bounds` through the fused op; a Linear first layer sees the flattened input."""
    # Per element, so that a Linear on a flattened image gets its own entries.
    mean, std = (None, None) if left.standardize is None else left.standardize.per_element(x)
    if rule_for(layer).flattens_input and x.ndim > 2:
        x, mean, std = x.flatten(1), None if mean is None else mean.flatten(), None if std is None else std.flatten()
    return first_layer_bounds(x, layer, gamma, theta, mean=mean, std=std,
                              rel_rounding=ROUNDING_MARGIN if rigorous else 0.0, need_next=need_next,
                              backend=select_backend("first_layer_bounds", x.device))


def pool_interval(
    pool: nn.MaxPool2d, center: torch.Tensor, radius: torch.Tensor, theta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The interval of max-pooled activations, from the center/radius interval of the activations before the pool.

    Max-pooling is monotone, so ``[pool(lo), pool(hi)]`` bounds the pooled values. ``lo``/``hi`` are rebuilt from
    ``center ∓ radius`` and widened by ``8u(|c| + r)`` where ``r > 0`` — more than the rounding of ``c``, ``r`` and the
    rebuild (≈ 3.1u) — while a constant activation (``r = 0`` exactly: ``c`` is then its exact value) stays exact.
    Clipped-ReLU outputs lie in ``[0, θ]``, so the interval is clamped to it (a window whose maximum is saturated at θ
    then stays constant). Returns the pooled center, radius and varying mask (``hi > lo``: a pooled output whose
    interval is a point is constant over the ball, so its row of the Jacobian is zero); ``c ∓ r`` evaluated in
    floating point encloses every pooled value.
    """
    unit = torch.finfo(center.dtype).eps / 2
    widen = torch.where(radius > 0, 8 * unit * (center.abs() + radius), torch.zeros_like(radius))
    lo = center - radius - widen
    hi = center + radius + widen
    mode, values = theta_mode(theta, center)
    if mode != 0:
        lo = lo.clamp_min(0)
        hi = torch.minimum(hi, theta_broadcast(mode, values, center))
    lo, hi = pool(lo), pool(hi)
    varying = hi > lo
    center, radius = (lo + hi) / 2, (hi - lo) / 2
    # Widen the varying outputs once more (4u(|c| + r) > the rounding of c, r and of evaluating c ∓ r), so that the
    # float expressions c ∓ r themselves enclose [lo, hi]; constant outputs keep r = 0 and their exact value c.
    radius = radius + torch.where(varying, 4 * unit * (center.abs() + radius), torch.zeros_like(radius))
    return center, radius, varying


@torch.no_grad()
def ball_bounds(
    left: LeftHalf, x: torch.Tensor, gamma: float | torch.Tensor, dtype: torch.dtype = torch.float64
) -> BallBounds:
    """Pre-activation bounds and varying masks of ``f_L`` over ``B(x, γ)`` for a batch ``x: [B, *input_shape]``.

    ``gamma`` is a scalar or a ``[B]`` tensor (one radius per input), in raw input units. Certificates use the
    default float64; the training estimate passes float32 for speed (its masks need not be rigorous).
    """
    left.check_structure()
    shape = left.input_shape
    check_tensor("x", x, ndim=None if shape is None else len(shape) + 1, shape_tail=shape)
    x64 = x.detach().to(dtype)
    g = _as_gamma(gamma, x.shape[0], x.device).to(dtype)
    scale = input_scale(left, x64)
    lower: list[torch.Tensor] = []
    upper: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    in_masks: list[torch.Tensor | None] = [None]
    # Certificates (float64) get the rounding margin; the training estimate's float32 masks need not be rigorous.
    rigorous = dtype == torch.float64
    last = left.depth - 1
    backend = select_backend("interval_clip", x.device)
    center = radius = None  # the interval leaving layer k (set by the first layer's pass)
    for k, layer in enumerate(left.layers):
        act = left.activation(k)
        theta = None if act is None else act.threshold.detach()
        if k == 0:
            # Exact ball bound |w_i·(x' − x)| ≤ γ‖w_i D‖ for ‖x' − x‖ ≤ γ, standardization, the rounding margin, the
            # mask and the clipped interval in one pass (kernels/first_layer_bounds.py: Triton on CUDA).
            step = _first_layer(left, layer, x64, g, theta, rigorous, need_next=k < last)
        else:
            abs_w = layer.weight.detach().to(dtype).abs()
            z = affine(layer, center)
            r = linear_part(layer, radius, weight=abs_w)
            margin = None
            if rigorous:
                magnitude = linear_part(layer, center.abs() + radius, weight=abs_w)
                margin = ROUNDING_MARGIN * (magnitude + bias_magnitude(layer, z) + r)
            # One fused pass: [lo, up] = z ∓ (r + margin), the varying mask (up > 0, lo < θ), and the clipped
            # interval's center/radius for the next layer (Triton on CUDA, kernels/interval_clip.py's reference
            # elsewhere).
            step = interval_clip(z, r, theta, margin=margin, need_next=k < last, backend=backend)
        lower.append(step.lower)
        upper.append(step.upper)
        masks.append(step.mask)
        center, radius = step.center, step.radius
        if k < last:
            next_in_mask = step.mask
            pool = left.pool(k)
            if pool is not None:
                center, radius, next_in_mask = pool_interval(pool, center, radius, theta)
            in_masks.append(next_in_mask)
    return BallBounds(lower=lower, upper=upper, masks=masks, input_scale=scale, gamma=g, in_masks=in_masks)
