"""Tests of splitz_fast.certify.stats: Clopper–Pearson bound, Cohen's radius, PREDICT's binomial test.

Every value is checked against SciPy and, for the Clopper–Pearson bound, against an independent formulation
(the root of the binomial tail equation), so a wrong parametrisation of the Beta quantile cannot slip through.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import beta, binom, binomtest, norm

from splitz_fast import clopper_pearson_lower, latent_radius, max_latent_radius, two_sided_binomial_pvalue

# (n_a, n) pairs: the edges n_a = 0, 1, n - 1, n and the interior, small and large n.
GRID = [
    (0, 1), (1, 1),
    (0, 10), (1, 10), (5, 10), (9, 10), (10, 10),
    (0, 100), (37, 100), (50, 100), (51, 100), (99, 100), (100, 100),
    (0, 1000), (512, 1000), (990, 1000), (1000, 1000),
    (50_000, 100_000), (99_000, 100_000), (99_999, 100_000), (100_000, 100_000),
]
ALPHAS = [0.001, 0.01, 0.05, 0.25]


def tail_root(n_a: int, n: int, alpha: float) -> float:
    """Independent one-sided Clopper–Pearson lower bound: the p solving ``P[Bin(n, p) >= n_a] = alpha``.

    ``P[Bin(n, p) >= n_a]`` is continuous and strictly increasing in p from 0 (p = 0) to 1 (p = 1) for n_a >= 1.
    """
    if n_a == 0:
        return 0.0

    def excess(p: float) -> float:
        return binom.sf(n_a - 1, n, p) - alpha

    return brentq(excess, 0.0, 1.0, xtol=1e-15, rtol=1e-13, maxiter=500)


# ------------------------------------------------------------------ clopper_pearson_lower
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n_a,n", GRID)
def test_clopper_pearson_matches_beta_ppf(n_a, n, alpha):
    got = clopper_pearson_lower(n_a, n, alpha)
    assert isinstance(got, float)
    if n_a == 0:
        assert got == 0.0
    else:
        expected = beta.ppf(alpha, n_a, n - n_a + 1)
        assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert 0.0 <= got <= n_a / n  # a lower bound never exceeds the point estimate


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n_a,n", GRID)
def test_clopper_pearson_matches_binomial_tail_root(n_a, n, alpha):
    got = clopper_pearson_lower(n_a, n, alpha)
    assert got == pytest.approx(tail_root(n_a, n, alpha), rel=1e-7, abs=1e-12)
    if n_a > 0:
        # The defining property: at the bound, seeing >= n_a successes has probability exactly alpha.
        assert binom.sf(n_a - 1, n, got) == pytest.approx(alpha, rel=1e-6)


@pytest.mark.parametrize("n", [1, 7, 100, 100_000])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_clopper_pearson_all_successes_closed_form(n, alpha):
    # P[Bin(n, p) >= n] = p^n = alpha  =>  p = alpha^(1/n).
    assert clopper_pearson_lower(n, n, alpha) == pytest.approx(alpha ** (1.0 / n), rel=1e-12)


def test_clopper_pearson_monotone():
    n, alpha = 200, 0.01
    values = [clopper_pearson_lower(k, n, alpha) for k in range(n + 1)]
    assert values[0] == 0.0
    assert all(b > a for a, b in zip(values, values[1:])), "must increase strictly with n_a"
    # Smaller alpha (higher confidence) gives a smaller lower bound.
    assert clopper_pearson_lower(150, n, 0.001) < clopper_pearson_lower(150, n, 0.01) < clopper_pearson_lower(150, n, 0.1)


def test_clopper_pearson_is_one_sided_not_two_sided():
    # A classic mistake is to use the two-sided interval at level alpha (i.e. Beta.ppf(alpha/2, ...)).
    n_a, n, alpha = 80, 100, 0.05
    one_sided = beta.ppf(alpha, n_a, n - n_a + 1)
    two_sided = beta.ppf(alpha / 2, n_a, n - n_a + 1)
    got = clopper_pearson_lower(n_a, n, alpha)
    assert got == pytest.approx(one_sided, rel=1e-12)
    assert abs(got - two_sided) > 1e-3


# ------------------------------------------------------------------ latent_radius / max_latent_radius
@pytest.mark.parametrize("sigma", [0.12, 0.25, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("p", [0.5000001, 0.51, 0.6, 0.75, 0.9, 0.99, 0.999, 0.99993, 1 - 1e-9])
def test_latent_radius_formula(sigma, p):
    got = latent_radius(sigma, p)
    assert got == pytest.approx(sigma * norm.ppf(p), rel=1e-12)
    assert got > 0


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.2, 0.4999999, 0.5])
def test_latent_radius_zero_at_or_below_half(p):
    assert latent_radius(0.5, p) == 0.0


def test_latent_radius_monotone_and_linear_in_sigma():
    ps = [0.55, 0.7, 0.85, 0.95, 0.999]
    radii = [latent_radius(1.0, p) for p in ps]
    assert all(b > a for a, b in zip(radii, radii[1:]))
    for p in ps:
        assert latent_radius(0.37, p) == pytest.approx(0.37 * latent_radius(1.0, p), rel=1e-12)


@pytest.mark.parametrize("sigma", [0.12, 0.25, 0.5, 1.0])
def test_max_latent_radius_cohen_figure(sigma):
    got = max_latent_radius(sigma, 100_000, 0.001)
    # Cohen et al.: the largest radius at n = 1e5, alpha = 1e-3 is 3.81 sigma.
    assert round(got / sigma, 2) == 3.81
    # ...and it is computed from the Clopper–Pearson bound, not a constant.
    assert got == pytest.approx(sigma * norm.ppf(0.001 ** (1 / 100_000)), rel=1e-9)


def test_max_latent_radius_depends_on_n_and_alpha():
    base = max_latent_radius(1.0, 100_000, 0.001)
    assert max_latent_radius(1.0, 10_000, 0.001) < base
    assert max_latent_radius(1.0, 1_000_000, 0.001) > base
    assert max_latent_radius(1.0, 100_000, 0.01) > base
    assert max_latent_radius(1.0, 100, 0.001) == pytest.approx(norm.ppf(0.001 ** (1 / 100)), rel=1e-9)


# ------------------------------------------------------------------ two_sided_binomial_pvalue
@pytest.mark.parametrize(
    "n1,n2",
    [(1, 0), (0, 1), (5, 5), (6, 4), (10, 0), (60, 40), (40, 60), (55, 45), (520, 480), (5_100, 4_900),
     (9_000, 1_000), (100_000, 0), (3, 97)],
)
def test_two_sided_pvalue_matches_binomtest(n1, n2):
    expected = binomtest(n1, n1 + n2, 0.5, alternative="two-sided").pvalue
    got = two_sided_binomial_pvalue(n1, n2)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-300)
    assert 0.0 <= got <= 1.0


def test_two_sided_pvalue_is_two_sided_and_symmetric():
    # For a fair coin the two-sided p-value of k heads is twice the smaller tail (capped at 1).
    n1, n2 = 62, 38
    assert two_sided_binomial_pvalue(n1, n2) == pytest.approx(two_sided_binomial_pvalue(n2, n1), rel=1e-12)
    assert two_sided_binomial_pvalue(n1, n2) == pytest.approx(2 * binom.sf(n1 - 1, n1 + n2, 0.5), rel=1e-9)
    assert two_sided_binomial_pvalue(50, 50) == pytest.approx(1.0)
    assert two_sided_binomial_pvalue(10, 0) == pytest.approx(2 * 0.5 ** 10, rel=1e-12)


def test_two_sided_pvalue_no_votes():
    assert two_sided_binomial_pvalue(0, 0) == 1.0


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.01, 1.5, math.nan, math.inf])
def test_clopper_pearson_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        clopper_pearson_lower(5, 10, alpha)


@pytest.mark.parametrize("alpha", ["0.05", None, True])
def test_clopper_pearson_rejects_non_numeric_alpha(alpha):
    with pytest.raises(TypeError, match="alpha"):
        clopper_pearson_lower(5, 10, alpha)


@pytest.mark.parametrize("n_a,n", [(11, 10), (-1, 10), (2, 1)])
def test_clopper_pearson_rejects_n_a_out_of_range(n_a, n):
    with pytest.raises(ValueError, match="n_a"):
        clopper_pearson_lower(n_a, n, 0.01)


@pytest.mark.parametrize("n", [0, -5])
def test_clopper_pearson_rejects_nonpositive_n(n):
    with pytest.raises(ValueError, match="n"):
        clopper_pearson_lower(0, n, 0.01)


@pytest.mark.parametrize("n_a,n", [(5.0, 10), (5, 10.0), (True, 10), (5, "10")])
def test_clopper_pearson_rejects_non_integer_counts(n_a, n):
    with pytest.raises((TypeError, ValueError), match="n"):
        clopper_pearson_lower(n_a, n, 0.01)


def test_clopper_pearson_takes_numpy_and_tensor_counts():
    want = clopper_pearson_lower(97, 100, 0.001)
    assert clopper_pearson_lower(np.int64(97), np.int32(100), 0.001) == want
    assert clopper_pearson_lower(torch.tensor(97), 100, 0.001) == want


@pytest.mark.parametrize("n_a,n", [(3, 5), (4, 5), (9, 10)])
def test_clopper_pearson_is_the_trivial_bound_where_scipy_fails(n_a, n):
    """SciPy's Beta quantile returns NaN at α = 1e-300 for these counts: the bound is then 0 (always valid: CERTIFY
    abstains), never NaN."""
    assert math.isnan(beta.ppf(1e-300, n_a, n - n_a + 1))  # the failure this guards against
    assert clopper_pearson_lower(n_a, n, 1e-300) == 0.0


@pytest.mark.parametrize("sigma", [0.0, -1.0, math.nan, math.inf])
def test_latent_radius_rejects_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma"):
        latent_radius(sigma, 0.9)


@pytest.mark.parametrize("p", [-0.1, 1.1, math.nan])
def test_latent_radius_rejects_bad_probability(p):
    with pytest.raises(ValueError, match="p_a_lower"):
        latent_radius(0.5, p)


@pytest.mark.parametrize("n,alpha", [(0, 0.001), (100, 0.0), (100, 1.0)])
def test_max_latent_radius_rejects_bad_inputs(n, alpha):
    with pytest.raises(ValueError):
        max_latent_radius(0.5, n, alpha)


def test_max_latent_radius_rejects_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        max_latent_radius(0.0, 100, 0.001)
