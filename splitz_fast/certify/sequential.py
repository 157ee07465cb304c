"""Sequential (anytime-valid) certification: estimate ``p_A`` with as few noise samples as the decision needs.

Cohen's CERTIFY fixes ``n`` in advance and applies a Clopper–Pearson bound once. Looking at that bound after every
batch and stopping when it is good enough ("optional stopping") voids its guarantee: the chance that *some* look
overstates ``p_A`` grows with the number of looks (``tests/certify/test_sequential.py`` measures it). This module replaces it
with a **confidence sequence** — bounds that hold at every sample size simultaneously — so a driver may stop as soon
as the question asked is decided, with the same per-input error ``α``.

The construction (:class:`BetaBinomialCS`) is Robbins' beta-binomial mixture martingale, made a confidence sequence
by Ville's inequality:

- H. Robbins (1970), *Statistical methods related to the law of the iterated logarithm*, Ann. Math. Statist. 41(5),
  1397–1409 (mixture of likelihood ratios over a conjugate prior).
- J. Ville (1939), *Étude critique de la notion de collectif* (``P(∃t: M_t ≥ 1/α) ≤ α`` for a nonnegative
  martingale with ``M_0 = 1``).
- S. R. Howard, A. Ramdas, J. McAuliffe, J. Sekhon (2021), *Time-uniform, nonparametric, nonasymptotic confidence
  sequences*, Ann. Statist. 49(2), 1055–1080 (modern treatment of mixture boundaries).
- For randomized smoothing: V. Voráček (2024), *Treatment of statistical estimation problems in randomized smoothing
  for adversarial robustness*, NeurIPS 2024 (confidence sequences to decide "robust at radius r?"); M. Z. Horváth et
  al. (2022), *Boosting randomized smoothing with variance reduced classifiers*, ICLR 2022 (adaptive sampling for
  predetermined radii).

The driver :func:`certify_sequential` is decoupled from sampling: it calls ``draw(num)``, which returns how many of
``num`` fresh noise samples the base classifier assigned to the (already selected) class ``ĉ_A``. Selection of
``ĉ_A`` stays Cohen's: ``n0`` separate draws by the caller, independent of the ones counted here.
:class:`SequentialCertifier` wires it to a :class:`~splitz_fast.certify.smoothing.Smoother`'s sampling engine and Lipschitz
bounds: the sequential counterpart of ``Smoother.certify`` / ``certify_many``, with the same result rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import operator
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import betaln, xlog1py, xlogy
from scipy.stats import norm

from .._checks import check_certify_counts, check_count, check_positive, check_probability
from ..bounds.lipschitz import lipschitz_bound
from ..model.modules import SplitModel
from ..kinds import GLOBAL, LOCAL, NO_BOUND, BoundKind
from .protocols import CertificationProtocol
from ..sampling.engine import NoiseStream, SamplingJob
from .inputs import evaluating, inputs_of, prepare_input, resolve_seed, with_seeds
from .smoothing import ABSTAIN, CertifyResult, Smoother, about_given_input


def _check_counts(hits: int, t: int) -> tuple[int, int]:
    try:
        hits, t = operator.index(hits), operator.index(t)
    except TypeError:
        raise TypeError(f"hits and t must be integers, got {type(hits).__name__} and {type(t).__name__}") from None
    if t < 0 or not 0 <= hits <= t:
        raise ValueError(f"need 0 <= hits <= t, got hits={hits}, t={t}")
    return hits, t


@dataclass(frozen=True)
class BetaBinomialCS:
    """Two-sided ``1 − α`` confidence sequence for a Bernoulli mean ``p`` (Robbins' beta-binomial mixture).

    **Construction.** For a candidate ``p ∈ (0, 1)`` and ``S_t`` hits in ``t`` draws, mix the likelihood ratio of
    ``Bernoulli(q)`` against ``Bernoulli(p)`` over the prior ``q ~ Beta(a, b)``::

        M_t(p) = ∫ q^S (1−q)^(t−S) dBeta(q; a, b) / (p^S (1−p)^(t−S))
               = B(a + S, b + t − S) / (B(a, b) · p^S (1−p)^(t−S)).

    ``C_t = {p : M_t(p) < 1/α}`` is the confidence set after ``t`` draws.

    **Why it is valid at every t at once.** If the draws are i.i.d. ``Bernoulli(p)`` (fresh noise per sample; it is
    enough that each draw has conditional mean ``p`` given the past), then for every fixed ``q`` the likelihood
    ratio ``∏ q^X (1−q)^(1−X) / (p^X (1−p)^(1−X))`` is a nonnegative martingale with mean 1 (one factor has
    expectation ``q + (1 − q) = 1``), hence so is its ``q``-mixture ``M_t(p)`` (Fubini), with ``M_0 = 1``. Ville's
    inequality gives ``P(∃t ≥ 0: M_t(p) ≥ 1/α) ≤ α``, i.e. ``P(∃t: p ∉ C_t) ≤ α``. The bound therefore survives
    any stopping rule and any data-dependent batch schedule, and both ends of ``C_t`` are covered by this single
    ``α`` (no split between the lower and upper side). On the same event ``p`` lies in every ``C_s``, so running
    maxima of lower bounds and minima of upper bounds are valid too.

    **Shape of C_t.** ``log M_t(p) = const − S log p − (t − S) log(1 − p)`` is convex in ``p`` with its minimum at
    ``p̂ = S/t``, where ``M_t(p̂) ≤ 1`` (the marginal likelihood is at most the maximum likelihood). So ``C_t`` is an
    interval around ``p̂`` and its lower end is the unique root of ``log M_t(p) = log(1/α)`` in ``(0, p̂)``
    (0 when ``S = 0``).

    **Prior.** Any ``a, b > 0`` gives a valid sequence; the prior only moves where it is tight. The default Jeffreys
    prior ``Beta(1/2, 1/2)`` puts more mass near 0 and 1 than the uniform one, which suits randomized smoothing
    (``p_A`` is usually above 0.9). It must be fixed before the counted draws (it may depend on the independent
    selection draws).
    """

    alpha: float
    a: float = 0.5
    b: float = 0.5

    def __post_init__(self) -> None:
        check_probability("alpha", self.alpha)
        check_positive("a", self.a)
        check_positive("b", self.b)

    def log_mixture(self, hits, t, p):
        """``log M_t(p)`` (vectorised over numpy arrays; ``p`` in ``[0, 1]``, ``+inf`` where ``p`` is impossible)."""
        hits, t, p = np.asarray(hits, dtype=float), np.asarray(t, dtype=float), np.asarray(p, dtype=float)
        with np.errstate(divide="ignore"):
            log_lik = xlogy(hits, p) + xlog1py(t - hits, -p)
        return betaln(self.a + hits, self.b + t - hits) - betaln(self.a, self.b) - log_lik

    def lower(self, hits: int, t: int) -> float:
        """Lower end of ``C_t``, rounded down: never above the exact boundary (0 when ``hits = 0``)."""
        hits, t = _check_counts(hits, t)
        return float(_lower_end(hits, t, self.a, self.b, math.log(1.0 / self.alpha)))

    def upper(self, hits: int, t: int) -> float:
        """Upper end of ``C_t`` (1 when ``hits = t``): by the symmetry ``p ↔ 1 − p``, ``hits ↔ t − hits``,
        ``a ↔ b``. Certificates use only :meth:`lower`; this side only lets a driver give up early."""
        hits, t = _check_counts(hits, t)
        return float(1.0 - _lower_end(t - hits, t, self.b, self.a, math.log(1.0 / self.alpha)))


def _lower_end(hits: int, t: int, a: float, b: float, log_inv_alpha: float) -> float:
    """Largest ``p`` the search can *prove* is ≤ the root of ``log M_t(p) = log(1/α)`` on ``(0, hits/t)``.

    ``g(p) = log M_t(p) − log(1/α)`` is strictly decreasing on ``(0, p̂)`` (convexity, minimum at ``p̂``), so any
    ``p < p̂`` with ``g(p) ≥ 0`` lies at or below the root. brentq locates the root; the returned value is then
    stepped down until ``g`` is non-negative with a margin covering the floating-point error of evaluating ``g``.
    """
    if hits == 0:
        return 0.0
    p_hat = hits / t
    log_marginal = betaln(a + hits, b + t - hits) - betaln(a, b)

    def g(p: float) -> float:
        return log_marginal - xlogy(hits, p) - xlog1py(t - hits, -p) - log_inv_alpha

    def surely_excluded(p: float) -> bool:
        terms = abs(log_marginal) + abs(xlogy(hits, p)) + abs(xlog1py(t - hits, -p)) + log_inv_alpha
        return g(p) >= 64 * np.finfo(float).eps * (1.0 + terms)

    # g(p) ≥ log_marginal − hits·log p − log(1/α) because −(t − hits)·log(1 − p) ≥ 0; this p makes that ≥ hits.
    p_lo = math.exp((log_marginal - log_inv_alpha) / hits - 1.0)
    if p_lo == 0.0 or not surely_excluded(p_lo):
        return 0.0  # bracket underflows: 0 is always a valid lower bound
    root = brentq(g, p_lo, p_hat, xtol=1e-300, rtol=8 * np.finfo(float).eps, maxiter=200)
    step = 16 * np.finfo(float).eps * root
    candidate = root - step
    while candidate > p_lo and not surely_excluded(candidate):
        step *= 4.0
        candidate = root - step
    return max(candidate, p_lo)


def latent_thresholds(latent_radii: Sequence[float], sigma: float) -> np.ndarray:
    """Thresholds ``Φ(R_j / σ)`` on ``p_A``: certified at latent radius ``R_j`` iff ``p_A_lower ≥ Φ(R_j / σ)``,
    because Cohen's radius ``σ Φ⁻¹(p_A_lower)`` is increasing in ``p_A_lower``.

    For SPLITZ the caller converts an input-space radius ε into the latent radius it needs, ``R_j = ε · L(x, ε)``
    (the Lipschitz bound over ``B(x, ε)``, computed before sampling; its failure probability is added to α by the
    caller). For plain RS (``f_L`` = identity) ``R_j = ε``.
    """
    sigma = check_positive("sigma", sigma)
    radii = np.asarray(latent_radii, dtype=float).reshape(-1)
    if not np.all(np.isfinite(radii)) or np.any(radii < 0):
        raise ValueError(f"latent_radii must be finite and >= 0, got {radii.tolist()}")
    return norm.cdf(radii / sigma)


def checkpoints(budget: int, first: int = 256, growth: float = 1.3, multiple: int = 1) -> np.ndarray:
    """Sample counts at which the driver looks at the data: ``first``, then ×``growth`` each time, each rounded up
    to a multiple of ``multiple`` (a static f_R batch shape), strictly increasing, the last one equal to ``budget``.
    """
    check_count("budget", budget, 1)
    check_count("first", first, 1)
    check_count("multiple", multiple, 1)
    if not (isinstance(growth, (int, float)) and growth > 1.0 and math.isfinite(growth)):
        raise ValueError(f"growth must be a finite number > 1, got {growth}")
    points, target = [], float(first)
    while True:
        t = min(budget, multiple * math.ceil(target / multiple))
        if not points or t > points[-1]:
            points.append(t)
        if t == budget:
            return np.asarray(points, dtype=np.int64)
        target *= growth


class Decision(str, enum.Enum):
    """Outcome for one threshold ``p_j``."""

    CERTIFIED = "certified"      # CS lower bound ≥ p_j: certified at that radius (on the 1 − α event)
    REFUTED = "refuted"          # CS upper bound < p_j: p_A < p_j with probability ≥ 1 − α
    UNREACHABLE = "unreachable"  # given up: the rest of the budget would not lift the lower bound to p_j
    UNDECIDED = "undecided"      # the budget ran out first


@dataclass(frozen=True)
class SequentialResult:
    """What :func:`certify_sequential` found for one input.

    ``p_lower`` / ``p_upper`` are the running max / min of the confidence-sequence ends over the looks made; with
    probability ≥ 1 − α, ``p_lower ≤ p_A ≤ p_upper`` (jointly, whatever the stopping rule). ``decisions[j]`` belongs
    to ``thresholds[j]``; ``stop_reason`` is ``"decided"`` (every threshold decided) or ``"budget"``.
    """

    p_lower: float
    p_upper: float
    hits: int
    samples: int
    thresholds: tuple[float, ...]
    decisions: tuple[Decision, ...]
    stop_reason: str

    def latent_radius(self, sigma: float) -> float:
        """Cohen's radius ``σ Φ⁻¹(p_lower)`` (0 where ``p_lower ≤ 1/2``, i.e. abstain)."""
        sigma = check_positive("sigma", sigma)
        return float(sigma * norm.ppf(self.p_lower)) if self.p_lower > 0.5 else 0.0


def certify_sequential(
    draw: Callable[[int], int],
    thresholds: Sequence[float] = (),
    *,
    alpha: float,
    budget: int,
    first: int = 256,
    growth: float = 1.3,
    multiple: int = 1,
    prior: tuple[float, float] = (0.5, 0.5),
    give_up: float = 0.3,
) -> SequentialResult:
    """Estimate ``p_A`` for a fixed class with a confidence sequence, stopping once every threshold is decided.

    ``draw(num)`` must return the number of hits (samples classified as ``ĉ_A``) among ``num`` *fresh* noise samples;
    the caller owns noise and seeds. ``thresholds`` are probabilities ``p_j ∈ (0, 1]`` — for radii use
    :func:`latent_thresholds`; ``p_j = 1`` (a radius whose ``Φ(R_j/σ)`` rounds to 1) is never certified, because
    the lower bound stays below 1 after finitely many draws, and is given up at the first look. The driver draws up
    to each of :func:`checkpoints` ``(budget, first, growth, multiple)``; after each draw it updates the bounds of
    :class:`BetaBinomialCS` ``(alpha, *prior)`` and decides every open threshold it can:

    - ``CERTIFIED`` when ``p_lower ≥ p_j``; ``REFUTED`` when ``p_upper < p_j``;
    - ``UNREACHABLE`` (a give-up rule) when, even if the rest of the budget hit at rate ``p_hope`` — the upper end
      of the same mixture at the looser level ``give_up`` (running min) — the lower bound at ``budget`` would stay
      below ``p_j``. ``give_up = alpha`` gives up late; larger values (default 0.3) save the samples that inputs just
      below a threshold would burn, at the price of rare near-threshold certificates.

    It stops when no threshold is open (``"decided"``; never with an empty ``thresholds``) or at ``budget``.
    Use case "largest radius within a budget": pass no thresholds and read :meth:`SequentialResult.latent_radius`.

    **Error.** Every ``CERTIFIED`` decision and ``p_lower`` hold simultaneously with probability ≥ 1 − α (one
    confidence sequence, valid at the data-dependent stopping time; see :class:`BetaBinomialCS`). ``REFUTED`` and
    ``UNREACHABLE`` only decide when to stop spending samples: a wrong one loses a certificate, never creates one,
    so ``give_up`` spends no α. The caller adds the failure probability of a probabilistic Lipschitz bound to α.
    """
    cs = BetaBinomialCS(alpha, *prior)
    hope = BetaBinomialCS(check_probability("give_up", give_up), *prior)
    targets = np.asarray(thresholds, dtype=float).reshape(-1)
    if not np.all((targets > 0.0) & (targets <= 1.0)):
        raise ValueError(f"thresholds must lie in (0, 1], got {targets.tolist()}")
    decisions = [Decision.UNDECIDED] * len(targets)
    hits = samples = 0
    p_lower, p_upper, p_hope = 0.0, 1.0, 1.0
    stop_reason = "budget"
    for t in checkpoints(budget, first, growth, multiple).tolist():
        num = t - samples
        new_hits = draw(num)
        try:
            new_hits = operator.index(new_hits)
        except TypeError:
            raise TypeError(f"draw({num}) must return an integer count, got {type(new_hits).__name__}") from None
        if not 0 <= new_hits <= num:
            raise ValueError(f"draw({num}) returned {new_hits} hits, outside [0, {num}]")
        hits, samples = hits + new_hits, t
        p_lower = max(p_lower, cs.lower(hits, samples))
        p_upper = min(p_upper, cs.upper(hits, samples))
        p_hope = min(p_hope, hope.upper(hits, samples))
        hoped_lower = cs.lower(hits + math.ceil(p_hope * (budget - samples)), budget)
        for j, p_j in enumerate(targets):
            if decisions[j] is not Decision.UNDECIDED:
                continue
            if p_lower >= p_j:
                decisions[j] = Decision.CERTIFIED
            elif p_upper < p_j:
                decisions[j] = Decision.REFUTED
            elif samples < budget and max(p_lower, hoped_lower) < p_j:
                decisions[j] = Decision.UNREACHABLE
        if len(targets) and Decision.UNDECIDED not in decisions:
            stop_reason = "decided"
            break
    return SequentialResult(
        p_lower=p_lower,
        p_upper=p_upper,
        hits=hits,
        samples=samples,
        thresholds=tuple(float(p) for p in targets),
        decisions=tuple(decisions),
        stop_reason=stop_reason,
    )


# ---------------------------------------------------------------------------------------------------- with a Smoother
@dataclass
class SequentialCertifyResult(CertifyResult):
    """A :class:`~splitz_fast.certify.smoothing.CertifyResult` of :class:`SequentialCertifier` — a row of the usual TSV —
    with ``n`` = the estimation samples drawn (selection draws not counted, as in Cohen's ``n``), ``count_a`` = their
    hits and ``p_a_lower`` = the confidence-sequence lower bound at the stop; plus ``radii`` (the ε asked for, raw
    input units), their ``decisions`` and the driver's ``stop_reason``."""

    radii: tuple[float, ...] = ()
    decisions: tuple[Decision, ...] = ()
    stop_reason: str = ""


@dataclass(frozen=True)
class _RadiusBounds:
    """``L(x, ε_j)`` for the requested ε's: ``values [k]``, ``kinds`` (``local-exact``, …), the summed failure
    probability of the probabilistic ones and how many bound evaluations they took."""

    values: np.ndarray
    kinds: list[str]
    failure: float
    evaluations: int


def _about_given_input(result: SequentialCertifyResult, rounding: float) -> SequentialCertifyResult:
    """:func:`~splitz_fast.certify.outcomes.about_given_input` for a sequential row: the radius shrinks by the input's
    rounding distance, and so must the decisions: an ``ε_j`` certified about the rounded input but beyond the radius
    about the input as given is not certified about it (``UNDECIDED``)."""
    about = about_given_input(result, rounding)
    decisions = tuple(Decision.UNDECIDED if d is Decision.CERTIFIED and not eps <= about.radius else d
                      for eps, d in zip(about.radii, about.decisions))
    return dataclasses.replace(about, decisions=decisions)


class SequentialCertifier:
    """Sequential CERTIFY with a :class:`~splitz_fast.certify.smoothing.Smoother`: decide "certified at ε_j?" for a list of
    input-space radii with as few noise samples as the decisions need, and report a Cohen-style row.

    Per input ``x`` (seed ``s``), with ``σ``, ``f_L``, the bound options and the γ search of ``smoother``:

    1. **Thresholds before sampling.** ``L_j = L(x, ε_j)`` for every ε in one batched
       :func:`~splitz_fast.bounds.lipschitz.lipschitz_bound` call (``bound="global"``: the global bound; split 0: ``L = 1``);
       a probabilistic bound gets ``bound_delta / (k · depth)`` per factor, so the k bounds together fail with
       probability ``δ_ε ≤ bound_delta``. ``R_j = ε_j · L_j`` and ``p_j = Φ(R_j / σ)`` (rounded up, and at least the
       next double above 1/2).
    2. **Selection.** ``n0`` draws of the input's :class:`~splitz_fast.sampling.engine.NoiseStream` pick ``ĉ_A`` (ties to
       the lowest index).
    3. **Estimation.** :func:`certify_sequential` draws the next samples of the same stream (consecutive ranges,
       disjoint from the selection's, so independent of ``ĉ_A``) through the smoother's engine and counts ``ĉ_A``,
       up to ``budget`` draws, stopping once every ``p_j`` is decided.
    4. **Radius.** ``radius = max(largest certified ε_j, γ-search radius)``, the latter from
       ``smoother.radius_search.search(x, σ Φ⁻¹(p_lower))`` when ``p_lower > 1/2``; abstain (``-1``, radius 0) when
       ``p_lower ≤ 1/2`` (then no ε is certified either: every ``p_j > 1/2``).

    **Why the certificate holds (proof sketch).** Let ``E`` be the event "``p_A(ĉ_A) ≥ p_lower``". Given ``ĉ_A`` (a
    function of the selection draws only), the estimation hits are i.i.d. Bernoulli(``p_A``), so by
    :class:`BetaBinomialCS` ``P(not E) ≤ α`` at the data-dependent stopping time. Let ``B_ε`` be "every
    ``L(x, ε_j)`` is an upper bound" (``P(not B_ε) ≤ δ_ε``) and ``B_γ`` the same for the bounds the γ search
    evaluates (``P(not B_γ) ≤`` its reported failure). On ``E``: ``p_A > 1/2`` so ``ĉ_A`` is the smoothed prediction
    and the latent radius ``R = σ Φ⁻¹(p_lower)`` is certified for ``f_R`` at ``f_L(x)`` (Cohen et al.). On
    ``E ∩ B_ε``: a certified ε_j has ``p_lower ≥ p_j``, hence ``R ≥ R_j = ε_j L(x, ε_j)``, and Theorem 1 at
    ``γ = ε_j`` gives radius ``min(R / L(x, ε_j), ε_j) = ε_j``. On ``E ∩ B_γ``: the search's radius is Theorem 1's
    at its best γ. Both radii rest on the same ``E``, so their maximum fails with probability at most
    ``α + δ_ε + δ_γ`` — the ``failure_prob`` reported (a global bound used by both is counted twice: conservative).
    ``REFUTED``/``UNREACHABLE`` decisions only stop sampling; they never create a certificate.

    Args:
        smoother: supplies the model, σ, the sampling engine, the bound options and the γ search.
        radii: the ε_j (raw input units, each finite and > 0), in any order. Empty: no early stop — the budget is
            spent and the γ search gives the largest radius within it.
        first: estimation draws before the first look (the look schedule of :func:`certify_sequential`;
            ``multiple`` is 1: the engine batches the draws of any look itself).
        growth: factor between consecutive looks (> 1).
        give_up: the level below which a radius is declared unreachable and sampling for it stops.
        prior: the confidence sequence's Beta prior ``(a, b)``.
    """

    def __init__(self, smoother: Smoother, radii: Sequence[float], *, first: int = 256, growth: float = 1.3,
                 give_up: float = 0.3, prior: tuple[float, float] = (0.5, 0.5)):
        if not isinstance(smoother, Smoother):
            raise TypeError(f"smoother must be a splitz_fast.Smoother, got {type(smoother).__name__}")
        if not smoother.protocol.certificate:
            raise ValueError(f"sequential certification decides certificates; the smoother's protocol "
                             f"{smoother.protocol.name!r} is an estimate (use protocol='sound')")
        radii = tuple(radii)
        if any(isinstance(r, bool) or not isinstance(r, (int, float)) for r in radii):
            raise TypeError(f"radii must be numbers, got {list(radii)}")
        if not all(math.isfinite(r) and r > 0 for r in radii):
            raise ValueError(f"radii must be finite and > 0 (raw input units), got {list(radii)}")
        checkpoints(1, first, growth)  # validates first and growth
        BetaBinomialCS(check_probability("give_up", give_up), *prior)  # validates the prior
        self.smoother = smoother
        self.radii = tuple(float(r) for r in radii)
        self.first, self.growth, self.give_up, self.prior = first, growth, give_up, tuple(prior)

    @property
    def model(self) -> SplitModel:
        return self.smoother.model

    @property
    def sigma(self) -> float:
        return self.smoother.sigma

    @property
    def protocol(self) -> CertificationProtocol:
        """The smoother's protocol: always a certificate (estimates are refused at construction)."""
        return self.smoother.protocol

    def certify(self, x: torch.Tensor, n0: int, budget: int, alpha: float, batch_size: int | None = None,
                seed: int | None = None) -> SequentialCertifyResult:
        """Sequential CERTIFY of one input ``x: [*input_shape]`` (class docstring): ``n0`` selection draws, then at
        most ``budget`` estimation draws; ``alpha`` is the confidence sequence's level. ``batch_size``: ``f_R``'s batch
        (``None``: the smoother's measured one); it does not change the noise the input sees."""
        with contextlib.closing(self.certify_many([x], n0, budget, alpha, batch_size=batch_size,
                                                  seeds=[seed])) as results:
            return next(results)

    def certify_many(self, inputs: torch.Tensor | Iterable[torch.Tensor], n0: int, budget: int, alpha: float,
                     batch_size: int | None = None, seeds: Iterable[int | None] | None = None
                     ) -> Iterator[SequentialCertifyResult]:
        """:meth:`certify` for every input (a ``[M, *input_shape]`` tensor or an iterable, consumed lazily), one seed
        per input (``None``: fresh random seeds); results in order. Same call shape as ``Smoother.certify_many`` with
        ``n = budget``, so a :class:`~splitz_fast.runs.tasks.CertifyRun` takes this object in place of a Smoother."""
        n0, budget, alpha, batch_size = check_certify_counts(n0, budget, alpha, batch_size, n_name="budget")
        return self._certify_stream(with_seeds(inputs_of(inputs), seeds), n0, budget, alpha, batch_size)

    def _certify_stream(self, seeded, n0, budget, alpha, batch_size) -> Iterator[SequentialCertifyResult]:
        with evaluating(self.smoother.model):
            engine, guard = self.smoother.engine_and_guard()
            for x, seed in seeded:
                guard.check()  # the caller's code ran since the previous result
                prepared = prepare_input(self.smoother.model, x)
                result = self._certify_one(engine, prepared.x, n0, budget, alpha, batch_size, resolve_seed(seed))
                yield _about_given_input(result, prepared.rounding)

    def _certify_one(self, engine, x, n0, budget, alpha, batch_size, seed) -> SequentialCertifyResult:
        start = time.perf_counter()
        smoother = self.smoother
        stream = NoiseStream(seed, smoother.device)
        latent = smoother.latent(x)
        batch = batch_size if batch_size is not None else engine.batch_size(latent.shape, smoother.max_batch_size)
        bounds = _radius_bounds(self.smoother, self.radii, x, seed)
        thresholds = latent_thresholds(np.asarray(self.radii) * bounds.values, smoother.sigma)
        thresholds = np.maximum(np.minimum(1.0, thresholds + 4 * np.spacing(thresholds)), np.nextafter(0.5, 1.0))

        def votes(num: int) -> torch.Tensor:
            job = SamplingJob(latent, stream, num, torch.zeros(smoother.model.num_classes, dtype=torch.int64,
                                                               device=smoother.device))
            engine.run([job], batch)
            return job.counts

        candidate = int(votes(n0).argmax())  # ties go to the lowest class index
        found = certify_sequential(lambda num: int(votes(num)[candidate]), thresholds, alpha=alpha, budget=budget,
                                   first=self.first, growth=self.growth, prior=self.prior, give_up=self.give_up)
        spent = alpha + bounds.failure
        common = dict(count_a=found.hits, n=found.samples, seed=seed, noise_source=stream.source, radii=self.radii,
                      decisions=found.decisions, stop_reason=found.stop_reason)
        if found.p_lower <= 0.5:
            return SequentialCertifyResult(
                prediction=ABSTAIN, radius=0.0, p_a_lower=found.p_lower, latent_radius=0.0, lipschitz=math.nan,
                gamma=math.nan, bound_kind=str(NO_BOUND), failure_prob=spent, gamma_evaluations=bounds.evaluations,
                seconds=time.perf_counter() - start, **common)
        radius_latent = found.latent_radius(smoother.sigma)
        best = smoother.radius_search.search(x, radius_latent, stream.generator)
        radius, gamma, lipschitz, kind = best.radius, best.gamma, best.lipschitz, best.kind
        certified = [j for j, d in enumerate(found.decisions) if d is Decision.CERTIFIED]
        if certified:
            j = max(certified, key=lambda i: self.radii[i])
            if self.radii[j] > radius:
                radius, gamma, lipschitz, kind = self.radii[j], self.radii[j], float(bounds.values[j]), bounds.kinds[j]
        return SequentialCertifyResult(
            prediction=candidate, radius=radius, p_a_lower=found.p_lower, latent_radius=radius_latent,
            lipschitz=lipschitz, gamma=gamma, bound_kind=kind, failure_prob=spent + best.failure,
            gamma_evaluations=bounds.evaluations + best.evaluations, seconds=time.perf_counter() - start, **common)


def _radius_bounds(smoother: Smoother, radii: tuple[float, ...], x: torch.Tensor, seed: int) -> _RadiusBounds:
    """``L(x, ε_j)`` for every requested ε (``radii``), in one batched bound call (module docstring of
    :mod:`splitz_fast.bounds.radius` for the kinds). Probabilistic bounds draw their random starts from a generator
    of their own, derived from the input's seed, so the noise stream is the same whatever the bound method."""
    left, opts, k = smoother.model.left, smoother.options, len(radii)
    if k == 0:
        return _RadiusBounds(np.zeros(0), [], 0.0, 0)
    if opts.bound == "global" and left.depth > 0:
        g = smoother.radius_search.global_bound()
        return _RadiusBounds(np.full(k, float(g.value[0])), [str(BoundKind.of(GLOBAL, g.kind[0]))] * k, g.failure_prob[0], 0)
    generator = torch.Generator(device=x.device)
    generator.manual_seed(int(np.random.SeedSequence([seed, 1]).generate_state(1, np.uint64)[0]))
    bound = lipschitz_bound(
        left, x.unsqueeze(0).expand(k, *x.shape).contiguous(), torch.tensor(radii, dtype=torch.float64),
        method=opts.bound_method, delta=opts.bound_delta / (k * max(1, left.depth)),
        power_iters=opts.power_iters, exact_max_dim=opts.exact_max_dim, generator=generator,
    )
    kinds = [str(BoundKind.of(LOCAL, kind)) for kind in bound.kind]
    return _RadiusBounds(bound.value.numpy(), kinds, float(sum(bound.failure_prob)), k if left.depth else 0)


__all__ = [
    "BetaBinomialCS",
    "Decision",
    "SequentialCertifier",
    "SequentialCertifyResult",
    "SequentialResult",
    "certify_sequential",
    "checkpoints",
    "latent_thresholds",
]
