"""Tests of splitz_fast.sequential: the beta-binomial mixture confidence sequence and the sequential driver.

The central check is validity under optional stopping: an adversary who stops a Bernoulli(p) stream the first time
the lower bound exceeds the true p must succeed on at most an α fraction of streams. The same check, applied to a
naive stopper that re-uses the fixed-n Clopper–Pearson bound at every look, must fail — so the check has teeth.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.stats import beta, binom, binomtest, norm

from splitz_fast.sequential import (
    BetaBinomialCS,
    Decision,
    SequentialResult,
    certify_sequential,
    checkpoints,
    latent_thresholds,
)


# ------------------------------------------------------------------ optional-stopping harness
def crossing_counts(lower, schedule: np.ndarray, p: float) -> np.ndarray:
    """``crit[k]``: the fewest hits at ``schedule[k]`` draws for which ``lower(hits, t) > p`` (``t + 1``: never).

    Found by bisection over the hit count, which is valid because the lower bound increases with the hits
    (``test_lower_increases_with_hits``)."""
    crit = np.empty(len(schedule), dtype=np.int64)
    for k, t in enumerate(int(t) for t in schedule):
        lo, hi = 0, t + 1  # lower(lo) <= p (lower(0) = 0), and hi is the answer if none in (lo, t] crosses
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if lower(mid, t) > p:
                hi = mid
            else:
                lo = mid
        crit[k] = hi
    return crit


def stopped_above_p(lower, p: float, schedule: np.ndarray, trials: int, seed: int, chunk: int = 10_000) -> int:
    """Number of simulated Bernoulli(p) streams on which the lower bound exceeds p at *some* look in ``schedule``:
    exactly the streams on which "stop as soon as the lower bound exceeds p" ends with a false claim."""
    rng = np.random.default_rng(seed)
    crit = crossing_counts(lower, schedule, p)
    steps = np.diff(schedule, prepend=0)
    fails = 0
    for start in range(0, trials, chunk):
        hits = np.cumsum(rng.binomial(steps, p, size=(min(chunk, trials - start), len(schedule))), axis=1)
        fails += int(np.count_nonzero((hits >= crit).any(axis=1)))
    return fails


def naive_clopper_pearson(alpha: float):
    """Cohen's fixed-n bound, wrongly re-used at every look."""
    return lambda hits, t: beta.ppf(alpha, hits, t - hits + 1) if hits else 0.0


# Dense early looks (every draw up to ~10, then +10 % per look) up to 10^5 draws: 130 looks.
SCHEDULE = checkpoints(100_000, first=1, growth=1.1)
ALPHA = 0.05
TRIALS = 20_000


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99, 0.999])
def test_optional_stopping_failure_rate_at_most_alpha(p):
    fails = stopped_above_p(BetaBinomialCS(ALPHA).lower, p, SCHEDULE, TRIALS, seed=1)
    rate = fails / TRIALS
    # H0 "the true failure rate is <= alpha" is rejected only if the count is implausibly high for alpha.
    pvalue = binomtest(fails, TRIALS, ALPHA, alternative="greater").pvalue
    assert pvalue > 1e-3, f"p={p}: {fails}/{TRIALS} = {rate:.4f} streams stopped with lower > p (alpha {ALPHA})"


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_naive_repeated_clopper_pearson_fails_the_same_check(p):
    fails = stopped_above_p(naive_clopper_pearson(ALPHA), p, SCHEDULE, TRIALS, seed=1)
    rate = fails / TRIALS
    assert rate > 2 * ALPHA, f"p={p}: naive stopper only failed on {rate:.4f} of streams"
    assert binomtest(fails, TRIALS, ALPHA, alternative="greater").pvalue < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.05, 0.2])
@pytest.mark.parametrize("p", [0.3, 0.9962, 0.9995])
def test_optional_stopping_every_draw_large(p, alpha):
    """100,000 streams, a look after *every* draw up to 500, then +3 % per look up to 10^5 (~680 looks)."""
    schedule = np.unique(np.concatenate([np.arange(1, 501), checkpoints(100_000, first=500, growth=1.03)]))
    trials = 100_000
    fails = stopped_above_p(BetaBinomialCS(alpha).lower, p, schedule, trials, seed=2)
    assert binomtest(fails, trials, alpha, alternative="greater").pvalue > 1e-3, (p, alpha, fails / trials)


