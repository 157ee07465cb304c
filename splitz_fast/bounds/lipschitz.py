"""Lipschitz bounds of ``f_L`` over a ball: the certificate bound, the global bound and the training estimate.

``L(x, γ) ≤ Π_k ‖I_k W_k I_{k−1}‖₂`` (``I_0 = I``, ``W_1`` with ``1/sd`` folded in, ``I_k`` the varying masks of
:func:`~splitz_fast.bounds.intervals.ball_bounds`). Why it holds: on the convex ball ``f_L`` is piecewise linear with Jacobian
``J = D_s W_s D_{s−1} ⋯ D_1 W_1 D`` whose activity diagonals satisfy ``D_k = D_k I_k`` and ``‖D_k‖ ≤ 1``, so
``‖J‖ ≤ Π_k ‖I_k W_k I_{k−1}‖``; integrating ``J`` along the segment ``x → x'`` gives the Lipschitz bound.
A non-overlapping max-pool after layer ``k`` adds a selection ``P`` (one entry per disjoint window, ``‖P D_k‖ ≤ 1``)
whose rows vanish for pooled outputs that are constant on the ball, so ``J = ⋯ (I_{k+1} W_{k+1} V)(P D_k)(I_k W_k ⋯)``
with ``V`` the pooled varying mask (:func:`~splitz_fast.bounds.intervals.pool_interval`): the factor of layer ``k+1`` takes
``V`` as its input mask and the pool itself contributes a factor 1.

Three ways to bound each factor ``‖A‖₂`` (:class:`~splitz_fast.bounds.operators.MaskedAffine`):

* ``"exact"`` — deterministic: the float64 Gram matrix ``G = AᵀA`` restricted to the varying inputs (banded and
  sparse for a convolution), an eigenvalue estimate ``μ``, and a Cholesky factorization of ``sI − G`` (``s`` slightly
  above ``μ``) whose success *proves* ``λ_max(G) ≤ s`` up to explicit floating-point terms
  (:func:`certified_lambda_max`). Under ``"auto"``: used while the Gram dimension is at most ``exact_max_dim`` or the
  estimated cost is at most ``EXACT_MAX_FLOPS`` (see there why).
* ``"probabilistic"`` — for operators too large for a dense Gram (ImageNet-sized first layers): ``k`` power steps
  from a Gaussian start ``b`` give ``‖Gᵏb‖ ≥ λ_maxᵏ |⟨b, e₁⟩|``, and ``P(|⟨b, e₁⟩| < t) ≤ t·√(2/π)``; with
  ``t = δ√(π/2)``, ``‖A‖ ≤ (‖Gᵏb‖/t)^{1/(2k)}`` fails with probability at most ``δ``, whatever the spectrum
  (:func:`probabilistic_norm_bound`). The caller adds every ``δ`` used to α.
* ``"estimate"`` — power iteration only (a *lower* estimate, differentiable): for training, never for certificates.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg
import torch

from .._checks import check_count, check_probability
from .intervals import BallBounds, ball_bounds, input_scale
from ..model.modules import LeftHalf
from .gram import exact_cost, factor_gram
from .operators import MaskedAffine
from ..kernels import conv_power, select_composite

UNIT_ROUNDOFF_64 = 2.0 ** -53
DEFAULT_EXACT_MAX_DIM = 4096
DEFAULT_PROBABILISTIC_ITERS = 128
# Under method="auto" a factor takes the exact bound when its Gram dimension is at most exact_max_dim, or when the
# estimated cost of the exact bound (gram.exact_cost) is at most this many flops. Why cost and not dimension
# alone: a convolution's Gram is banded, so its cost is ~3.3·d·band², not d³. Measured on the 2-core CPU (loaded):
# LeNet-splitz conv2 local bounds at γ = 0.1 / 0.5 (estimated 0.6 / 1.4e11 flops) take 4.2 / 7.4 s for the whole
# bound, its global bound (d = 25,088, estimated 3.1e11) 16 s and 1.2 GB — exact, once per model (the probabilistic
# one took 4.9 s and came out 5.6 % looser); an ImageNet stem (d = 150,528, band ≈ 4,000, ~6e12) goes probabilistic.
# The exact bound is worth a few times the probabilistic one's cost: it adds nothing to α and is tight, where the
# probabilistic bound is looser by up to (1/δ)^{1/(2·power_iters)} (5.5 % per factor at δ = 1e-6, 128 steps).
EXACT_MAX_FLOPS = 4e11


@dataclass
class LipschitzBound:
    """A bound on the Lipschitz constant of ``f_L`` for each input of a batch.

    Attributes:
        value: ``[B]`` float64 upper bounds (raw input units → latent units).
        kind: per input, one of ``"identity"`` (``s = 0``), ``"exact"`` (every factor deterministic) or
            ``"probabilistic"`` (at least one factor probabilistic).
        failure_prob: per input, the probability that ``value`` is *not* an upper bound (0 for deterministic kinds):
            the sum of the ``δ`` of its probabilistic factors. Add it to α.
        local: ``True`` for the local bound ``L(x, γ)``, ``False`` for the global one.
        gamma: ``[B]`` the ball radii used (zeros for the global bound).
    """

    value: torch.Tensor
    kind: list[str]
    failure_prob: list[float]
    local: bool
    gamma: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


LANCZOS_BLOCK = 16  # Lanczos steps between convergence checks (one host sync each)
LANCZOS_MAX_STEPS = 96  # LeNet conv1's Gram (d = 784) converges to machine precision by ~64 steps
SHIFT_ESTIMATORS = ("auto", "lanczos", "eigen", "squaring")
# On CUDA, "auto" takes a dense on-device estimate up to this Gram dimension and device Lanczos above it. Measured on an
# H200 (whole exact bound, benchmarks/test_bench_bounds.py): LeNet conv1 (d = 784) 14 ms with eigvalsh vs 25 ms with
# Lanczos (launch-bound Python loop); CIFAR stem (d = 3072) 27 ms with Lanczos vs 145 ms with a host copy + ARPACK.
DEVICE_DENSE_MAX_DIM = 1024
# The dense on-device estimate of "auto" on CUDA: "squaring" (:func:`squaring_top_eigenvalue`: float64 matrix
# products only, no eigensolver) or "eigvalsh". Measured on an H100 (`python -m benchmarks.targets --part native`):
# LeNet conv1's exact bound (d = 784) 2.67 ms with squaring vs 8.67 ms with eigvalsh, the same certified bound to the
# last bit; LeNet s = 1 CERTIFY (bf16, n = 10⁵) 0.082 vs 0.109 s per image.
DEVICE_DENSE_ESTIMATOR = "squaring"
# Squarings of squaring_top_eigenvalue: eigenvalue i keeps weight (λ_i/λ_1)^(2^steps) against the top one.
SQUARING_STEPS = 32
# Squarings between two trace normalisations. A trace-1 PSD matrix has entries in [−1, 1] and its trace (the sum of its
# eigenvalues w_i ≥ 0) stays ≥ (1/D)^(2^k) after k unnormalised squarings: ≥ 2^-160 for D ≤ 1024 and k = 4, far from
# float64's underflow, and nothing grows. Each normalisation is three launches (and a few views) on CUDA: normalising
# every 4th squaring instead of every one saves about 75 launches per estimate.
SQUARINGS_PER_NORMALISATION = 4
# A banded (convolution) Gram up to this dimension is certified densely: one LAPACK Cholesky beats the panel loop of
# _BandedCholesky there (LeNet conv1 at split 1, d = 784: 0.20 s against 0.89 s per bound; d = 3,072: equal; 2-core
# CPU, loaded). The dense certificate holds for any symmetric matrix, the densified one included.
DENSE_CHOLESKY_MAX_DIM = 2048
BAND_BLOCK_MIN = 64  # smallest panel of the banded Cholesky (fewer, larger BLAS calls on narrow bands)
# ARPACK's relative residual for the estimate that places the Cholesky shift: a Ritz value's error is about its square
# over the gap (≤ 1e-14 relative on LeNet's Grams), far inside the first shift's 1e-10, with fewer products than 0
# (machine precision). The estimate never enters the proof.
ARPACK_TOL = 1e-8


def lanczos_top_eigenvalue(gram: torch.Tensor, max_steps: int = LANCZOS_MAX_STEPS, rtol: float = 1e-13) -> float:
    """Estimate of ``λ_max`` of a symmetric PSD ``gram`` by Lanczos with full reorthogonalization, on ``gram``'s
    device (a GPU needs no host copy of the Gram and no dense eigensolver; the host only sees the tridiagonal
    coefficients, once per block of steps).

    A Ritz value is an eigenvalue of a compression of ``gram``, so it never exceeds ``λ_max`` beyond rounding; it is
    an *estimate* that places the Cholesky shift of :func:`certified_lambda_max`, never the certificate. Stops when
    the top Ritz pair's residual ``β_j |y_j|`` (a bound on its distance to an eigenvalue) is below ``rtol·θ``, after
    ``max_steps``, or at an invariant subspace.
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
    places the Cholesky shift of :func:`certified_lambda_max`, which widens the shift where the estimate is low."""
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


class _BandedCholesky:
    """Cholesky test of ``H = sI − G`` for a symmetric banded ``G`` given by its upper triangle (sparse CSR) of
    half-bandwidth ``b``: right-looking, in panels of ``nb ≥ b`` rows, so that ``H`` is block tridiagonal.

    Panel ``k`` (rows ``[k0, k1)``, columns ``[k0, k1 + b)``, upper triangle): ``R_kk = chol(H_kk − P)``, with ``P``
    the previous panel's ``R_k−1,kᵀ R_k−1,k``; then ``R_k,k+1 = R_kk⁻ᵀ H_k,k+1`` by substitution. This is the
    partitioned form of the point algorithm — each ``r_ij`` solves ``h_ij = Σ_k r_ki r_kj`` with the products summed
    in another order — so Higham's Thm 10.3 applies as to the point algorithm. Only upper triangles are read
    (``cholesky_ex(upper=True)`` and the panel right of its diagonal block). About ``3.3·d·nb²`` flops in BLAS-3
    calls; ``nb = b`` measured fastest (LeNet-splitz conv2, d = 17,516, b = 1,384, 2-core CPU: 2.9 s at ``nb = b``,
    3.4 s at ``1.5·b``, and 6–8 s for a sliding window with ``nb = b/4``: fewer flops, but smaller, slower calls).
    """

    def __init__(self, upper: torch.Tensor):
        self.d = upper.shape[0]
        crow, col, values = upper.crow_indices(), upper.col_indices(), upper.values()
        self.crow = crow.tolist()
        self.row = torch.repeat_interleave(torch.arange(self.d, device=col.device), crow.diff())
        self.col, self.neg_values = col, -values  # −G: exact
        self.band = int((col - self.row).max()) if col.numel() else 0
        self.nb = min(self.d, max(BAND_BLOCK_MIN, self.band))

    def succeeds(self, s: float) -> bool:
        d, band, nb = self.d, self.band, self.nb
        pending = None
        for k0 in range(0, d, nb):
            k1 = min(d, k0 + nb)
            n, width = k1 - k0, min(d, k1 + band) - k0
            lo, hi = self.crow[k0], self.crow[k1]
            panel = torch.zeros(n, width, dtype=self.neg_values.dtype, device=self.neg_values.device)
            panel[self.row[lo:hi] - k0, self.col[lo:hi] - k0] = self.neg_values[lo:hi]
            panel[:, :n].diagonal().add_(s)  # fl(s − g_ii)
            if pending is not None:  # covers this panel's first m ≤ b ≤ n indices
                m = pending.shape[0]
                panel[:m, :m] -= pending
            r, info = torch.linalg.cholesky_ex(panel[:, :n], upper=True)
            if int(info) != 0:
                return False
            pending = None
            if width > n:
                r_next = torch.linalg.solve_triangular(r.mT, panel[:, n:], upper=False)
                pending = r_next.mT @ r_next
        return True


def _gamma_n(n: int) -> float:
    """Higham's ``γ_n = n·u / (1 − n·u)`` in float64."""
    return n * UNIT_ROUNDOFF_64 / (1 - n * UNIT_ROUNDOFF_64)


