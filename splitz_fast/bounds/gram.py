"""The float64 Gram matrix of a masked factor ``A_b`` of ``f_L`` (:class:`~splitz_fast.bounds.operators.MaskedAffine`),
restricted to its varying side, for the exact bound of :func:`~splitz_fast.bounds.certificate.certified_lambda_max`: dense for
a Linear factor, banded and sparse for a convolution (:func:`conv_gram`), with the count of rounded products per entry
that the certificate's rounding terms need; and the cost model that decides between the exact and the probabilistic
bound (:func:`exact_cost`).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .operators import MaskedAffine

# How a convolution Gram goes to the certificate: banded sparse CSR (panel Cholesky) or densified (dense Cholesky).
# Measured on the 2-core CPU (whole exact bound of LeNet conv1, d ≤ 784, γ = 0.1 / 0.5, best of 30 on a loaded
# machine): banded 33 / 34 ms, dense 83 / 108 ms (the dense Gram before the banded one: 92 / 87 ms). So on the CPU
# every convolution Gram goes banded. On CUDA, Grams up to this dimension stay dense (device eigvalsh + Cholesky:
# 14 ms for LeNet conv1 on an H200, DEVICE_DENSE_MAX_DIM in certificate.py), banded above.
CUDA_DENSE_GRAM_MAX_DIM = 1024


def exact_cost(op: MaskedAffine) -> tuple[int, float]:
    """``(d, flops)``: the largest Gram dimension of the batch (after masking) and an estimate of the floating-point
    operations of one exact bound of that size (:func:`factor_gram` plus
    :func:`~splitz_fast.bounds.certificate.certified_lambda_max`), from the shapes and masks alone.

    * Linear, or a convolution Gram handed over dense (CUDA, ``d ≤ CUDA_DENSE_GRAM_MAX_DIM``): the Gram product
      plus ``d³`` (eigensolver and Cholesky).
    * Banded convolution Gram: building the half stencil (``C_out·C_in²·kh·kw·P``), then with half-bandwidth
      ``b`` — estimated as the band of :func:`conv_gram` thinned by the fraction of varying inputs — the panel
      Cholesky (``≈ 3.3·d·b²``) and about 200 ARPACK products with the ``≈ d·b``-entry Gram (``400·d·b``).
    """
    n_in = math.prod(op.in_shape)
    varying_in = n_in if op.in_mask is None else int(op.in_mask.flatten(1).sum(1).max())
    if not op.rule.banded_gram:
        n_out = op.rule.out_features(op.layer)
        varying_out = n_out if op.out_mask is None else int(op.out_mask.flatten(1).sum(1).max())
        d = min(varying_in, varying_out)
        return d, 2.0 * varying_in * varying_out * d + float(d) ** 3
    c_out, c_in, kh, kw = op.weight.shape
    _, h_in, w_in = op.in_shape
    _, h_out, w_out = op.out_shape
    d = varying_in
    build = float(c_out) * c_in * c_in * kh * kw * h_out * w_out
    if _dense_conv_gram(op, d):
        return d, build + float(d) ** 3
    reach_h, reach_w = (kh - 1) * op.layer.dilation[0], (kw - 1) * op.layer.dilation[1]
    span = c_in * (min(reach_h * w_in + reach_w, reach_w * h_in + reach_h) + 1)
    band = min(d, math.ceil(span * d / n_in))
    return d, build + 3.3 * d * band ** 2 + 400.0 * d * band


def _dense_conv_gram(op: MaskedAffine, d: int) -> bool:
    return op.weight.is_cuda and d <= CUDA_DENSE_GRAM_MAX_DIM


def factor_gram(op: MaskedAffine, b: int, sparse: bool | None = None) -> tuple[torch.Tensor, int]:
    """Float64 Gram matrix of ``A_b`` restricted to its varying side, and the rounding-error term count.

    Zero columns of ``A_b`` (inputs outside the input mask) and zero rows (outputs outside the output mask) only
    add zero eigenvalues, so ``λ_max(G) = ‖A_b‖₂²`` for ``G`` = the Gram of the non-zero columns (``AᵀA``) — or of
    the non-zero rows (``AAᵀ``) for a Linear factor whose varying outputs are fewer.

    Returns ``(G, terms)``: ``G`` is ``[d, d]``, ``terms`` bounds the number of products summed into one entry
    (see :func:`~splitz_fast.bounds.certificate.certified_lambda_max`). A Linear factor's ``G`` is dense. A convolution's
    ``G`` is banded (inputs ``i``, ``j`` interact only when one output position covers both): it is returned as a
    sparse CSR tensor holding the **upper triangle** (``col ≥ row``) of ``G`` in the band order of
    :func:`conv_gram` when ``sparse`` is ``True``, or ``None`` except on CUDA up to ``CUDA_DENSE_GRAM_MAX_DIM``;
    otherwise as the dense symmetric ``G`` (same order).
    """
    with torch.no_grad():
        w = op.weight.detach().to(torch.float64)
        out_mask = None if op.out_mask is None else op.out_mask[b if op.out_mask.shape[0] > 1 else 0]
        factor = None
        if op.in_factor is not None:
            factor = op.in_factor[b if op.in_factor.shape[0] > 1 else 0].to(torch.float64)
        if not op.rule.banded_gram:
            return _linear_gram(w, out_mask, factor)
        gram, terms = conv_gram(op, w, out_mask, factor)
        if sparse is False or (sparse is None and _dense_conv_gram(op, gram.shape[0])):
            upper = gram.to_dense()
            gram = upper + upper.triu(1).mT  # exact: each off-diagonal sum adds a zero
        return gram, terms


def _linear_gram(w, out_mask, factor) -> tuple[torch.Tensor, int]:
    a = w
    if out_mask is not None:
        a = a[out_mask.flatten().bool()]
    if factor is not None:
        f = factor.flatten()
        a = a[:, f != 0] * f[f != 0]
    if a.shape[0] < a.shape[1]:  # the smaller Gram has the same largest eigenvalue
        return a @ a.T, a.shape[1]
    return a.T @ a, a.shape[0]


def conv_gram(op: MaskedAffine, w, out_mask, factor) -> tuple[torch.Tensor, int]:
    """Upper triangle of ``AᵀA`` for the convolution, on its varying inputs, as a sparse CSR tensor in band order.

    Construction (never a dense ``n_in × n_in`` array). Write ``A = diag(m) W diag(f)``. Inputs ``i = (c, y, x)``
    and ``j = (c', y', x')`` share a row of ``A`` only if one output position ``p`` has ``i`` under its tap
    ``t = (a, b)`` and ``j`` under tap ``t' = (a', b')``; then ``y' − y = (a' − a)·dil_h`` and
    ``x' − x = (b' − b)·dil_w``, and

        ``G_ij = f_i f_j · Σ_p Σ_o m[o, p] W[o, c, t] W[o, c', t']``  (over the ``p`` that cover both).

    Band order ranks the varying inputs pixel-major (rows, then columns), channel-minor; ``j`` comes after ``i``
    exactly when ``(a' − a, b' − b, c')`` is lexicographically ≥ ``(0, 0, c)``, i.e. ``t' ≥ t`` in row-major tap
    order. So the upper triangle lives on a half stencil ``S[y, x, c, a' − a, b' − b, c']`` with
    ``a' − a ∈ [0, kh)``, ``b' − b ∈ (−kw, kw)``: per tap ``t``, one GEMM over all output positions
    (``[P·C_in, C_out] @ [C_out, C_in·#{t' ≥ t}]``) gives the ``(t, t')`` blocks, added into ``S`` by strided
    slices (padding taps fall outside the slices; :func:`_tapwise_stencil`), or, on the devices of
    :data:`GATHERED_STENCIL_DEVICES`, all blocks as one product and each entry of ``S`` as one gathered sum
    (:func:`_gathered_stencil`: the same products, in ten launches instead of hundreds). ``S`` is then gathered at
    the varying pairs and scaled by ``f_i f_j``. Within a row the stencil order ``(a' − a, b' − b, c')`` is the rank order, so the CSR columns
    come out sorted. The image is transposed first when scanning columns gives the narrower band: a row reaches
    at most ``C_in·((kh − 1)·dil_h·W + (kw − 1)·dil_w + 1)`` ranks ahead, and the banded Cholesky of
    :func:`~splitz_fast.bounds.certificate.certified_lambda_max` costs about ``d·band²``.

    ``terms``: an entry sums ``C_out`` products per covering position and at most ``kh·kw`` positions cover a
    pair, so at most ``C_out·kh·kw`` products, in whatever grouping the GEMMs and the additions use; the
    masks are 0/1 (exact), and the scaling by ``f_i`` and ``f_j`` adds the two roundings that ``γ_{terms+2}``
    covers.
    """
    c_in, h_in, w_in = op.in_shape
    c_out, _, kh, kw = w.shape
    _, h_out, w_out = op.out_shape
    (sh, sw), (ph, pw), (dh, dw) = op.layer.stride, op.layer.padding, op.layer.dilation
    m = torch.ones(c_out, h_out, w_out, dtype=torch.float64, device=w.device)
    if out_mask is not None:
        m = out_mask.reshape(c_out, h_out, w_out).to(torch.float64)
    scale = torch.ones(c_in, h_in, w_in, dtype=torch.float64, device=w.device)
    if factor is not None:
        scale = factor.reshape(c_in, h_in, w_in)
    if (kh - 1) * dh * w_in + (kw - 1) * dw > (kw - 1) * dw * h_in + (kh - 1) * dh:
        # Scanning columns first gives the narrower band: transpose the whole problem.
        w, m, scale = w.transpose(2, 3), m.transpose(1, 2), scale.transpose(1, 2)
        (h_in, w_in), (h_out, w_out), (kh, kw) = (w_in, h_in), (w_out, h_out), (kw, kh)
        (sh, sw), (ph, pw), (dh, dw) = (sw, sh), (pw, ph), (dw, dh)
    geometry = (h_in, w_in, h_out, w_out, kh, kw, sh, sw, ph, pw, dh, dw, c_in)
    if _gathers_stencil(geometry, w.device):
        stencil = _gathered_stencil(m, w, geometry)
    else:
        stencil = _tapwise_stencil(m, w, geometry)
    scale = scale.permute(1, 2, 0).reshape(-1)  # band order [y, x, c]
    varying = scale != 0
    d = int(varying.sum())
    # rank of each input in band order; non-varying: −1 as a neighbour, +∞ as a row (so it keeps no entry)
    reach_h, reach_w = (kh - 1) * dh, (kw - 1) * dw
    rank = torch.full((h_in + reach_h, w_in + 2 * reach_w, c_in), -1, dtype=torch.long, device=w.device)
    ranks = torch.where(varying, varying.cumsum(0) - 1, -1)
    rank[:h_in, reach_w:reach_w + w_in] = ranks.reshape(h_in, w_in, c_in)
    # neighbour[y, x, a' − a, b' − b + kw − 1, c'] = rank of input (c', y + (a' − a)·dil_h, x + (b' − b)·dil_w)
    neighbour = rank.unfold(0, reach_h + 1, 1)[..., ::dh].unfold(1, 2 * reach_w + 1, 1)[..., ::dw]
    neighbour = neighbour.permute(0, 1, 3, 4, 2).reshape(h_in * w_in, 1, -1)
    row_key = torch.where(varying, ranks, torch.iinfo(torch.long).max).reshape(h_in * w_in, c_in, 1)
    keep = neighbour >= row_key  # [pixel, c, (a' − a, b' − b, c')]: the upper triangle's entries
    flat = keep.reshape(-1).nonzero().squeeze(1)
    per_pixel = neighbour.shape[2]
    row_input = flat // per_pixel  # index of input i in band order (varying or not)
    col = neighbour.reshape(-1)[(row_input // c_in) * per_pixel + flat % per_pixel]
    values = stencil.reshape(-1)[flat] * scale[row_input] * scale[varying][col]
    counts = keep.sum(2).reshape(-1)[varying]
    crow = torch.zeros(d + 1, dtype=torch.long, device=w.device)
    crow[1:] = counts.cumsum(0)
    with warnings.catch_warnings():
        # Torch labels its (working) CSR support "beta", once per process; some versions (2.11) also warn that its
        # invariant checks are off unless opted in or out globally: the indices above are valid by construction,
        # checked against the dense Gram in the tests, and the opt-out is explicit here.
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        gram = torch.sparse_csr_tensor(crow, col, values, size=(d, d), check_invariants=False)
    return gram, c_out * kh * kw


# Where conv_gram gathers its half stencil in one pass (_gathered_stencil) instead of summing it tap by tap
# (_tapwise_stencil), while the gather's tables (the per-position blocks and the index) stay within
# GATHER_MAX_ENTRIES entries each. Counted (torch dispatcher calls per Gram): LeNet's 5x5 conv1 2228 tap by tap vs 14
# gathered, CIFAR's 3x3 stem 446 vs 15 — on CUDA each is a launch or at least its host overhead, so CUDA gathers. On
# the 2-core CPU neither wins throughout (best of 20, 2 threads: LeNet conv1 2.4 ms gathered vs 4.9 ms; CIFAR stem
# 4.1 vs 2.2 ms; with 1 thread the tap-by-tap sum is ahead on both), so the CPU keeps the tap-by-tap sum.
GATHERED_STENCIL_DEVICES: frozenset[str] = frozenset({"cuda"})
GATHER_MAX_ENTRIES = 1 << 23


def _gathers_stencil(geometry: tuple[int, ...], device: torch.device) -> bool:
    h_in, w_in, h_out, w_out, kh, kw, *_, c_in = geometry
    k = kh * kw * c_in
    return (device.type in GATHERED_STENCIL_DEVICES and h_out * w_out * k * k <= GATHER_MAX_ENTRIES
            and h_in * w_in * c_in * kh * (2 * kw - 1) * c_in * kh * kw <= GATHER_MAX_ENTRIES)


def _gathered_stencil(m: torch.Tensor, w: torch.Tensor, geometry: tuple[int, ...]) -> torch.Tensor:
    """The half stencil ``S[y, x, c, a' − a, b' − b, c']`` of :func:`conv_gram` in one pass: per output position
    ``p`` all tap-pair blocks ``B[p, (t, c), (t', c')] = Σ_o m[o, p] W[o, c, t] W[o, c', t']`` as one product, then
    every stencil entry the sum of its (at most ``kh·kw``) blocks, one per tap ``t`` of its first input
    (:func:`_stencil_index`). The same products as :func:`_tapwise_stencil`, each rounded once, summed in another
    order (``terms`` of :func:`conv_gram` covers any order)."""
    h_in, w_in, h_out, w_out, kh, kw, *_, c_in = geometry
    c_out = w.shape[0]
    k = kh * kw * c_in
    w_flat = w.permute(0, 2, 3, 1).reshape(c_out, k)  # [o, (t, c)]
    pairs = (w_flat[:, :, None] * w_flat[:, None, :]).reshape(c_out, k * k)
    blocks = m.reshape(c_out, h_out * w_out).T @ pairs  # [p, (t, c, t', c')]; m is 0/1: exact
    padded = torch.cat([blocks.reshape(-1), blocks.new_zeros(1)])  # the last entry: "no block"
    return padded[_stencil_index(geometry, str(w.device))].sum(-1)


@functools.lru_cache(maxsize=32)
def _stencil_index(geometry: tuple[int, ...], device: str) -> torch.Tensor:
    """``[h_in, w_in, c_in, kh, 2kw − 1, c_in, kh·kw]`` indices into the flattened blocks of
    :func:`_gathered_stencil` (``P·K²`` = "no block"): entry ``[y, x, c, da, db + kw − 1, c', t]`` is the block of
    the output position where tap ``t = (a, b)`` reads input ``(y, x)`` and tap ``t' = (a + da, b + db)`` reads
    ``(y + da·dil_h, x + db·dil_w)``, for ``t' ≥ t`` in row-major order with both taps inside the image — exactly
    the blocks that :func:`_tapwise_stencil` adds into that entry."""
    h_in, w_in, h_out, w_out, kh, kw, sh, sw, ph, pw, dh, dw, c_in = geometry
    k = kh * kw * c_in
    y = torch.arange(h_in).view(-1, 1, 1, 1, 1, 1)
    x = torch.arange(w_in).view(1, -1, 1, 1, 1, 1)
    da = torch.arange(kh).view(1, 1, -1, 1, 1, 1)
    db = torch.arange(-(kw - 1), kw).view(1, 1, 1, -1, 1, 1)
    a = torch.arange(kh).view(1, 1, 1, 1, -1, 1)
    b = torch.arange(kw).view(1, 1, 1, 1, 1, -1)
    a2, b2 = a + da, b + db
    i_num, j_num = y + ph - a * dh, x + pw - b * dw  # output row/column times the stride
    valid = ((a2 < kh) & (b2 >= 0) & (b2 < kw) & ((da > 0) | (db >= 0))  # t' is a tap, t' ≥ t
             & (i_num >= 0) & (i_num % sh == 0) & (i_num // sh < h_out)
             & (j_num >= 0) & (j_num % sw == 0) & (j_num // sw < w_out)
             & (y + da * dh < h_in) & (x + db * dw >= 0) & (x + db * dw < w_in))
    p = (i_num // sh) * w_out + j_num // sw
    base = p * k * k + (a * kw + b) * c_in * k + (a2 * kw + b2) * c_in  # channels c = c' = 0
    base = torch.where(valid, base, -1).flatten(4)  # [y, x, da, db, t]
    channels = (torch.arange(c_in).view(-1, 1) * k + torch.arange(c_in)).view(1, 1, c_in, 1, 1, c_in, 1)
    index = base[:, :, None, :, :, None, :] + channels
    index = torch.where(base[:, :, None, :, :, None, :] >= 0, index, h_out * w_out * k * k)
    return index.to(device)


def _tapwise_stencil(m: torch.Tensor, w: torch.Tensor, geometry: tuple[int, ...]) -> torch.Tensor:
    """The half stencil of :func:`conv_gram` tap by tap: per tap ``t`` one product over all output positions gives
    the ``(t, t' ≥ t)`` blocks, added into ``S`` by strided slices (padding taps fall outside the slices)."""
    h_in, w_in, h_out, w_out, kh, kw, sh, sw, ph, pw, dh, dw, c_in = geometry
    c_out = w.shape[0]
    taps = kh * kw
    w_taps = w.permute(0, 2, 3, 1).reshape(c_out, taps, c_in)  # [o, t', c']
    stencil = torch.zeros(h_in, w_in, c_in, kh, 2 * kw - 1, c_in, dtype=torch.float64, device=w.device)
    for t in range(taps):
        a, b = divmod(t, kw)
        # blocks[i, j, c, t' − t, c'] = Σ_o m[o, i, j] W[o, c, t] W[o, c', t'] at output position (i, j), t' ≥ t
        lhs = (m[:, :, :, None] * w_taps[:, None, None, t, :]).reshape(c_out, -1)
        blocks = (lhs.T @ w_taps[:, t:].reshape(c_out, -1)).view(h_out, w_out, c_in, taps - t, c_in)
        for t2 in range(t, taps):
            a2, b2 = divmod(t2, kw)
            rows = _covered(h_out, sh, ph, dh, (a, a2), h_in)
            cols = _covered(w_out, sw, pw, dw, (b, b2), w_in)
            if rows is None or cols is None:
                continue
            (i0, i1, y0), (j0, j1, x0) = rows, cols
            target = stencil[y0:y0 + (i1 - i0 - 1) * sh + 1:sh, x0:x0 + (j1 - j0 - 1) * sw + 1:sw, :,
                             a2 - a, b2 - b + kw - 1, :]
            target += blocks[i0:i1, j0:j1, :, t2 - t, :]
    return stencil


def _covered(n_out: int, stride: int, pad: int, dil: int, taps: tuple[int, int], size: int):
    """Output positions ``i0 ≤ i < i1`` (along one axis) at which both ``taps`` land inside ``[0, size)``, and the
    input coordinate ``y0`` of the first tap at ``i0``; ``None`` when there is none."""
    low, high = min(taps) * dil, max(taps) * dil
    i0 = max(0, -((low - pad) // stride))  # ceil((pad − low)/stride)
    i1 = min(n_out, (size - 1 + pad - high) // stride + 1)
    if i1 <= i0:
        return None
    return i0, i1, i0 * stride - pad + taps[0] * dil
