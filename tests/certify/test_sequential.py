"""Tests of splitz_fast.certify.sequential: the beta-binomial mixture confidence sequence and the sequential driver.

The central check is validity under optional stopping: an adversary who stops a Bernoulli(p) stream the first time
the lower bound exceeds the true p must succeed on at most an α fraction of streams. The same check, applied to a
naive stopper that re-uses the fixed-n Clopper–Pearson bound at every look, must fail — so the check has teeth.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.stats import beta, binom, binomtest, norm

from splitz_fast.certify import sequential
from splitz_fast.certify.sequential import (
    BetaBinomialCS,
    Decision,
    SequentialCertifier,
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
        (dict(thresholds=[0.5, 1.5]), ValueError),
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


# ------------------------------------------------------------------ with a Smoother (SequentialCertifier)
import json  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import splitz_fast as sz  # noqa: E402
import splitz_fast.data.datasets as datasets  # noqa: E402
from splitz_fast import ABSTAIN, BoundOptions, ClippedReLU, LeftHalf, Smoother, SplitModel  # noqa: E402
from splitz_fast.analysis.tables import load_runs  # noqa: E402
from splitz_fast.cli.main import main  # noqa: E402
from splitz_fast.data.datasets import DatasetInfo  # noqa: E402


class LinearBinary(nn.Module):
    """Class 1 iff ``w·u + b > 0``: under ``N(0, σ² I)`` noise, ``P[class 1] = Φ((w·u + b) / (σ‖w‖))``."""

    def __init__(self, w: torch.Tensor, b: float):
        super().__init__()
        self.register_buffer("w", w.flatten().float())
        self.b = float(b)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        s = u.flatten(1) @ self.w + self.b
        return torch.stack([torch.zeros_like(s), s], dim=1)


SIGMA = 0.5
SHAPE = (1, 6, 6)


def rs_model_with_p(p_a: float) -> tuple[SplitModel, torch.Tensor]:
    """Plain RS (split 0) of a linear f_R and an input ``x = 0`` at which class 1 has probability ``p_a``."""
    w = torch.zeros(SHAPE)
    w[0, 0, 0] = 1.0
    model = SplitModel(LeftHalf([], [], input_shape=SHAPE), LinearBinary(w, SIGMA * norm.ppf(p_a)), 2)
    return model, torch.zeros(SHAPE)


def splitz_model() -> SplitModel:
    """f_L = conv 1→3 (3×3, padding 1) + clipped ReLU on 6×6; f_R votes class 1 iff the latent mean exceeds −0.13,
    which under the noise holds with probability ≈ Φ(3) ≈ 0.9987 on the inputs below (L(x, ε) ≈ 0.4)."""
    torch.manual_seed(0)
    left = LeftHalf([nn.Conv2d(1, 3, 3, padding=1)], [ClippedReLU(1.0)], input_shape=SHAPE)
    with torch.no_grad():
        left.layers[0].weight.mul_(0.5)
    return SplitModel(left, LinearBinary(torch.full((3, 6, 6), 1 / 108), 0.13), 2)


def without_seconds(result) -> dict:
    d = result.as_dict()
    d.pop("seconds")
    return d


def test_split0_decisions_match_the_thresholds_of_a_known_p_a():
    # p_A = 0.995: Φ(ε/σ) = 0.69, 0.84, 0.977 below it (certified), 0.99865, 0.99997 above it (refuted or given up).
    model, x = rs_model_with_p(0.995)
    radii = [0.25, 0.5, 1.0, 1.5, 2.0]
    result = SequentialCertifier(Smoother(model, SIGMA), radii).certify(x, 100, 100_000, 0.001, seed=0)
    assert result.prediction == 1
    certified = [r for r, d in zip(radii, result.decisions) if d is Decision.CERTIFIED]
    assert certified == [0.25, 0.5, 1.0]
    assert all(d in (Decision.REFUTED, Decision.UNREACHABLE) for d in result.decisions[3:])
    for r, d in zip(radii, result.decisions):
        if d is Decision.CERTIFIED:
            assert result.p_a_lower >= norm.cdf(r / SIGMA)
    assert result.p_a_lower <= 0.995  # the CS event (seeded, so this is a fixed check)
    # Split 0: L = 1 and the radius is Cohen's σ Φ⁻¹(p_lower), at least every certified ε, below the refuted ones.
    assert result.bound_kind == "identity" and result.lipschitz == 1.0
    assert result.radius == pytest.approx(SIGMA * norm.ppf(result.p_a_lower), rel=1e-12)
    assert 1.0 <= result.radius < 1.5
    assert result.n < 100_000 and result.stop_reason == "decided" and result.failure_prob == 0.001


def test_easy_input_stops_far_below_the_budget_and_counts_its_samples():
    model, x = rs_model_with_p(1 - 1e-12)  # every draw votes class 1
    result = SequentialCertifier(Smoother(model, SIGMA), [0.5, 1.0]).certify(x, 100, 100_000, 0.001, seed=1)
    assert result.decisions == (Decision.CERTIFIED, Decision.CERTIFIED)
    assert result.count_a == result.n < 5_000
    assert result.n == next(int(t) for t in checkpoints(100_000) if BetaBinomialCS(0.001).lower(int(t), int(t))
                            >= norm.cdf(1.0 / SIGMA))


def test_decisions_about_a_float64_input_shrink_with_its_radius():
    """A float64 input is certified about its float32 rounding x̃; about x itself the radius loses ‖x − x̃‖, and an ε
    certified about x̃ beyond that radius is no longer a decision about x."""
    model, x = rs_model_with_p(1 - 1e-12)
    result = SequentialCertifier(Smoother(model, SIGMA), [0.5, 1.0]).certify(x, 100, 100_000, 0.001, seed=1)
    assert result.decisions == (Decision.CERTIFIED, Decision.CERTIFIED)
    at_one = dataclasses.replace(result, radius=1.0)  # as if the largest certified ε were the radius
    about = sequential._about_given_input(at_one, 1e-6)
    assert about.radius < 1.0 and about.input_rounding == 1e-6
    assert about.decisions == (Decision.CERTIFIED, Decision.UNDECIDED)
    assert sequential._about_given_input(at_one, 0.0).decisions == result.decisions
    x64 = x.double() + 1e-9  # end to end: not representable in float32, so rounded by at most ~1e-9 per pixel
    given = SequentialCertifier(Smoother(model, SIGMA), [0.5, 1.0]).certify(x64, 100, 100_000, 0.001, seed=1)
    assert 0 < given.input_rounding and given.radius == pytest.approx(result.radius - given.input_rounding, abs=1e-15)
    for eps, d in zip(given.radii, given.decisions):
        assert d is not Decision.CERTIFIED or eps <= given.radius


def test_abstains_when_the_lower_bound_stays_at_most_one_half():
    model, x = rs_model_with_p(0.5)
    result = SequentialCertifier(Smoother(model, SIGMA), [0.5]).certify(x, 100, 20_000, 0.001, seed=2)
    assert result.prediction == ABSTAIN and result.radius == 0.0 and result.p_a_lower <= 0.5
    assert result.decisions == (Decision.REFUTED,) and result.n < 20_000


def test_reproducible_for_a_seed_whatever_the_batch_size():
    model = splitz_model()
    certifier = SequentialCertifier(Smoother(model, SIGMA, bound_options=BoundOptions(gamma_steps=3)), [0.5, 1.0, 2.0])
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(3))
    first = certifier.certify(x, 100, 20_000, 0.001, batch_size=512, seed=7)
    again = certifier.certify(x, 100, 20_000, 0.001, batch_size=333, seed=7)
    assert without_seconds(first) == without_seconds(again)


@pytest.mark.slow
def test_splitz_certified_radii_are_consistent_with_the_reported_radius():
    model = splitz_model()
    smoother = Smoother(model, SIGMA, bound_options=BoundOptions(bound_method="exact", gamma_steps=3))
    radii = [0.5, 1.0, 2.0, 3.0, 5.0]
    certifier = SequentialCertifier(smoother, radii)
    xs = torch.rand(2, *SHAPE, generator=torch.Generator().manual_seed(4))
    results = list(certifier.certify_many(xs, 100, 20_000, 0.001, seeds=[10, 11]))
    assert without_seconds(results[1]) == without_seconds(certifier.certify(xs[1], 100, 20_000, 0.001, seed=11))
    seen = set()
    for x, r in zip(xs, results):
        # Exact bounds are deterministic: the same L(x, ε) the certifier computed.
        lips = sz.lipschitz_bound(model.left, x.expand(len(radii), *SHAPE), torch.tensor(radii, dtype=torch.float64),
                                  method="exact").value.numpy()
        thresholds = norm.cdf(np.asarray(radii) * lips / SIGMA)
        for eps, p_j, d in zip(radii, thresholds, r.decisions):
            seen.add(d)
            if d is Decision.CERTIFIED:
                assert r.p_a_lower >= p_j and r.radius >= eps
            elif d is Decision.REFUTED:
                assert r.p_a_lower < p_j
        if r.prediction == ABSTAIN:
            assert r.radius == 0.0 and Decision.CERTIFIED not in r.decisions
            continue
        # The radius is the better of the largest certified ε and the γ search from p_lower.
        search = smoother.radius_search.search(x, SIGMA * norm.ppf(r.p_a_lower), None)
        best_eps = max([e for e, d in zip(radii, r.decisions) if d is Decision.CERTIFIED], default=0.0)
        assert r.radius == pytest.approx(max(best_eps, search.radius), rel=1e-12)
        assert r.bound_kind == "local-exact" and r.failure_prob == 0.001
        assert r.latent_radius == pytest.approx(SIGMA * norm.ppf(r.p_a_lower), rel=1e-12)
        assert r.gamma_evaluations == len(radii) + search.evaluations
    assert Decision.CERTIFIED in seen and len(seen) >= 2


def test_probabilistic_bounds_add_their_delta_to_alpha():
    smoother = Smoother(splitz_model(), SIGMA,
                        bound_options=BoundOptions(bound_method="probabilistic", bound_delta=1e-4, power_iters=16))
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(5))
    result = SequentialCertifier(smoother, [0.5, 1.0]).certify(x, 100, 5_000, 0.001, seed=0)
    assert result.prediction != ABSTAIN
    assert 0.001 < result.failure_prob <= 0.001 + 2e-4 + 1e-12  # ≤ δ for the ε's plus ≤ δ for the γ search


def test_global_bound_thresholds():
    model = splitz_model()
    smoother = Smoother(model, SIGMA, bound_options=BoundOptions(bound="global", bound_method="exact"))
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(6))
    result = SequentialCertifier(smoother, [0.5, 1.0]).certify(x, 100, 10_000, 0.001, seed=0)
    lip = float(smoother.radius_search.global_bound().value[0])
    assert result.prediction != ABSTAIN and result.decisions[0] is Decision.CERTIFIED
    for eps, d in zip([0.5, 1.0], result.decisions):
        if d is Decision.CERTIFIED:
            assert result.p_a_lower >= norm.cdf(eps * lip / SIGMA) and result.radius >= eps
    assert result.bound_kind == "global-exact"
    assert result.radius == pytest.approx(SIGMA * norm.ppf(result.p_a_lower) / lip, rel=1e-12)


def test_a_radius_whose_threshold_rounds_to_one_is_given_up_not_refused():
    model, x = rs_model_with_p(1 - 1e-12)
    result = SequentialCertifier(Smoother(model, SIGMA), [0.5, 10.0]).certify(x, 100, 100_000, 0.001, seed=0)
    assert result.decisions == (Decision.CERTIFIED, Decision.UNREACHABLE) and result.n < 5_000


@pytest.mark.parametrize("radii, kwargs, error, match", [
    ([0.0], {}, ValueError, "radii"),
    ([-1.0], {}, ValueError, "radii"),
    ([float("nan")], {}, ValueError, "radii"),
    (["1"], {}, TypeError, "radii"),
    ([1.0], dict(growth=1.0), ValueError, "growth"),
    ([1.0], dict(give_up=0.0), ValueError, "give_up"),
    ([1.0], dict(prior=(0.0, 1.0)), ValueError, "a"),
])
def test_certifier_rejects_bad_settings(radii, kwargs, error, match):
    model, _ = rs_model_with_p(0.9)
    with pytest.raises(error, match=match):
        SequentialCertifier(Smoother(model, SIGMA), radii, **kwargs)


def test_certifier_rejects_bad_calls():
    model, x = rs_model_with_p(0.9)
    certifier = SequentialCertifier(Smoother(model, SIGMA), [1.0])
    with pytest.raises(ValueError, match="budget"):
        certifier.certify(x, 100, 50, 0.001)
    with pytest.raises(ValueError, match="alpha"):
        certifier.certify(x, 10, 50, 1.0)
    with pytest.raises(TypeError, match="Smoother"):
        SequentialCertifier(model, [1.0])


# ------------------------------------------------------------------ the command line
@pytest.fixture
def tiny_checkpoint(tmp_path, monkeypatch, capsys):
    """A 4-feature, 2-class dataset under any name and an MLP (split 1) trained on it for two tiny epochs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=gen)
    info = DatasetInfo(TensorDataset(x, (x[:, 0] > 0).long()), (4,), 2, None, None, "tiny test data")
    monkeypatch.setattr(datasets, "get_dataset", lambda name, split, root=None: info)
    assert main(["train", "tiny", "mlp", str(tmp_path / "run"), "--sigma", "0.5", "--epochs", "1", "--batch", "8",
                 "--val-fraction", "0.25", "--lr-schedule", "none"]) == 0
    capsys.readouterr()
    return tmp_path / "run" / "best.pt"