def _sum_upper(float_sum: float, count: int) -> float:
    """An upper bound on the exact sum of ``count`` non-negative float64 values whose float64 sum is ``float_sum``: the
    float64 sum of ``m`` terms (any order, pairwise included) is within ``γ_{m−1}`` times the exact sum (Higham,
    Thm 4.1), so scaling it by ``1 + γ_m`` covers the rounding with room for the scaling's own rounding."""
    return float_sum * (1 + _gamma_n(count))


def _dense_gram(gram: torch.Tensor) -> torch.Tensor:
    """A sparse CSR Gram up to :data:`DENSE_CHOLESKY_MAX_DIM` as the dense symmetric matrix its upper triangle
    defines (exactly); any other Gram unchanged."""
    if gram.layout == torch.sparse_csr and gram.shape[0] <= DENSE_CHOLESKY_MAX_DIM:
        upper = gram.to_dense()
        return upper + torch.triu(upper, 1).mT
    return gram


def _takes_squaring(gram: torch.Tensor, estimator: str) -> bool:
    """Whether the shift of a dense ``gram`` is placed by :func:`squaring_top_eigenvalue` under ``estimator``."""
    if gram.layout == torch.sparse_csr:
        return False
    device_dense = estimator == "auto" and gram.is_cuda and gram.shape[0] <= DEVICE_DENSE_MAX_DIM
    return estimator == "squaring" or (device_dense and DEVICE_DENSE_ESTIMATOR == "squaring")


