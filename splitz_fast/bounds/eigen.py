"""Estimates of ``λ_max`` of a symmetric PSD Gram matrix that place the Cholesky shift of
:func:`~splitz_fast.bounds.certificate.certified_lambda_max`: Lanczos on the Gram's device
(:func:`lanczos_top_eigenvalue`), repeated squaring on the Gram's device (:func:`squaring_top_eigenvalue`), and host
eigensolvers (dense ``eigvalsh``, ARPACK). They are *estimates*: none of them enters the proof, which the Cholesky
factorization carries alone (:mod:`splitz_fast.bounds.certificate`).
"""
from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg
import torch

LANCZOS_BLOCK = 16  # Lanczos steps between convergence checks (one host sync each)
LANCZOS_MAX_STEPS = 96  # LeNet conv1's Gram (d = 784) converges to machine precision by ~64 steps
# Squarings of squaring_top_eigenvalue: eigenvalue i keeps weight (λ_i/λ_1)^(2^steps) against the top one.
SQUARING_STEPS = 32
# Squarings between two trace normalisations. A trace-1 PSD matrix has entries in [−1, 1] and its trace (the sum of its
# eigenvalues w_i ≥ 0) stays ≥ (1/D)^(2^k) after k unnormalised squarings: ≥ 2^-160 for D ≤ 1024 and k = 4, far from
# float64's underflow, and nothing grows. Each normalisation is three launches (and a few views) on CUDA: normalising
# every 4th squaring instead of every one saves about 75 launches per estimate.
SQUARINGS_PER_NORMALISATION = 4
# ARPACK's relative residual for the estimate that places the Cholesky shift: a Ritz value's error is about its square
# over the gap (≤ 1e-14 relative on LeNet's Grams), far inside the first shift's 1e-10, with fewer products than 0
# (machine precision). The estimate never enters the proof.
ARPACK_TOL = 1e-8


def lanczos_top_eigenvalue(gram: torch.Tensor, max_steps: int = LANCZOS_MAX_STEPS, rtol: float = 1e-13) -> float:
    """Estimate of ``λ_max`` of a symmetric PSD ``gram`` by Lanczos with full reorthogonalization, on ``gram``'s
    device (a GPU needs no host copy of the Gram and no dense eigensolver; the host only sees the tridiagonal
    coefficients, once per block of steps).

    A Ritz value is an eigenvalue of a compression of ``gram``, so it never exceeds ``λ_max`` beyond rounding; it is
    an *estimate* that places the Cholesky shift of :func:`~splitz_fast.bounds.certificate.certified_lambda_max`,
    never the certificate. Stops when the top Ritz pair's residual ``β_j |y_j|`` (a bound on its distance to an
    eigenvalue) is below ``rtol·θ``, after ``max_steps``, or at an invariant subspace.
    """
    d = gram.shape[0]
    steps = min(max_steps, d)
    if steps == 0:
        return 0.0
    # Fixed start vector (drawn on the CPU for every device): the estimate, hence the certificate, is reproducible.
    start = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(gram)
    basis = torch.zeros(steps + 1, d, dtype=gram.dtype, device=gram.device)
    basis[0] = start / start.norm()
    alpha = torch.zeros(steps, dtype=gram.dtype, device=gram.device)
    beta = torch.zeros(steps, dtype=gram.dtype, device=gram.device)
    theta = 0.0
    for j in range(steps):
        w = gram @ basis[j]
        scale = w.norm()
        alpha[j] = w @ basis[j]
        # Full reorthogonalization, twice ("twice is enough"): the unused rows of `basis` are zero and drop out.
        w = w - basis.T @ (basis @ w)
        w = w - basis.T @ (basis @ w)
        # Invariant subspace: what is left is rounding noise, whose direction would corrupt the recurrence. Stop
        # extending the basis (β = 0, zero rows after); the Ritz values found so far are exact for the subspace.
        b = w.norm()
        b = torch.where(b > 1e-10 * scale, b, torch.zeros_like(b))
        beta[j] = b
        basis[j + 1] = torch.where(b > 0, w / b.clamp_min(torch.finfo(gram.dtype).tiny), torch.zeros_like(w))
        if (j + 1) % LANCZOS_BLOCK and j + 1 < steps:
            continue
        a, off = alpha[:j + 1].cpu().numpy(), beta[:j + 1].cpu().numpy()
        values, vectors = scipy.linalg.eigh_tridiagonal(a, off[:-1])
        theta = float(values[-1])
        if off[-1] * abs(vectors[-1, -1]) <= rtol * max(abs(theta), np.finfo(np.float64).tiny) or off[-1] == 0:
            break
    return theta


