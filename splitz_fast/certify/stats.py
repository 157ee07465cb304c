"""Cohen et al.'s statistics: the one-sided Clopper–Pearson bound, the RS radius, PREDICT's binomial test."""
from __future__ import annotations

import math

from scipy.stats import beta, binomtest, norm

from .._checks import check_count, check_positive, check_probability


def clopper_pearson_lower(n_a: int, n: int, alpha: float) -> float:
    """One-sided ``1 − α`` lower confidence bound on a binomial proportion: ``Beta.ppf(α; n_A, n − n_A + 1)``.

    Equals ``statsmodels.proportion_confint(n_A, n, alpha=2α, method="beta")[0]``; 0 when ``n_A = 0``, and 0 (the
    trivial bound, always valid) where SciPy's quantile fails and returns NaN (α near 1e-300 with small ``n``).
    """
    n = check_count("n", n, 1)
    check_probability("alpha", alpha)
    n_a = check_count("n_a", n_a, 0)
    if n_a > n:
        raise ValueError(f"n_a must be an integer in [0, n={n}], got {n_a}")
    if n_a == 0:
        return 0.0
    bound = float(beta.ppf(alpha, n_a, n - n_a + 1))
    return 0.0 if math.isnan(bound) else bound


def latent_radius(sigma: float, p_a_lower: float) -> float:
    """Cohen's radius ``R = σ Φ⁻¹(p_A_lower)`` (0 when ``p_A_lower ≤ 1/2``, where CERTIFY abstains)."""
    check_positive("sigma", sigma)
    if not 0.0 <= p_a_lower <= 1.0:
        raise ValueError(f"p_a_lower must lie in [0, 1], got {p_a_lower}")
    if p_a_lower <= 0.5:
        return 0.0
    return float(sigma * norm.ppf(p_a_lower))


def two_sided_binomial_pvalue(n1: int, n2: int) -> float:
    """p-value of the two-sided binomial test of ``n1`` successes in ``n1 + n2`` trials at p = 1/2 (PREDICT)."""
    if n1 + n2 == 0:
        return 1.0
    return float(binomtest(n1, n1 + n2, 0.5, alternative="two-sided").pvalue)


def max_latent_radius(sigma: float, n: int, alpha: float) -> float:
    """The largest radius CERTIFY can return with ``n`` samples: all ``n`` votes for one class."""
    return latent_radius(sigma, clopper_pearson_lower(n, n, alpha))


__all__ = ["clopper_pearson_lower", "latent_radius", "two_sided_binomial_pvalue", "max_latent_radius"]