def _certified_value(s: float, trace_h: float, max_h: float, chol_terms: int, gram_error: float) -> float:
    """The bound of :func:`certified_lambda_max` once Cholesky of ``fl(sI − G)`` has completed: ``trace_h`` an upper
    bound on ``Σ|h_ii|``, ``max_h = max|h_ii|``, ``chol_terms`` the operation count of Higham's Thm 10.3."""
    chol_error = _gamma_n(chol_terms) * trace_h / (1 - _gamma_n(chol_terms))
    return (s + chol_error + UNIT_ROUNDOFF_64 * max_h + gram_error) * (1 + 8 * UNIT_ROUNDOFF_64)


# The relative shifts above the estimate that certified_lambda_max tries first (then WIDE_SHIFTS with the host estimate).
TIGHT_SHIFTS = (1e-10, 1e-8, 1e-6)
WIDE_SHIFTS = (1e-4, 1e-2, 1e-1)


def certified_lambda_max(gram: torch.Tensor, terms: int, estimator: str = "auto") -> float:
    """A proven upper bound on ``λ_max`` of the *exact* Gram matrix whose float64 rounding is ``gram``.

    ``gram`` is a dense ``[d, d]`` tensor or a sparse CSR tensor (a banded convolution Gram,
    :meth:`~splitz_fast.bounds.operators.MaskedAffine.gram`; its upper triangle defines the symmetric matrix). ``terms``
    bounds the number of products summed into an entry of ``gram`` from float64-exact inputs, plus at most two
    roundings of scale factors per product, so the exact Gram differs from ``gram`` by ``E`` with
    ``|E| ≤ γ_{terms+2}|A|ᵀ|A|`` entrywise and ``‖E‖₂ ≤ γ_{terms+2} tr(|A|ᵀ|A|) ≤ γ_{terms+2}·T/(1 − γ_{terms+2})``,
    where ``T`` bounds the exact sum of ``gram``'s diagonal from above (its float64 sum scaled by ``1 + γ_d``: a sum of
    ``d`` terms is exact only up to ``γ_{d−1}``; every trace below is taken this way).

    Certificate: if Cholesky of ``H = fl(sI − gram)`` completes, then ``R̂ᵀR̂ = H + ΔH`` with
    ``|ΔH| ≤ γ_{n+1}|R̂ᵀ||R̂|`` (Higham, *Accuracy and Stability*, Thm 10.3), hence
    ``‖ΔH‖₂ ≤ γ_{n+1}‖R̂‖_F² ≤ γ_{n+1} tr(H)/(1 − γ_{n+1})`` and ``H ⪰ −‖ΔH‖₂ I``; forming ``H``'s diagonal adds at
    most ``u·max|H_ii|``. So ``λ_max(gram) ≤ s + ‖ΔH‖₂ + u·max|H_ii|``. Dense ``gram``: ``n = d`` (LAPACK
    ``potrf``). Sparse ``gram`` of half-bandwidth ``b``: ``H`` is factored in row panels (:class:`_BandedCholesky`,
    the partitioned form of the same algorithm; LAPACK's banded ``pbtrf`` was ~10x slower on LeNet's conv2 Gram). The proof of Thm 10.3 bounds each equation
    ``h_ij = Σ_k r_ki r_kj`` by the number of its operations: outside the band ``R̂`` is exactly zero (by induction,
    every product there has an exact zero factor), products and sums with an exact zero are exact in IEEE arithmetic
    whatever the order, so at most ``b + 1`` products and one division (or a reciprocal and a product) carry
    rounding: ``n = min(d, b + 2)``.

    ``estimator`` picks the estimate ``μ`` that places the shift ``s`` (it never enters the proof): ``"lanczos"``
    (:func:`lanczos_top_eigenvalue`, on the Gram's device), ``"squaring"`` (:func:`squaring_top_eigenvalue`, on the
    Gram's device), ``"eigen"`` (host eigensolver), or ``"auto"`` (on CUDA: the dense on-device estimate
    ``DEVICE_DENSE_ESTIMATOR`` up to ``DEVICE_DENSE_MAX_DIM``, Lanczos above; elsewhere the host solver). If a
    Lanczos or squaring estimate leaves the shift too low for a tight bound, the host solver's estimate is tried before
    the shift is widened further. A sparse ``gram`` takes ARPACK's estimate on the host, its Cholesky on its device.
    """
    if estimator not in SHIFT_ESTIMATORS:
        raise ValueError(f"estimator must be one of {SHIFT_ESTIMATORS}, got {estimator!r}")
    d = gram.shape[0]
    if d == 0:
        return 0.0
    gram = _dense_gram(gram)
    sparse = gram.layout == torch.sparse_csr
    u = UNIT_ROUNDOFF_64
    if sparse:
        host = scipy.sparse.csr_matrix(tuple(t.cpu().numpy() for t in (gram.values(), gram.col_indices(),
                                                                         gram.crow_indices())), shape=(d, d))
        diagonal = torch.from_numpy(host.diagonal()).to(gram.device)
    else:
        diagonal = torch.diagonal(gram)
    def sum_upper(values: torch.Tensor) -> float:
        return _sum_upper(float(values.sum()), values.numel())

    # The diagonal of the rounded Gram is non-negative (sums of squares, rounded), its float64 sum a lower estimate
    # of the exact trace only up to rounding: every use below takes the upper bound.
    trace = sum_upper(diagonal.clamp_min(0))
    if trace == 0.0:
        return 0.0
    # tr(|A|ᵀ|A|) = Σ_i (exact Gram)_ii ≤ Σ_i g_ii / (1 − γ_{terms+2}): each diagonal entry is a float64 sum of squares.
    gram_error = _gamma_n(terms + 2) * trace / (1 - _gamma_n(terms + 2))

    if sparse:
        banded = _BandedCholesky(gram)
        chol_terms = min(d, banded.band + 2) + 1

        def factorize(s: float) -> tuple[float, float] | None:
            if not banded.succeeds(s):
                return None
            h_diag = s - diagonal  # the rounded diagonal the factorization started from
            return sum_upper(h_diag.abs()), float(h_diag.abs().max())
    else:
        chol_terms = d + 1
        eye = torch.eye(d, dtype=gram.dtype, device=gram.device)

        def factorize(s: float) -> tuple[float, float] | None:
            h = s * eye - gram
            _, info = torch.linalg.cholesky_ex(h)
            if int(info) != 0:
                return None
            h_diag = torch.diagonal(h)
            return sum_upper(h_diag.abs()), float(h_diag.abs().max())

    def shifted_bound(mu: float, etas: tuple[float, ...]) -> float | None:
        # Shift just above the estimate; widen only if the factorization fails (clustered top eigenvalues).
        for eta in etas:
            s = mu * (1 + eta) + eta * trace / d
            done = factorize(s)
            if done is not None:
                return _certified_value(s, *done, chol_terms, gram_error)
        return None

    tight, wide = TIGHT_SHIFTS, WIDE_SHIFTS
    device_dense = not sparse and estimator == "auto" and gram.is_cuda and d <= DEVICE_DENSE_MAX_DIM
    use_lanczos = not sparse and (estimator == "lanczos" or (estimator == "auto" and gram.is_cuda and not device_dense))
    use_squaring = _takes_squaring(gram, estimator)
    if use_lanczos or use_squaring:
        mu = max(squaring_top_eigenvalue(gram) if use_squaring else lanczos_top_eigenvalue(gram), 0.0)
        # An estimate above Gershgorin's bound on λ_max can only be a broken computation: it would still give a proven
        # bound, but a loose one. Then take the host solver's estimate instead.
        if mu <= float(gram.abs().sum(1).max()):
            bound = shifted_bound(mu, tight)
            if bound is not None:
                return bound
    if device_dense:
        mu = float(torch.linalg.eigvalsh(gram)[-1])
    else:
        mu = _upper_eigen_estimate(host) if sparse else _eigen_estimate(gram)
    bound = shifted_bound(max(mu, 0.0), tight + wide)
    if bound is not None:
        return bound
    # λ_max ≤ trace for the exact Gram (PSD): tr(exact) ≤ tr(gram) + |tr(E)| ≤ trace + gram_error, with `trace`
    # already an upper bound on the float64 diagonal's exact sum. Always valid, rarely needed.
    return (trace + gram_error) * (1 + 8 * u)


