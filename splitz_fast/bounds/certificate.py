"""The proof that ``λ_max ≤ s``: a Cholesky factorization of ``sI − G`` (dense, or banded in panels for a
convolution's Gram) whose success bounds ``λ_max`` of the *exact* Gram matrix up to explicit floating-point terms
(Higham, *Accuracy and Stability*, Thm 10.3) — :func:`certified_lambda_max` for one Gram,
:func:`certified_lambda_max_many` for many at once. The estimate that places ``s``
(:mod:`splitz_fast.bounds.eigen`) never enters the proof.
"""
from __future__ import annotations

import scipy.sparse
import torch

from .eigen import (
    SQUARING_STEPS,
    _eigen_estimate,
    _squaring_estimates,
    _upper_eigen_estimate,
    lanczos_top_eigenvalue,
    squaring_top_eigenvalue,
)

UNIT_ROUNDOFF_64 = 2.0 ** -53
SHIFT_ESTIMATORS = ("auto", "lanczos", "eigen", "squaring")
# On CUDA, "auto" takes a dense on-device estimate up to this Gram dimension and device Lanczos above it. Measured on an
# H200 (whole exact bound, benchmarks/test_bench_bounds.py): LeNet conv1 (d = 784) 14 ms with eigvalsh vs 25 ms with
# Lanczos (launch-bound Python loop); CIFAR stem (d = 3072) 27 ms with Lanczos vs 145 ms with a host copy + ARPACK.
DEVICE_DENSE_MAX_DIM = 1024
# The dense on-device estimate of "auto" on CUDA: "squaring" (:func:`~splitz_fast.bounds.eigen.squaring_top_eigenvalue`:
# float64 matrix products only, no eigensolver) or "eigvalsh". Measured on an H100 (`python -m benchmarks.targets --part native`):
# LeNet conv1's exact bound (d = 784) 2.67 ms with squaring vs 8.67 ms with eigvalsh, the same certified bound to the
# last bit; LeNet s = 1 CERTIFY (bf16, n = 10⁵) 0.082 vs 0.109 s per image.
DEVICE_DENSE_ESTIMATOR = "squaring"
# A banded (convolution) Gram up to this dimension is certified densely: one LAPACK Cholesky beats the panel loop of
# _BandedCholesky there (LeNet conv1 at split 1, d = 784: 0.20 s against 0.89 s per bound; d = 3,072: equal; 2-core
# CPU, loaded). The dense certificate holds for any symmetric matrix, the densified one included.
DENSE_CHOLESKY_MAX_DIM = 2048
BAND_BLOCK_MIN = 64  # smallest panel of the banded Cholesky (fewer, larger BLAS calls on narrow bands)


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
    """Whether the shift of a dense ``gram`` is placed by :func:`~splitz_fast.bounds.eigen.squaring_top_eigenvalue`
    under ``estimator``."""
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
    :func:`~splitz_fast.bounds.gram.factor_gram`; its upper triangle defines the symmetric matrix). ``terms``
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
    (:func:`~splitz_fast.bounds.eigen.lanczos_top_eigenvalue`, on the Gram's device), ``"squaring"``
    (:func:`~splitz_fast.bounds.eigen.squaring_top_eigenvalue`, on the Gram's device), ``"eigen"`` (host eigensolver), or ``"auto"`` (on CUDA: the dense on-device estimate
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