def _certify(ckpt, out, *extra):
    return main(["certify", "tiny", str(ckpt), "0.5", str(out), "--skip", "8", "--N0", "10", "--N", "2000",
                 "--gamma-batch", "4", *extra])


@pytest.mark.slow
def test_cli_sequential_writes_a_tsv_that_analyze_reads(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "seq.tsv"
    assert _certify(tiny_checkpoint, out, "--sequential", "--radii", "0.1", "0.25", "--budget", "3000") == 0
    settings = json.loads((tmp_path / "seq.tsv.json").read_text())
    assert settings["sequential"] is True and settings["radii"] == [0.1, 0.25] and settings["budget"] == 3000
    assert settings["n"] == 3000
    rows = load_runs([out])
    table = next(iter(rows.values()))
    assert len(table.radius) == 5
    capsys.readouterr()
    assert main(["analyze", str(out), "--radii", "0.1", "0.25"]) == 0
    assert "seq" in capsys.readouterr().out
    # The rows are Cohen's columns plus SPLITZ's; resuming with the same arguments adds nothing.
    text = out.read_text()
    assert _certify(tiny_checkpoint, out, "--sequential", "--radii", "0.1", "0.25", "--budget", "3000",
                    "--resume") == 0
    assert out.read_text() == text
    # Without --budget the budget is --N.
    out2 = tmp_path / "seq2.tsv"
    assert _certify(tiny_checkpoint, out2, "--sequential", "--radii", "0.1", "--max", "2") == 0
    assert json.loads((tmp_path / "seq2.tsv.json").read_text())["budget"] == 2000


@pytest.mark.parametrize("extra, message", [
    (["--sequential"], "--sequential needs --radii"),
    (["--sequential", "--radii", "0", "1"], "--radii must be finite and > 0"),
    (["--sequential", "--radii", "-0.5"], "--radii must be finite and > 0"),
    (["--sequential", "--radii", "1", "--budget", "5"], "--N0 (10) must not exceed --budget (5)"),
    (["--sequential", "--radii", "1", "--budget", "0"], "--budget must be >= 1"),
    (["--radii", "1"], "add --sequential"),
    (["--budget", "100"], "add --sequential"),
])
def test_cli_sequential_bad_arguments_are_one_clear_line(tmp_path, capsys, extra, message):
    out = tmp_path / "bad.tsv"  # refused before the (missing) checkpoint is read
    assert _certify(tmp_path / "missing.pt", out, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()