def certified_lambda_max_many(grams: list[torch.Tensor], terms: list[int], estimator: str = "auto") -> list[float]:
    """:func:`certified_lambda_max` of each of ``grams`` (with its ``terms``), the ones whose shift is placed by
    repeated squaring (on CUDA under ``"auto"``: :data:`DEVICE_DENSE_ESTIMATOR`) together: one batched squaring and
    one batched Cholesky per shift for all of them, a host synchronisation per step instead of several per Gram — the
    radius search bounds a Gram per γ and per input of a window at each pass. A Gram the batched step does not settle
    (an estimate above Gershgorin's bound, a Cholesky that fails at every tight shift) and every other Gram takes
    :func:`certified_lambda_max` itself.

    Proof: the same certificate. The Grams are stacked zero-padded to the largest dimension ``D``; for a Gram ``G`` of
    dimension ``d`` the factored matrix is ``fl(sI − G) ⊕ sI_{D−d}`` (block diagonal: the padding sits after ``G``'s
    rows and columns, and ``s·0 − 0`` is an exact zero). Cholesky of a block-diagonal matrix computes exact zeros in
    its off-diagonal blocks (every product there has an exact zero factor), and each entry of the leading block is
    formed from that block's entries alone (its indices ``k < i ≤ d``), by the same equations as for ``fl(sI − G)`` on
    its own; so its completion proves ``λ_max(G) ≤ s + ‖ΔH‖₂ + u·max|h_ii|`` with Higham's Thm 10.3 for ``n = d``,
    with the traces and maxima taken over the first ``d`` diagonal entries, exactly as :func:`certified_lambda_max`
    does. The estimate ``μ`` only places ``s``."""
    if len(grams) != len(terms):
        raise ValueError(f"one terms count per Gram: {len(grams)} Grams, {len(terms)} counts")
    grams = [_dense_gram(gram) for gram in grams]
    together = [i for i, gram in enumerate(grams) if gram.shape[0] > 0 and _takes_squaring(gram, estimator)]
    values: list[float | None] = [None] * len(grams)
    if len(together) > 1 and len({grams[i].device for i in together}) == 1:
        settled = _squared_certificates([grams[i] for i in together], [terms[i] for i in together])
        for i, value in zip(together, settled):
            values[i] = value
    return [value if value is not None else certified_lambda_max(gram, count, estimator)
            for value, gram, count in zip(values, grams, terms)]


