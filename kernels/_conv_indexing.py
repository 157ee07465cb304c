"""The implicit-GEMM index arithmetic the convolution kernels share (masked_conv2d.py, first_layer_bounds.py):
a flattened pixel index to its (sample, pixel, row, column), and a flattened tap index to its (channel, kernel row,
kernel column). Triton device functions, inlined into the kernels that call them; this module imports triton, so the
kernel files import it only where they build their kernels (importing a kernel file never imports triton)."""
from __future__ import annotations

import triton
import triton.language as tl

#: Triton's interpreter (TRITON_INTERPRET=1) patches the ``triton.language`` it finds among a device function's
#: globals, and refuses a function without one; these helpers need no ``tl`` call, so it is named here.
INTERPRETER_LANGUAGE = tl


@triton.jit
def pixel_of(m, HEIGHT, WIDTH):
    """``(b, p, y, x)`` of the flattened index ``m = b·HEIGHT·WIDTH + p`` with ``p = y·WIDTH + x``."""
    spatial = HEIGHT * WIDTH
    b = m // spatial
    p = m - b * spatial
    y = p // WIDTH
    x = p - y * WIDTH
    return b, p, y, x


@triton.jit
def tap_of(k, KH, KW):
    """``(c, ky, kx)`` of the flattened tap ``k = (c·KH + ky)·KW + kx`` — the order of a ``Conv2d`` weight's
    ``[C_in, KH, KW]`` (or, for the transpose, of ``[C_out, KH, KW]``) entries."""
    taps = KH * KW
    c = k // taps
    ky = (k - c * taps) // KW
    kx = k - c * taps - ky * KW
    return c, ky, kx