@pytest.mark.slow
def test_driver_false_certificates_under_its_own_stopping_rule():
    """End to end: the only threshold is p itself, so every CERTIFIED is a false certificate; the driver keeps
    looking (40 looks, giving up late) until it certifies, refutes, gives up or runs out of budget."""
    alpha, p, runs = 0.2, 0.9, 1000
    rng = np.random.default_rng(3)
    wrong = 0
    for _ in range(runs):
        result = certify_sequential(
            lambda n: rng.binomial(n, p), [p], alpha=alpha, budget=20_000, first=10, growth=1.2, give_up=alpha
        )
        wrong += result.decisions[0] is Decision.CERTIFIED
    assert 0 < wrong, "no false certificate at all: the check would not notice a broken driver"
    assert binomtest(wrong, runs, alpha, alternative="greater").pvalue > 1e-3, wrong / runs


# ------------------------------------------------------------------ the mixture itself
@pytest.mark.parametrize("a,b", [(0.5, 0.5), (1.0, 1.0), (2.0, 0.3)])
@pytest.mark.parametrize("hits,t", [(0, 0), (0, 3), (1, 1), (2, 5), (7, 9), (12, 12)])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.93])
def test_log_mixture_matches_quadrature(a, b, hits, t, p):
    cs = BetaBinomialCS(0.1, a, b)

    def likelihood_ratio(q):
        return q**hits * (1 - q) ** (t - hits) / (p**hits * (1 - p) ** (t - hits))

    # weight="alg" integrates f(q) q^(a-1) (1-q)^(b-1), endpoint singularities included; the same rule normalises.
    mixed = quad(likelihood_ratio, 0, 1, weight="alg", wvar=(a - 1, b - 1), epsabs=0, epsrel=1e-12)[0]
    integral = mixed / quad(lambda q: 1.0, 0, 1, weight="alg", wvar=(a - 1, b - 1), epsabs=0, epsrel=1e-12)[0]
    assert cs.log_mixture(hits, t, p) == pytest.approx(math.log(integral), abs=1e-8)


@pytest.mark.parametrize("t", [1, 4, 25])
@pytest.mark.parametrize("p", [0.2, 0.97])
def test_mixture_is_a_mean_one_martingale(t, p):
    """E_p[M_t(p)] = 1, and E_p[M_{t+1} | S_t] = M_t: the two facts Ville's inequality needs."""
    cs = BetaBinomialCS(0.1)
    hits = np.arange(t + 1)
    m_t = np.exp(cs.log_mixture(hits, t, p))
    assert np.sum(binom.pmf(hits, t, p) * m_t) == pytest.approx(1.0, rel=1e-12)
    next_step = p * np.exp(cs.log_mixture(hits + 1, t + 1, p)) + (1 - p) * np.exp(cs.log_mixture(hits, t + 1, p))
    np.testing.assert_allclose(next_step, m_t, rtol=1e-12)


GRID = [(1, 1), (1, 10), (5, 10), (10, 10), (3, 1000), (990, 1000), (1000, 1000),
        (50_000, 100_000), (99_900, 100_000), (100_000, 100_000), (1, 10**7), (10**7 - 1, 10**7)]


@pytest.mark.parametrize("alpha", [0.001, 0.05, 0.5])
@pytest.mark.parametrize("hits,t", GRID)
def test_lower_is_on_the_safe_side_of_the_boundary_and_tight(hits, t, alpha):
    cs = BetaBinomialCS(alpha)
    low = cs.lower(hits, t)
    assert 0.0 < low < hits / t
    log_bar = math.log(1 / alpha)
    # Sound: the reported value is excluded from C_t (so it is <= the boundary, g being decreasing below p-hat).
    assert cs.log_mixture(hits, t, low) >= log_bar
    # Tight: a point a relative 1e-9 higher is already inside C_t.
    assert cs.log_mixture(hits, t, low * (1 + 1e-9)) < log_bar


@pytest.mark.parametrize("hits,t", [(2, 7), (40, 50), (300, 300)])
def test_lower_agrees_with_a_dense_grid_search(hits, t):
    cs = BetaBinomialCS(0.01)
    grid = np.linspace(0, hits / t, 200_001)
    inside = grid[cs.log_mixture(hits, t, grid) < math.log(100)]
    assert cs.lower(hits, t) <= inside.min() <= cs.lower(hits, t) + 1e-5 * hits / t


@pytest.mark.parametrize("t", [1, 10, 1000, 100_000])
def test_all_hits_uniform_prior_closed_form(t):
    # Beta(1, 1): M_t(p) = 1 / ((t + 1) p^t), so the lower end is (alpha / (t + 1))^(1/t).
    alpha = 0.001
    assert BetaBinomialCS(alpha, 1.0, 1.0).lower(t, t) == pytest.approx((alpha / (t + 1)) ** (1 / t), rel=1e-12)