def _squared_certificates(grams: list[torch.Tensor], terms: list[int]) -> list[float | None]:
    """The batched step of :func:`certified_lambda_max_many` for dense float64 Grams on one device: the bound of each,
    or ``None`` where it is left to :func:`certified_lambda_max`."""
    dims = [gram.shape[0] for gram in grams]
    size, device = max(dims), grams[0].device
    padded = torch.zeros(len(grams), size, size, dtype=torch.float64, device=device)
    for k, gram in enumerate(grams):
        padded[k, :gram.shape[0], :gram.shape[0]] = gram
    inside = torch.arange(size, device=device) < torch.tensor(dims, device=device)[:, None]  # [B, D]: not padding
    diagonal = padded.diagonal(dim1=1, dim2=2)
    estimate = _squaring_estimates(padded, SQUARING_STEPS).clamp_min(0.0)
    stats = torch.stack([diagonal.clamp_min(0).sum(1), estimate, padded.abs().sum(2).amax(1)]).cpu().tolist()
    results: list[float | None] = [None] * len(grams)
    pending, shared = [], {}
    for k, (diagonal_sum, mu, gershgorin) in enumerate(zip(*stats)):
        trace = _sum_upper(diagonal_sum, dims[k])
        if trace == 0.0:
            results[k] = 0.0
        elif mu <= gershgorin:  # else (a broken estimate, NaN included) certified_lambda_max takes it over
            pending.append(k)
            shared[k] = (mu, trace, _gamma_n(terms[k] + 2) * trace / (1 - _gamma_n(terms[k] + 2)))
    eye = torch.eye(size, dtype=torch.float64, device=device)
    for eta in TIGHT_SHIFTS:
        if not pending:
            break
        shifts = [shared[k][0] * (1 + eta) + eta * shared[k][1] / dims[k] for k in pending]
        h = torch.tensor(shifts, dtype=torch.float64, device=device)[:, None, None] * eye - padded[pending]
        _, info = torch.linalg.cholesky_ex(h)
        h_diagonal = h.diagonal(dim1=1, dim2=2).abs() * inside[pending]
        done = torch.stack([info.to(torch.float64), h_diagonal.sum(1), h_diagonal.amax(1)]).cpu().tolist()
        still = []
        for k, s, failed, diagonal_sum, max_h in zip(pending, shifts, *done):
            if failed:
                still.append(k)
                continue
            results[k] = _certified_value(s, _sum_upper(diagonal_sum, dims[k]), max_h, dims[k] + 1, shared[k][2])
        pending = still
    return results