def squaring_top_eigenvalue(gram: torch.Tensor, steps: int = SQUARING_STEPS) -> float:
    """Estimate of ``λ_max`` of a symmetric PSD ``gram`` by repeated squaring, on ``gram``'s device, with one host
    synchronisation (the result): ``M₀ = G / tr G``, then ``M ← M²`` ``steps`` times, renormalised to trace 1 every
    :data:`SQUARINGS_PER_NORMALISATION` squarings and after the last, so that
    ``M = Σ_i w_i u_i u_iᵀ`` with ``w_i ∝ λ_i^p``, ``p = 2^steps`` — the top eigenvector's projector once the others'
    weights ``(λ_i/λ_1)^p`` have vanished; then the Rayleigh quotient ``vᵀGv / vᵀv`` of ``M``'s column ``v`` with the
    largest diagonal entry (the one most aligned with the top eigenvector). Dense float64 products only: on a GPU with
    fast float64 matrix products, no eigensolver's sequential reduction.

    Accuracy: the Rayleigh quotient of ``v = Σ a_i u_i`` is below ``λ_1`` by ``Σ a_i² (λ_1 − λ_i) / Σ a_i²``. Choosing the
    column of the largest diagonal bounds ``a_i/a_1`` by ``√d (λ_i/λ_1)^p``, so the relative error is at most about
    ``d · max_x x^(2p) (1 − x) ≤ d / (2e·p)`` (the worst case: an eigenvalue just below the top one; ≈ 3e-8 for
    ``d = 784``, ``steps = 32``), and at rounding level where the spectrum has a gap. It never enters the proof: it only
    places the Cholesky shift of :func:`~splitz_fast.bounds.certificate.certified_lambda_max`, which widens the shift
    where the estimate is low."""
    if gram.shape[0] == 0:
        return 0.0
    return float(_squaring_estimates(gram.unsqueeze(0), steps)[0])


def _squaring_estimates(grams: torch.Tensor, steps: int) -> torch.Tensor:
    """:func:`squaring_top_eigenvalue` of each of ``grams: [B, D, D]`` (``D ≥ 1``), as a ``[B]`` tensor on their device
    (no host synchronisation). A zero-padded Gram gives its own estimate: the padding's rows and columns stay zero."""
    tiny = torch.finfo(grams.dtype).tiny

    def normalised(m: torch.Tensor) -> torch.Tensor:
        return m / m.diagonal(dim1=1, dim2=2).sum(1).clamp_min(tiny)[:, None, None]

    m = normalised(grams)
    for step in range(1, steps + 1):
        m = torch.bmm(m, m)  # not `@`: its batched path adds an expand and two views per product
        if step % SQUARINGS_PER_NORMALISATION == 0 or step == steps:
            m = normalised(m)
    column = m.diagonal(dim1=1, dim2=2).argmax(1)
    v = m.gather(2, column[:, None, None].expand(-1, grams.shape[1], 1))  # [B, D, 1]: that column of each
    norm2 = (v * v).sum((1, 2))
    quotient = (v * (grams @ v)).sum((1, 2)) / norm2.clamp_min(tiny)
    return torch.where(norm2 > 0, quotient, torch.zeros_like(quotient))


def _eigen_estimate(gram: torch.Tensor) -> float:
    """``λ_max`` estimate by a host eigensolver: dense ``eigvalsh`` for small dense Grams, sparse Lanczos (ARPACK)
    for banded convolution Grams (LeNet's conv1: 3 % non-zeros, ~3x faster than a dense solver on a CPU)."""
    d = gram.shape[0]
    density = float(torch.count_nonzero(gram)) / gram.numel()
    if d <= 1024 and density > 0.25:
        return float(torch.linalg.eigvalsh(gram)[-1])
    matrix = scipy.sparse.csr_matrix(gram.cpu().numpy())
    start = np.random.default_rng(0).standard_normal(d)  # fixed start: certificates stay bit-reproducible
    return float(scipy.sparse.linalg.eigsh(matrix, k=1, which="LA", tol=ARPACK_TOL, v0=start,
                                           return_eigenvectors=False)[0])


def _upper_eigen_estimate(upper: scipy.sparse.csr_matrix) -> float:
    """``λ_max`` estimate (ARPACK) of the symmetric matrix whose upper triangle is ``upper``."""
    d = upper.shape[0]
    if d < 3:  # below ARPACK's smallest problem
        full = upper.toarray()
        return float(np.linalg.eigvalsh(full + np.triu(full, 1).T)[-1])
    diagonal, lower = upper.diagonal(), upper.T

    def matvec(v: np.ndarray) -> np.ndarray:
        v = v.ravel()
        return upper @ v + lower @ v - diagonal * v

    operator = scipy.sparse.linalg.LinearOperator((d, d), matvec=matvec, dtype=np.float64)
    start = np.random.default_rng(0).standard_normal(d)  # fixed start: certificates stay bit-reproducible
    return float(scipy.sparse.linalg.eigsh(operator, k=1, which="LA", tol=ARPACK_TOL, v0=start,
                                           return_eigenvectors=False)[0])