def test_lower_increases_with_hits_and_upper_mirrors_it():
    cs = BetaBinomialCS(0.01, 0.7, 1.3)
    t = 300
    lows = [cs.lower(k, t) for k in range(t + 1)]
    ups = [cs.upper(k, t) for k in range(t + 1)]
    assert lows[0] == 0.0 and ups[t] == 1.0
    assert all(b > a for a, b in zip(lows, lows[1:]))
    assert all(b > a for a, b in zip(ups, ups[1:]))
    assert all(lo < k / t < up or (lo <= k / t <= up) for k, (lo, up) in enumerate(zip(lows, ups)))
    mirror = BetaBinomialCS(0.01, 1.3, 0.7)
    for k in (0, 17, 150, 299, 300):
        assert cs.upper(k, t) == pytest.approx(1 - mirror.lower(t - k, t), abs=1e-15)


def test_lower_at_zero_draws_and_zero_hits_is_zero():
    cs = BetaBinomialCS(0.05)
    assert cs.lower(0, 0) == 0.0 and cs.upper(0, 0) == 1.0
    assert cs.lower(0, 10**6) == 0.0


def test_wider_than_clopper_pearson_at_fixed_n():
    """The price of time-uniformity: at a fixed n the sequence's bound is below Cohen's (here by < 3 %)."""
    for hits, n in [(99_000, 100_000), (100_000, 100_000), (9_500, 10_000)]:
        cp = beta.ppf(0.001, hits, n - hits + 1)
        assert 0.97 * cp < BetaBinomialCS(0.001).lower(hits, n) < cp


# ------------------------------------------------------------------ schedule and thresholds
def test_checkpoints():
    points = checkpoints(100_000, first=1000, growth=1.5, multiple=400)
    assert points[-1] == 100_000 and np.all(np.diff(points) > 0)
    assert np.all(points[:-1] % 400 == 0) and points[0] == 1200
    assert checkpoints(50, first=1000).tolist() == [50]
    assert checkpoints(10, first=1, growth=1.1).tolist() == list(range(1, 11))


def test_latent_thresholds_round_trip_with_the_radius():
    sigma, radii = 0.75, [0.0, 0.5, 1.0, 2.5]
    p = latent_thresholds(radii, sigma)
    np.testing.assert_allclose(p, norm.cdf(np.asarray(radii) / sigma))
    result = SequentialResult(p[2], 1.0, 0, 0, (), (), "budget")
    assert result.latent_radius(sigma) == pytest.approx(1.0, rel=1e-12)
    assert SequentialResult(0.5, 1.0, 0, 0, (), (), "budget").latent_radius(sigma) == 0.0


# ------------------------------------------------------------------ the driver
class Recorder:
    """A deterministic draw: ``hits_for(num)`` hits per call; remembers the sizes it was asked for."""

    def __init__(self, hits_for):
        self.hits_for, self.sizes = hits_for, []

    def __call__(self, num):
        self.sizes.append(num)
        return self.hits_for(num)


def test_driver_all_hits_certifies_at_the_first_sufficient_look():
    thresholds = latent_thresholds([0.5, 1.0, 1.5, 2.0], 0.75)
    draw = Recorder(lambda num: num)
    result = certify_sequential(draw, thresholds, alpha=0.001, budget=100_000)
    schedule = checkpoints(100_000)
    cs = BetaBinomialCS(0.001)
    expected = next(int(t) for t in schedule if cs.lower(int(t), int(t)) >= thresholds.max())
    assert result.samples == result.hits == expected == sum(draw.sizes)
    assert draw.sizes == np.diff(schedule[schedule <= expected], prepend=0).tolist()
    assert result.decisions == (Decision.CERTIFIED,) * 4 and result.stop_reason == "decided"
    assert result.p_lower == cs.lower(expected, expected) >= thresholds.max()
    assert result.latent_radius(0.75) >= 2.0


def test_driver_no_hits_refutes_at_the_first_look():
    draw = Recorder(lambda num: 0)
    result = certify_sequential(draw, [0.6, 0.9], alpha=0.001, budget=10_000, first=100)
    assert draw.sizes == [100] and result.samples == 100 and result.hits == 0
    assert result.decisions == (Decision.REFUTED, Decision.REFUTED) and result.stop_reason == "decided"
    assert result.p_lower == 0.0 and result.latent_radius(1.0) == 0.0


def test_driver_unreachable_within_the_budget():
    # 1,000 all-hit draws give a lower bound near 0.99 at alpha = 0.001: 0.9999 cannot be reached.
    result = certify_sequential(lambda num: num, [0.9, 0.9999], alpha=0.001, budget=1000, first=100)
    assert result.decisions == (Decision.CERTIFIED, Decision.UNREACHABLE)
    assert result.stop_reason == "decided" and result.samples < 1000