def probabilistic_norm_bound(
    op: MaskedAffine, power_iters: int, delta: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[B]`` bounds on ``‖A_b‖₂``, each failing with probability at most ``delta`` (see module docstring).

    The power steps run in float64; a relative slack of 1e-6 on the result dominates their rounding.
    """
    device = op.weight.device
    v = torch.randn((op.batch, *op.in_shape), dtype=torch.float64, device=device, generator=generator)
    log_norm = torch.zeros(op.batch, dtype=torch.float64, device=device)
    zero = torch.zeros(op.batch, dtype=torch.bool, device=device)
    with torch.no_grad():
        for _ in range(power_iters):
            w = op.gram_matvec(v)
            norms = w.flatten(1).norm(dim=1)
            zero |= norms == 0
            safe = torch.where(norms > 0, norms, torch.ones_like(norms))
            log_norm += torch.log(safe)
            v = w / safe.view(-1, *([1] * (w.ndim - 1)))
    t = delta * math.sqrt(math.pi / 2)
    bound = torch.exp((log_norm - math.log(t)) / (2 * power_iters)) * (1 + 1e-6)
    # G^k b = 0 means λ_max·|⟨b, e₁⟩| = 0, i.e. λ_max = 0 (⟨b, e₁⟩ ≠ 0 almost surely; δ covers the rest).
    return torch.where(zero, torch.zeros_like(bound), bound)


def _layer_shapes(left: LeftHalf, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Input shape of every affine layer of ``f_L``."""
    shapes = []
    weight = left.layers[0].weight
    h = torch.zeros(1, *input_shape, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for layer, act, pool in zip(left.layers, left.activations, left.pools):
            shapes.append(tuple(h.shape[1:]))
            h = pool(act(layer(left.layer_input(layer, h))))
    return shapes


def masked_operators(
    left: LeftHalf, bounds: BallBounds | None, input_shape: tuple[int, ...], batch: int, scale: torch.Tensor | None,
    dtype: torch.dtype = torch.float64,
) -> list[MaskedAffine]:
    """The factors ``I_k W_k I_{k−1}`` of the product bound; without ``bounds``, the unmasked (global) factors."""
    left.check_structure()  # the factors below are sound only for the pieces this check admits
    ops = []
    shapes = _layer_shapes(left, input_shape)
    for k, layer in enumerate(left.layers):
        out_mask = None if bounds is None else bounds.masks[k]
        in_mask = None if bounds is None else bounds.in_mask(k)
        ops.append(
            MaskedAffine(
                layer, shapes[k], out_mask=out_mask, in_mask=in_mask, in_scale=scale if k == 0 else None,
                batch=batch, dtype=dtype,
            )
        )
    return ops


def _check_bound_settings(method: str, delta: float, power_iters: int, exact_max_dim: int) -> None:
    """The settings every bound entry point takes, checked as :class:`~splitz_fast.bounds.radius.BoundOptions` checks them
    (a ``delta`` of 0 or above 1 would make the probabilistic slack meaningless, not just loose)."""
    if method not in ("auto", "exact", "probabilistic"):
        raise ValueError(f"method must be 'auto', 'exact' or 'probabilistic', got {method!r}")
    check_probability("delta", delta)
    check_count("power_iters", power_iters)
    check_count("exact_max_dim", exact_max_dim, minimum=0)


def _bound_factors(
    ops: list[MaskedAffine], batch: int, *, method: str, delta: float, power_iters: int, exact_max_dim: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, list[str], list[float]]:
    return _bound_factors_many([(ops, batch, generator)], method=method, delta=delta, power_iters=power_iters,
                               exact_max_dim=exact_max_dim)[0]


def _bound_factors_many(
    groups: list[tuple[list[MaskedAffine], int, torch.Generator | None]], *, method: str, delta: float,
    power_iters: int, exact_max_dim: int,
) -> list[tuple[torch.Tensor, list[str], list[float]]]:
    """The product of factor bounds of each group ``(ops, batch, generator)`` (groups: inputs of a radius-search
    round, each with its own generator; every group has one operator per layer of ``f_L``). Per layer, the exact
    factors of all groups are certified together (:func:`certified_lambda_max_many`); a probabilistic factor draws
    from its own group's generator, in layer order, as it would alone."""
    values = [torch.ones(batch, dtype=torch.float64) for _, batch, _ in groups]
    n_prob = [[0] * batch for _, batch, _ in groups]
    for k in range(len(groups[0][0]) if groups else 0):
        grams, owners = [], []
        for g, (ops, batch, generator) in enumerate(groups):
            op = ops[k]
            use_exact = method == "exact"
            if method == "auto":
                dim, flops = exact_cost(op)
                use_exact = dim <= exact_max_dim or flops <= EXACT_MAX_FLOPS
            if use_exact:
                grams += [factor_gram(op, b) for b in range(batch)]
                owners += [(g, b) for b in range(batch)]
            else:
                values[g] *= probabilistic_norm_bound(op, power_iters, delta, generator).cpu()
                n_prob[g] = [n + 1 for n in n_prob[g]]
        for (g, b), top in zip(owners, certified_lambda_max_many([gram for gram, _ in grams],
                                                                 [terms for _, terms in grams])):
            values[g][b] *= math.sqrt(top)
    return [(value * (1 + 1e-12), ["exact" if n == 0 else "probabilistic" for n in counts], [n * delta for n in counts])
            for value, counts in zip(values, n_prob)]


def lipschitz_bound(
    left: LeftHalf,
    x: torch.Tensor,
    gamma: float | torch.Tensor,
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """Certificate bound on the local Lipschitz constant ``L(x, γ)`` of ``f_L`` for each input of ``x: [B, ...]``.

    Args:
        gamma: scalar or ``[B]`` ball radii in raw input units, ≥ 0.
        method: ``"exact"`` (deterministic, restricted Gram + Cholesky certificate), ``"probabilistic"`` (power
            method from a random start, failure probability ``delta`` per factor), or ``"auto"`` (per factor: exact
            while the Gram dimension is ≤ ``exact_max_dim`` or the estimated cost ≤ ``EXACT_MAX_FLOPS``).
        power_iters: power steps of the probabilistic bound; the bound's slack factor is about ``(1/δ)^{1/(2·power_iters)}``.
    """
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    batch = x.shape[0]
    if left.depth == 0:
        return LipschitzBound(torch.ones(batch, dtype=torch.float64), ["identity"] * batch, [0.0] * batch, True,
                              torch.as_tensor(gamma, dtype=torch.float64).expand(batch).clone())
    return bound_from_ball(left, ball_bounds(left, x, gamma), tuple(x.shape[1:]), method=method, delta=delta,
                           power_iters=power_iters, exact_max_dim=exact_max_dim, generator=generator)


def bound_from_ball(
    left: LeftHalf,
    bounds: BallBounds,
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """:func:`lipschitz_bound` from ball bounds already computed (:func:`~splitz_fast.bounds.intervals.ball_bounds`, or a
    :meth:`~splitz_fast.bounds.intervals.BallBounds.rows` slice of a larger batch's): the same factors and the same value."""
    return bounds_from_balls(left, [bounds], input_shape, method=method, delta=delta, power_iters=power_iters,
                             exact_max_dim=exact_max_dim, generators=[generator])[0]


def bounds_from_balls(
    left: LeftHalf,
    balls: list[BallBounds],
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generators: list[torch.Generator | None] | None = None,
) -> list[LipschitzBound]:
    """:func:`bound_from_ball` of each of ``balls`` (each with its own generator), each equal to its own call; their
    exact factors are certified together, layer by layer (:func:`certified_lambda_max_many`: on CUDA one batched
    squaring and Cholesky for all of them)."""
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    generators = generators if generators is not None else [None] * len(balls)
    if len(generators) != len(balls):
        raise ValueError(f"one generator per ball: {len(balls)} balls, {len(generators)} generators")
    groups = [(masked_operators(left, ball, input_shape, ball.gamma.shape[0], ball.input_scale), ball.gamma.shape[0],
               generator) for ball, generator in zip(balls, generators)]
    factors = _bound_factors_many(groups, method=method, delta=delta, power_iters=power_iters,
                                  exact_max_dim=exact_max_dim)
    return [LipschitzBound(value, kind, failure, True, ball.gamma.cpu())
            for (value, kind, failure), ball in zip(factors, balls)]


def global_lipschitz_bound(
    left: LeftHalf,
    input_shape: tuple[int, ...],
    *,
    method: str = "auto",
    delta: float = 1e-6,
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
    generator: torch.Generator | None = None,
) -> LipschitzBound:
    """The global bound ``Π_k ‖W_k‖₂`` (with ``1/sd`` folded into ``W_1``; convolutions as zero-padded operators on
    ``input_shape``). Input-independent; returned for a batch of one. Its Grams are the full (unmasked) ones; a
    convolution's is banded, so under ``"auto"`` e.g. LeNet-splitz split 2's conv2 (d = 25,088) is exact (~16 s,
    ~1.2 GB on a 2-core CPU; see ``EXACT_MAX_FLOPS``)."""
    _check_bound_settings(method, delta, power_iters, exact_max_dim)
    if left.depth == 0:
        return LipschitzBound(torch.ones(1, dtype=torch.float64), ["identity"], [0.0], False, torch.zeros(1))
    device = left.layers[0].weight.device
    probe = torch.zeros(1, *input_shape, device=device)
    scale = input_scale(left, probe.to(torch.float64))
    ops = masked_operators(left, None, tuple(input_shape), 1, scale)
    value, kind, failure = _bound_factors(
        ops, 1, method=method, delta=delta, power_iters=power_iters, exact_max_dim=exact_max_dim, generator=generator
    )
    return LipschitzBound(value, kind, failure, False, torch.zeros(1, dtype=torch.float64))


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
        :class:`splitz_fast.runs.torchrun.DataParallelGroup`.)"""
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
    ``input_scale`` are read; the training step's fused first layer, :func:`splitz_fast.training.loop.splitz_loss`, leaves
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
