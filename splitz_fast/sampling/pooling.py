"""The 2x2 max pool of a prepared ``f_R`` on the CPU: two elementwise maxima of strided views.

``F.max_pool2d(x, 2)`` (kernel 2, stride 2, no padding, floor mode) computed as the maximum of rows, then of columns:
the same values bitwise (max is exact; NaN propagates through both), without the index bookkeeping of ATen's CPU
pool, and written in the layout asked for (channels_last where the next convolution reads it, NCHW where a Flatten
follows and is then a view). Measured on the CPU, one thread: the pool after LeNet's first convolution 105 → 8 us per
sample in NCHW, 8.5 → 4.1 in channels_last (:func:`~splitz_fast.sampling.prepared._cheaper_chain`, which puts it in
the chain; :class:`~splitz_fast.sampling.epilogues.ConvReLUMaxPool2` pools its unfused form with it on the CPU).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def max_pool2x2(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``F.max_pool2d(x, 2)`` bitwise, a 4-D result written channels_last when ``channels_last``, else contiguous."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2  # floor mode: an odd last row/column is dropped
    rows = torch.maximum(x[..., 0:h:2, :w], x[..., 1:h:2, :w])
    if x.ndim != 4 or (x.requires_grad and torch.is_grad_enabled()):  # out= is not differentiable
        return torch.maximum(rows[..., 0::2], rows[..., 1::2])
    layout = torch.channels_last if channels_last else torch.contiguous_format
    if torch.compiler.is_compiling():
        # under torch.compile in inference mode out='s layout is lost (inductor then views a channels_last result
        # as NCHW at the Flatten, and fails): the layout is asked for instead
        return torch.maximum(rows[..., 0::2], rows[..., 1::2]).contiguous(memory_format=layout)
    out = torch.empty((*x.shape[:2], h // 2, w // 2), dtype=x.dtype, device=x.device, memory_format=layout)
    return torch.maximum(rows[..., 0::2], rows[..., 1::2], out=out)


class MaxPool2x2(nn.Module):
    """:func:`max_pool2x2` as a layer of the prepared chain, its output layout fixed at construction."""

    def __init__(self, channels_last: bool):
        super().__init__()
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return max_pool2x2(x, self.channels_last)

    def extra_repr(self) -> str:
        return f"kernel_size=2, stride=2, channels_last={self.channels_last}"


__all__ = ["MaxPool2x2", "max_pool2x2"]