def test_driver_mixed_decisions_and_budget():
    # Exactly 95 % hits per call, looks at 1,000 and 2,000: 0.9 is certified and 0.99 refuted at the first look;
    # 0.93 still looks reachable then (rate 0.95+ for 1,000 more draws) and is left open when the budget runs out.
    draw = Recorder(lambda num: (95 * num) // 100)
    result = certify_sequential(draw, [0.9, 0.93, 0.99], alpha=0.01, budget=2000, first=1000, growth=2.0)
    assert result.decisions == (Decision.CERTIFIED, Decision.UNDECIDED, Decision.REFUTED)
    assert result.stop_reason == "budget" and result.samples == 2000 and draw.sizes == [1000, 1000]
    assert result.p_lower < 0.93 < result.p_upper


def test_driver_gives_up_on_a_threshold_the_budget_cannot_reach():
    # At 0.95 = the hit rate itself no budget suffices; the give-up rule stops long before 20,000 draws, earlier
    # with a looser give_up level.
    samples = {}
    for give_up in (0.01, 0.3):
        result = certify_sequential(
            lambda num: (95 * num) // 100, [0.95], alpha=0.01, budget=20_000, first=100, give_up=give_up
        )
        assert result.decisions == (Decision.UNREACHABLE,) and result.stop_reason == "decided"
        samples[give_up] = result.samples
    assert samples[0.3] <= samples[0.01] < 20_000
    # With give_up = alpha and a budget of a million draws, the upper bound refutes 0.99 first.
    result = certify_sequential(
        lambda num: (95 * num) // 100, [0.99], alpha=0.01, budget=10**6, first=100, give_up=0.01
    )
    assert result.decisions == (Decision.REFUTED,) and result.p_upper < 0.99


def test_driver_without_thresholds_runs_to_the_budget():
    draw = Recorder(lambda num: num)
    result = certify_sequential(draw, alpha=0.001, budget=5000)
    assert result.samples == 5000 and result.stop_reason == "budget" and result.decisions == ()
    assert result.p_lower == BetaBinomialCS(0.001).lower(5000, 5000)


def test_driver_running_bounds_never_loosen():
    # A burst of misses after a clean start: the running max keeps the earlier, larger lower bound.
    calls = iter([1000, 0, 0, 0])
    result = certify_sequential(lambda num: min(next(calls), num), alpha=0.05, budget=4000, first=1000, growth=2.0)
    cs = BetaBinomialCS(0.05)
    assert result.p_lower == cs.lower(1000, 1000) > cs.lower(1000, 4000)


def test_driver_accepts_numpy_integer_counts():
    rng = np.random.default_rng(0)
    result = certify_sequential(lambda num: rng.binomial(num, 0.99), [0.9], alpha=0.001, budget=10_000)
    assert result.decisions == (Decision.CERTIFIED,) and isinstance(result.hits, int)


# ------------------------------------------------------------------ argument errors
@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(alpha=0.0), ValueError),
        (dict(alpha=1.0), ValueError),
        (dict(budget=0), ValueError),
        (dict(budget=10.5), TypeError),
        (dict(thresholds=[0.5, 1.0]), ValueError),
        (dict(thresholds=[0.0]), ValueError),
        (dict(thresholds=[float("nan")]), ValueError),
        (dict(growth=1.0), ValueError),
        (dict(first=0), ValueError),
        (dict(multiple=0), ValueError),
        (dict(prior=(0.0, 1.0)), ValueError),
        (dict(give_up=1.0), ValueError),
    ],
)
def test_driver_rejects_bad_arguments(kwargs, error):
    args = dict(thresholds=[0.9], alpha=0.01, budget=1000) | kwargs
    thresholds = args.pop("thresholds")
    with pytest.raises(error):
        certify_sequential(lambda num: num, thresholds, **args)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (11, ValueError), (2.5, TypeError), (None, TypeError)])
def test_driver_rejects_impossible_draw_results(bad, error):
    with pytest.raises(error, match="draw"):
        certify_sequential(lambda num: bad, [0.9], alpha=0.01, budget=10, first=10)


def test_confidence_sequence_rejects_bad_arguments():
    with pytest.raises(ValueError):
        BetaBinomialCS(1.5)
    with pytest.raises(ValueError):
        BetaBinomialCS(0.05, b=-1.0)
    cs = BetaBinomialCS(0.05)
    with pytest.raises(ValueError):
        cs.lower(11, 10)
    with pytest.raises(ValueError):
        cs.upper(-1, 10)
    with pytest.raises(TypeError):
        cs.lower(1.5, 10)
    with pytest.raises(ValueError):
        latent_thresholds([-0.1], 0.5)
    with pytest.raises(ValueError):
        latent_thresholds([1.0], 0.0)
