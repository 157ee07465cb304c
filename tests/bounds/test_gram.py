"""The restricted Gram of a masked factor ``I_out W I_in`` and its certificate, against dense float64 oracles.

The oracle builds the explicit masked factor by applying the float64 layer to every basis vector (padding, stride,
dilation and the input scale all come from PyTorch itself), keeps its varying rows and columns, and takes a dense
SVD / eigendecomposition. :meth:`MaskedAffine.gram` must have the oracle's spectrum (it only restricts and reorders
the varying side), and :func:`certified_lambda_max` must bound ``‖A‖₂²`` from above, tightly, on both the dense and
the banded (sparse CSR) path.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import splitz_fast as sz
from splitz_fast.bounds import certificate, gram
from splitz_fast.bounds.certificate import certified_lambda_max
from splitz_fast.bounds.lipschitz import masked_operators
from splitz_fast.bounds.gram import factor_gram
from splitz_fast.bounds.operators import MaskedAffine

# (C_in, C_out, H, W, kernel, stride, padding, dilation)
CONVS = {
    "odd-5x7": (1, 3, 5, 7, 3, 1, 1, 1),
    "stride2-pad1": (2, 3, 7, 6, 3, 2, 1, 1),
    "dilated-asym": (2, 4, 5, 6, (3, 2), (1, 2), (2, 1), (2, 1)),
    "kernel-1x4": (3, 2, 6, 5, (1, 4), 1, (0, 2), 1),
    "kernel-4x1-tall": (2, 2, 9, 4, (4, 1), 1, (1, 0), 1),
    "disjoint-2x2-stride2": (2, 2, 4, 4, 2, 2, 0, 1),
    "one-pixel": (1, 1, 1, 1, 1, 1, 0, 1),
    "kernel-5-on-6x6": (2, 3, 6, 6, 5, 1, 2, 1),
    "stride3-dil2-pad2": (2, 3, 8, 3, 3, 3, 2, 2),
    "wide-4x9": (2, 2, 4, 9, 3, 1, 1, 1),
    # an input dimension of 1 under a wider kernel (the stencil's index tables are not contiguous views there)
    "kernel-2x3-on-2x1": (1, 2, 2, 1, (2, 3), 1, (2, 1), 1),
    "row-of-6-dilated": (1, 2, 1, 6, (1, 2), 3, (1, 0), (2, 3)),
    "row-of-5-kernel-1x4": (1, 2, 1, 5, (1, 4), 1, (0, 2), (3, 2)),
}
MASKS = ["random", "ones", "none", "empty-in", "empty-out", "single-in", "single-out"]


def _masks(kind: str, in_shape, out_shape, gen):
    """(out_mask, in_mask) of one input, ``[1, *shape]`` bool, or ``None`` for "none"."""
    if kind == "none":
        return None, None
    out = torch.rand(1, *out_shape, generator=gen) < 0.5
    inp = torch.rand(1, *in_shape, generator=gen) < 0.5
    if kind == "ones":
        out, inp = torch.ones_like(out), torch.ones_like(inp)
    elif kind == "empty-in":
        inp = torch.zeros_like(inp)
    elif kind == "empty-out":
        out = torch.zeros_like(out)
    elif kind == "single-in":
        inp = torch.zeros_like(inp)
        inp.view(-1)[inp.numel() // 2] = True
    elif kind == "single-out":
        out = torch.zeros_like(out)
        out.view(-1)[out.numel() // 3] = True
    return out, inp


def _dense_factor(layer: nn.Module, in_shape, out_mask, in_mask, scale) -> torch.Tensor:
    """The explicit ``[n_out, n_in]`` matrix ``diag(m_out) W diag(scale) diag(m_in)`` in float64, varying rows and
    columns only."""
    n_in = math.prod(in_shape)
    eye = torch.eye(n_in, dtype=torch.float64).view(n_in, *in_shape)
    w = layer.weight.detach().double()
    if isinstance(layer, nn.Conv2d):
        cols = F.conv2d(eye, w, None, layer.stride, layer.padding, layer.dilation)
    else:
        cols = eye.flatten(1) @ w.T
    a = cols.flatten(1).T  # [n_out, n_in]
    f = torch.ones(n_in, dtype=torch.float64) if scale is None else scale.double().expand(1, *in_shape).flatten()
    if in_mask is not None:
        f = f * in_mask.flatten().double()
    a = a * f[None, :]
    rows = torch.ones(a.shape[0], dtype=torch.bool) if out_mask is None else out_mask.flatten().bool()
    return a[rows][:, f != 0]


def _check(op: MaskedAffine, dense: torch.Tensor, sparse: bool | None):
    gram, terms = factor_gram(op, 0, sparse=sparse)
    assert gram.dtype == torch.float64
    if sparse:
        assert gram.layout == torch.sparse_csr
    # A convolution's Gram is on its varying inputs; a Linear's on the smaller varying side.
    d = dense.shape[1] if isinstance(op.layer, nn.Conv2d) else min(dense.shape)
    assert gram.shape == (d, d)
    side = dense.T @ dense if d == dense.shape[1] else dense @ dense.T
    # Same spectrum as the oracle's Gram (a reordering of the varying side).
    if sparse:  # the upper triangle of G
        upper = gram.to_dense()
        assert torch.equal(upper, upper.triu())
        gram_dense = upper + upper.triu(1).mT
    else:
        gram_dense = gram
    ours = torch.linalg.eigvalsh(gram_dense)
    top = float(side.abs().max()) if side.numel() else 0.0
    torch.testing.assert_close(ours, torch.linalg.eigvalsh(side), rtol=0, atol=1e-12 * (1 + top))
    # A proven, tight bound on ‖A‖₂².
    true_sq = float(torch.linalg.matrix_norm(dense, ord=2)) ** 2 if dense.numel() else 0.0
    # Sparse: densified (the default at these sizes, DENSE_CHOLESKY_MAX_DIM), and the banded Cholesky in one panel and
    # in many (BAND_BLOCK_MIN = 1 or 3: panels of max(BAND_BLOCK_MIN, band) rows, so each panel's update carries into
    # the next).
    variants = [(certificate.DENSE_CHOLESKY_MAX_DIM, certificate.BAND_BLOCK_MIN)]
    if sparse:
        variants += [(0, certificate.BAND_BLOCK_MIN), (0, 1), (0, 3)]
    for dense_max, panel_min in variants:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(certificate, "DENSE_CHOLESKY_MAX_DIM", dense_max)
            patch.setattr(certificate, "BAND_BLOCK_MIN", panel_min)
            bound = certified_lambda_max(gram, terms)
        assert bound >= true_sq
        assert bound <= true_sq * (1 + 1e-9) + 1e-300


@pytest.mark.parametrize("stencil", ["tapwise", "gathered"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("sparse", [False, True])
def test_conv_gram_matches_the_dense_masked_factor(name, mask, sparse, stencil, monkeypatch):
    """Both ways of building the half stencil (tap by tap: the CPU's; gathered in one pass: CUDA's, here forced on
    the CPU) against the explicit matrix, for every geometry and mask."""
    monkeypatch.setattr(gram, "GATHERED_STENCIL_DEVICES", frozenset({"cpu", "cuda"} if stencil == "gathered" else ()))
    c_in, c_out, h, w, kernel, stride, padding, dilation = CONVS[name]
    torch.manual_seed(hash(name) % 1000)
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation)
    in_shape = (c_in, h, w)
    out_shape = tuple(conv(torch.zeros(1, *in_shape)).shape[1:])
    gen = torch.Generator().manual_seed(len(name) + len(mask))
    out_mask, in_mask = _masks(mask, in_shape, out_shape, gen)
    scale = 0.5 + torch.rand(1, c_in, 1, 1, generator=gen)  # a folded 1/sd per input channel
    op = MaskedAffine(conv, in_shape, out_mask=out_mask, in_mask=in_mask, in_scale=scale, batch=1)
    dense = _dense_factor(conv, in_shape, out_mask, in_mask, scale)
    _check(op, dense, sparse)


@pytest.mark.parametrize("geometry", [(1, 32, 28, 5, 0), (1, 32, 28, 3, 1), (3, 16, 32, 3, 1)])
def test_gathered_stencil_sums_the_tapwise_blocks(geometry):
    """At LeNet's and CIFAR's first-layer sizes: the gathered half stencil holds the tap-by-tap one's entries (the
    same products, summed in another order: equal to a few units in the last place) and the same zeros."""
    c_in, c_out, size, k, pad = geometry
    out = size + 2 * pad - k + 1
    shape = (size, size, out, out, k, k, 1, 1, pad, pad, 1, 1, c_in)
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(c_out, c_in, k, k, generator=gen, dtype=torch.float64)
    m = (torch.rand(c_out, out, out, generator=gen) < 0.6).double()
    gathered, tapwise = gram._gathered_stencil(m, w, shape), gram._tapwise_stencil(m, w, shape)
    assert torch.equal(gathered == 0, tapwise == 0)
    torch.testing.assert_close(gathered, tapwise, rtol=0, atol=64 * 2.0 ** -52 * float(tapwise.abs().max()))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", [(7, 4), (4, 9), (1, 1), (12, 12)])
def test_linear_gram_matches_the_dense_masked_factor(shape, mask):
    n_in, n_out = shape
    torch.manual_seed(n_in * 100 + n_out)
    fc = nn.Linear(n_in, n_out)
    gen = torch.Generator().manual_seed(n_in + n_out)
    out_mask, in_mask = _masks(mask, (n_in,), (n_out,), gen)
    scale = 0.5 + torch.rand(1, n_in, generator=gen)
    op = MaskedAffine(fc, (n_in,), out_mask=out_mask, in_mask=in_mask, in_scale=scale, batch=1)
    dense = _dense_factor(fc, (n_in,), out_mask, in_mask, scale)
    _check(op, dense, None)


@pytest.mark.parametrize("panel_min", [1, 2, 5, 64])
@pytest.mark.parametrize("name", ["odd-5x7", "dilated-asym", "kernel-5-on-6x6", "stride3-dil2-pad2"])
def test_banded_cholesky_decides_positive_definiteness(name, panel_min, monkeypatch):
    """``sI − G`` factors exactly when ``s`` is above ``λ_max(G)`` (away from the rounding level), in any panel size;
    and with a far too low eigenvalue estimate the certificate still ends above ``λ_max`` (the shift widens)."""
    c_in, c_out, h, w, kernel, stride, padding, dilation = CONVS[name]
    torch.manual_seed(7)
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation)
    out_shape = tuple(conv(torch.zeros(1, c_in, h, w)).shape[1:])
    out_mask, in_mask = _masks("random", (c_in, h, w), out_shape, torch.Generator().manual_seed(3))
    op = MaskedAffine(conv, (c_in, h, w), out_mask=out_mask, in_mask=in_mask, in_scale=None, batch=1)
    gram, terms = factor_gram(op, 0, sparse=True)
    upper = gram.to_dense()
    top = float(torch.linalg.eigvalsh(upper + upper.triu(1).mT)[-1])
    monkeypatch.setattr(certificate, "BAND_BLOCK_MIN", panel_min)
    cholesky = certificate._BandedCholesky(gram)
    assert cholesky.band > 0 and (panel_min > 5 or cholesky.nb < cholesky.d)
    assert cholesky.succeeds(top * (1 + 1e-6))
    assert not cholesky.succeeds(top * (1 - 1e-6))
    monkeypatch.setattr(certificate, "_upper_eigen_estimate", lambda upper: 0.95 * top)
    monkeypatch.setattr(certificate, "DENSE_CHOLESKY_MAX_DIM", 0)  # the banded path at this small size
    assert top <= certified_lambda_max(gram, terms) <= top * 1.1


def test_banded_certificate_widens_the_shift_on_a_repeated_top_eigenvalue():
    """Disjoint windows (2×2 kernel, stride 2) with a constant filter give a Gram with many equal top eigenvalues."""
    conv = nn.Conv2d(1, 1, 2, stride=2, bias=False)
    with torch.no_grad():
        conv.weight.fill_(0.5)
    op = MaskedAffine(conv, (1, 8, 8), out_mask=None, in_mask=None, in_scale=None, batch=1)
    gram, terms = factor_gram(op, 0, sparse=True)
    assert gram.shape == (64, 64)
    assert 1.0 <= certified_lambda_max(gram, terms) <= 1.0 + 1e-9  # densified
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(certificate, "DENSE_CHOLESKY_MAX_DIM", 0)  # banded
        assert 1.0 <= certified_lambda_max(gram, terms) <= 1.0 + 1e-9


def _lenet_splitz_conv2(gamma: float | None, seed: int = 0):
    """(left half, input, conv2 factor) of lenet-splitz split 2: masked at ``gamma``, or unmasked for ``None``."""
    torch.manual_seed(seed)
    left = sz.build_model("lenet-splitz", split_index=2).left
    x = torch.rand(1, 1, 28, 28, generator=torch.Generator().manual_seed(seed + 1))
    if gamma is None:
        return left, x, masked_operators(left, None, (1, 28, 28), 1, None)[1]
    bounds = sz.ball_bounds(left, x, gamma)
    return left, x, masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[1]


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [0.1, None], ids=["local-0.1", "global"])
def test_lenet_splitz_conv2_gram_is_banded_and_small(gamma):
    """The second convolution of lenet-splitz (input 32×28×28 = 25,088): the Gram is built on the varying inputs only,
    as the upper triangle of a banded CSR matrix of ~100 MB at most, where the dense n_in × n_in Gram took 5 GB; its
    certificate agrees with an independent ARPACK estimate on the operator itself (conv, masks, adjoint)."""
    _, _, op = _lenet_splitz_conv2(gamma)
    d = 25_088 if gamma is None else int(op.in_mask.sum())
    assert 0 < d <= 25_088
    gram, terms = factor_gram(op, 0)
    assert gram.layout == torch.sparse_csr and gram.shape == (d, d)
    nnz = gram.values().numel()
    # upper half of a row's 5×5-pixel, 32-channel neighbourhood: 12 pixels after it, and channels c' ≥ c of its own
    assert nnz <= d * (12 * 32 + 32)
    assert nnz * (8 + 8) < 1.5e8  # values and column indices: bytes, against 25,088² · 8 B ≈ 5.0 GB dense
    assert terms == 64 * 3 * 3
    bound = certified_lambda_max(gram, terms)
    reference = _operator_lambda_max(op)
    assert reference * (1 - 1e-12) <= bound <= reference * (1 + 1e-6)


def _operator_lambda_max(op: MaskedAffine) -> float:
    """``λ_max(AᵀA)`` by ARPACK on the matrix-free operator (conv, masks, transposed conv) — no Gram involved."""
    import numpy as np
    import scipy.sparse.linalg

    n = math.prod(op.in_shape)

    def matvec(v):
        t = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).view(1, *op.in_shape)
        with torch.no_grad():
            return op.gram_matvec(t).flatten().numpy()

    operator = scipy.sparse.linalg.LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    start = np.random.default_rng(1).standard_normal(n)
    return float(scipy.sparse.linalg.eigsh(operator, k=1, which="LA", tol=0, v0=start,
                                           return_eigenvectors=False)[0])


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [0.1, 0.5])
def test_lenet_splitz_split2_exact_local_bound_is_fast(gamma):
    """The whole exact local bound of lenet-splitz split 2 (conv1 dense, conv2 banded) is exact under ``auto`` and
    takes seconds (it took 212 s with the dense 25,088² Gram)."""
    left, x, op = _lenet_splitz_conv2(gamma)
    start = time.perf_counter()
    bound = sz.lipschitz_bound(left, x, gamma)
    elapsed = time.perf_counter() - start
    assert bound.kind == ["exact"] and bound.failure_prob == [0.0]
    assert elapsed < 60, elapsed  # ~2–4 s on a quiet 2-core CPU; generous for a shared machine
    probabilistic = sz.lipschitz_bound(left, x, gamma, method="probabilistic",
                                       generator=torch.Generator().manual_seed(0))
    assert float(bound.value[0]) <= float(probabilistic.value[0])
