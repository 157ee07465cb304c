"""The SPLITZ radius of one input: certificate bounds on ``L(x, γ)``, the γ search, and the cached global bound.

Theorem 1: for every ``γ ≥ 0``, ``min(R / L(x, γ), γ)`` is a certified radius when ``L(x, γ)`` is an upper bound on the
Lipschitz constant of ``f_L`` over ``B(x, γ)`` and ``R`` is the radius of the smoothed ``f_R`` in latent space
(``R = σ Φ⁻¹(p_A_lower)`` for randomized smoothing, ``m/√2`` for a logit margin). So *every* evaluated γ yields a
valid radius and the search only decides which γ's to evaluate; the result is the best one evaluated. Probabilistic
bounds split their budget ``bound_delta`` evenly over the most evaluations a search can make (a union bound), and the
result reports the total failure probability to add to α.

The search (``"bisection"``): ``L`` is non-decreasing in γ (the intervals nest, so the varying masks only grow), hence
``h(γ) = γ − R/L(x, γ)`` is increasing and crosses 0 in ``[0, R/L(x, 0)]``. Each *pass* splits the current bracket
into ``gamma_batch`` equal parts and evaluates the inner points (and, in the first pass, the bracket's right end) in
one batched bound call; ``gamma_steps`` halvings of the width are reached after ``⌈gamma_steps / log2(gamma_batch)⌉``
passes. ``gamma_batch = 2`` evaluates exactly the points of a classic bisection; ``gamma_batch = 4`` evaluates a
superset of them in half the passes, so its radius is never smaller (for deterministic bounds), at the cost of more
bound evaluations in each pass — worth it where a batched pass costs little more than a single one (a GPU).
``"one-step"`` is the paper's Remark 1: ``γ₁ = R/L_ref``, then ``γ₂ = R/L(x, γ₁)``.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from .._checks import check_count, check_positive, check_probability
from ..kinds import EXACT, GLOBAL, IDENTITY_KIND, LOCAL, BoundKind
from .intervals import ball_bounds
from .lipschitz import (
    DEFAULT_EXACT_MAX_DIM,
    DEFAULT_PROBABILISTIC_ITERS,
    LipschitzBound,
    bounds_from_balls,
    global_lipschitz_bound,
    lipschitz_bound,
)
from ..model.modules import LeftHalf, SplitModel
from ..model.snapshot import ModuleSnapshot

GAMMA_SEARCHES = ("bisection", "one-step")
BOUNDS = ("local", "global")
BOUND_METHODS = ("auto", "exact", "probabilistic")


@dataclass(frozen=True)
class BoundOptions:
    """How the Lipschitz bound of ``f_L`` is computed and how γ is searched (see the module docstring).

    Args:
        bound: ``"local"`` (``L(x, γ)``, the paper's method) or ``"global"`` (input-independent product of norms).
        bound_method: ``"auto"``, ``"exact"`` or ``"probabilistic"``, see
            :func:`~splitz_fast.bounds.lipschitz.lipschitz_bound`.
        bound_delta: total failure probability allowed to probabilistic bounds *per γ search* (one input's), split
            evenly over the γ evaluations and layers and added to α in the result. The displacement protocol and
            sequential certification bound more than one search's γ's per input, each budget ``bound_delta``, and add
            them all to α (``failure_prob``). Unused by exact bounds.
        power_iters: power steps of the probabilistic bound.
        exact_max_dim: largest Gram dimension handled by the exact bound under ``"auto"``.
        gamma_search: ``"bisection"`` or ``"one-step"``.
        gamma_steps: halvings of the bisection bracket ``[0, R/L(x, 0)]``.
        gamma_batch: bracket parts per batched bound pass of the bisection, a power of two (2 = classic bisection;
            4, 8, ...: a superset of its points in fewer passes, so never a smaller radius with exact bounds).
        reference_lipschitz: ``L_ref`` of the one-step search (e.g. the mean ``L`` over data); ``L(x, 0)`` if None.
        gamma_max: search ceiling when ``L(x, 0) = 0`` (``f_L`` locally constant), in raw input units.
    """

    bound: str = "local"
    bound_method: str = "auto"
    bound_delta: float = 1e-6
    power_iters: int = DEFAULT_PROBABILISTIC_ITERS
    exact_max_dim: int = DEFAULT_EXACT_MAX_DIM
    gamma_search: str = "bisection"
    gamma_steps: int = 8
    gamma_batch: int = 2
    reference_lipschitz: float | None = None
    gamma_max: float = 10.0

    def __post_init__(self):
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
        if self.bound_method not in BOUND_METHODS:
            raise ValueError(f"bound_method must be one of {BOUND_METHODS}, got {self.bound_method!r}")
        if self.gamma_search not in GAMMA_SEARCHES:
            raise ValueError(f"gamma_search must be one of {GAMMA_SEARCHES}, got {self.gamma_search!r}")
        check_probability("bound_delta", self.bound_delta)
        check_count("power_iters", self.power_iters)
        check_count("exact_max_dim", self.exact_max_dim, 0)
        check_count("gamma_steps", self.gamma_steps, 0)
        check_count("gamma_batch", self.gamma_batch, 2)
        if self.gamma_batch & (self.gamma_batch - 1):
            raise ValueError(f"gamma_batch must be a power of two (2, 4, 8, ...), got {self.gamma_batch}: only then "
                             "does a pass evaluate the bisection's own points (a superset of them)")
        if self.reference_lipschitz is not None:
            check_positive("reference_lipschitz", self.reference_lipschitz)
        check_positive("gamma_max", self.gamma_max)

    @property
    def passes(self) -> int:
        """Batched passes of the bisection after ``L(x, 0)``."""
        if self.gamma_steps == 0:
            return 1
        return math.ceil(self.gamma_steps / math.log2(self.gamma_batch) - 1e-9)

    @property
    def max_evaluations(self) -> int:
        """The most γ evaluations one search can make (the union bound's denominator)."""
        if self.gamma_search == "one-step":
            return 3
        # L(x, 0); the first pass's inner points and the ceiling; then the inner points of every further pass.
        return 1 + self.gamma_batch + (self.passes - 1) * (self.gamma_batch - 1)


#: The keywords ``Smoother`` and ``MarginCertifier`` took in 0.1.0 instead of ``bound_options``: each is now the
#: :class:`BoundOptions` field of the same name. Accepted with a ``DeprecationWarning`` until 0.3.0.
DEPRECATED_BOUND_KEYWORDS = ("bound", "bound_method", "bound_delta", "power_iters", "exact_max_dim", "gamma_search",
                             "gamma_steps", "gamma_batch", "reference_lipschitz", "gamma_max")


def check_bound_options(options: BoundOptions | None, deprecated: dict | None = None,
                        owner: str = "the certifier") -> BoundOptions:
    """A certifier's ``bound_options`` argument: a :class:`BoundOptions` (validated when it was built), or ``None`` for
    the defaults. ``deprecated``: the other keywords the certifier ``owner`` was called with — the 0.1.0 spelling
    (:data:`DEPRECATED_BOUND_KEYWORDS`) becomes the same :class:`BoundOptions` with a ``DeprecationWarning`` that
    names the new spelling; any other keyword is a ``TypeError`` as Python gives it."""
    if deprecated:
        unknown = sorted(set(deprecated) - set(DEPRECATED_BOUND_KEYWORDS))
        if unknown:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        if options is not None:
            raise TypeError(f"{owner}: give bound_options or the deprecated keywords "
                            f"{', '.join(sorted(deprecated))}, not both")
        spelled = ", ".join(f"{key}={value!r}" for key, value in deprecated.items())
        warnings.warn(f"{owner}(..., {spelled}) is deprecated since 0.2.0 and will be removed in 0.3.0; pass "
                      f"bound_options=BoundOptions({spelled}) instead", DeprecationWarning, stacklevel=3)
        return BoundOptions(**deprecated)
    if options is None:
        return BoundOptions()
    if not isinstance(options, BoundOptions):
        raise TypeError(f"bound_options must be a splitz_fast.BoundOptions or None, got {type(options).__name__}; "
                        "build one with BoundOptions(bound_method='exact', gamma_search='one-step', ...)")
    return options


@dataclass
class RadiusResult:
    """The best ``min(R/L(x, γ), γ)`` over the evaluated γ, and what produced it.

    ``kind``: ``identity`` (s = 0), ``local-exact``, ``local-probabilistic``, ``global-exact`` or
    ``global-probabilistic``. ``failure``: the summed failure probability of the probabilistic bounds evaluated.
    ``evaluations``: γ values whose bound was computed; ``passes``: batched bound calls they took.
    """

    radius: float
    gamma: float
    lipschitz: float
    kind: str
    failure: float
    evaluations: int
    passes: int


class RadiusSearch:
    """Certified radii of inputs under :class:`BoundOptions`, for the ``f_L`` that ``model.left`` holds *at each call*.

    The search keeps the model, not its left half: replacing ``model.left`` after the search was built changes what it
    bounds (a search holding the old half would bound a network that no longer computes the latents). The global bound
    is computed once and reused while the same module is there and :class:`~splitz_fast.model.snapshot.ModuleSnapshot` says
    it is unchanged.
    """

    def __init__(self, model: SplitModel, options: BoundOptions):
        if not isinstance(model, SplitModel):
            raise TypeError(f"RadiusSearch needs the SplitModel (it reads model.left at each call), got "
                            f"{type(model).__name__}")
        self.model = model
        self.options = options
        self._global: tuple[LeftHalf, ModuleSnapshot, LipschitzBound] | None = None

    @classmethod
    def of_left(cls, left: LeftHalf, options: BoundOptions) -> "RadiusSearch":
        """A search for a bare ``f_L`` (no ``f_R``: e.g. to compare another radius with Theorem 1's)."""
        return cls(SplitModel(left, torch.nn.Identity(), num_classes=1), options)

    @property
    def left(self) -> LeftHalf:
        """``f_L`` as the model holds it now, checked (:meth:`~splitz_fast.model.modules.SplitModel.check_structure`)."""
        self.model.check_structure()
        return self.model.left

    def global_bound(self) -> LipschitzBound:
        """``Π_k ‖W_k‖₂`` of ``f_L``, recomputed whenever ``f_L`` was replaced or any of its weights, buffers or layers
        changed."""
        left = self.left
        if self._global is None or self._global[0] is not left or not self._global[1].matches(left):
            if left.input_shape is None:
                raise ValueError("the global bound needs the model's input_shape (LeftHalf(input_shape=...))")
            snapshot = ModuleSnapshot(left)
            device = left.layers[0].weight.device
            gen = torch.Generator(device=device)
            gen.manual_seed(0)
            opts = self.options
            bound = global_lipschitz_bound(
                left, left.input_shape, method=opts.bound_method, delta=opts.bound_delta / max(1, left.depth),
                power_iters=opts.power_iters, exact_max_dim=opts.exact_max_dim, generator=gen,
            )
            self._global = (left, snapshot, bound)
        return self._global[2]

    def search(self, x: torch.Tensor, radius_latent: float, generator: torch.Generator | None) -> RadiusResult:
        """Best ``min(R/L(x, γ), γ)`` over the γ evaluated by the configured search, for one input ``x`` (no batch
        dimension) whose latent radius is ``radius_latent``; ``generator`` seeds probabilistic bounds."""
        return self.search_many([x], [radius_latent], [generator])[0]

    def search_many(self, xs: Sequence[torch.Tensor], radii_latent: Sequence[float],
                    generators: Sequence[torch.Generator | None]) -> list[RadiusResult]:
        """:meth:`search` for several inputs at once (one generator each): their searches advance in lockstep, and
        each round's new γ's — of every input — get their ball bounds in **one** batched pass
        (:func:`~splitz_fast.bounds.intervals.ball_bounds`); each input's factors are then certified from its own rows with its
        own generator, so every result equals :meth:`search` of that input alone — exactly on a CPU; on CUDA the exact
        factors of all inputs are certified together (:func:`~splitz_fast.bounds.lipschitz.bounds_from_balls`), and a bound
        may differ from the lone search's in its last bits (the batched estimate that places each Cholesky shift
        rounds differently; both are proven bounds)."""
        opts = self.options
        left = self.left
        if left.depth == 0:
            return [RadiusResult(r, r, 1.0, str(IDENTITY_KIND), 0.0, 0, 0) for r in radii_latent]
        if opts.bound == "global":
            g = self.global_bound()
            lip = float(g.value[0])
            results = []
            for r in radii_latent:
                radius = r / lip if lip > 0 else opts.gamma_max
                results.append(RadiusResult(radius, radius, lip, str(BoundKind.of(GLOBAL, g.kind[0])), g.failure_prob[0],
                                            0, 0))
            return results
        searches = [_LocalSearch(left, opts, x, r, gen) for x, r, gen in zip(xs, radii_latent, generators)]
        steps = [search.steps() for search in searches]
        asked = {i: next(step) for i, step in enumerate(steps)}
        while asked:
            fresh = {i: searches[i].fresh(gammas) for i, gammas in asked.items()}
            bounded = _bound_rounds(left, opts, {i: (searches[i], gammas) for i, gammas in fresh.items() if gammas})
            for i in list(asked):
                lips = searches[i].record(asked[i], bounded.get(i))
                try:
                    asked[i] = steps[i].send(lips)
                except StopIteration:
                    del asked[i]
        return [search.result() for search in searches]


def bisection_reference(left: LeftHalf, x: torch.Tensor, radius_latent: float, options: BoundOptions) -> float:
    """The classic bisection of :class:`RadiusSearch` (``gamma_batch = 2``) with every point bounded on its own, one
    call per γ: the reference its faster paths (covered γ's skipped, batched rounds, lockstep windows) must equal, and
    the baseline its benchmark measures against."""
    def lip(gamma: float) -> float:
        return float(lipschitz_bound(left, x.unsqueeze(0), gamma, method=options.bound_method,
                                     delta=options.bound_delta, power_iters=options.power_iters,
                                     exact_max_dim=options.exact_max_dim).value[0])

    def radius(gamma: float, value: float) -> float:
        return gamma if value == 0 else min(radius_latent / value, gamma)

    lip0 = lip(0.0)
    lo, hi = 0.0, radius_latent / lip0 if lip0 > 0 else options.gamma_max
    top = lip(hi)
    best = max(radius(0.0, lip0), radius(hi, top))
    for _ in range(options.gamma_steps):
        mid = (lo + hi) / 2
        value = lip(mid)
        best = max(best, radius(mid, value))
        lo, hi = (mid, hi) if value == 0 or radius_latent / value >= mid else (lo, mid)
    return best


def _bound_rounds(left: LeftHalf, opts: BoundOptions, rounds: dict) -> dict[int, LipschitzBound]:
    """``{i: L(x_i, γ) for each of its γ's}`` for ``rounds = {i: (search_i, γ's)}``: one ball-bound pass over every
    (input, γ) row, then each input's factors from its own rows and generator, the exact ones of all inputs
    certified together (:func:`~splitz_fast.bounds.lipschitz.bounds_from_balls`)."""
    if not rounds:
        return {}
    rows = torch.cat([search.x.unsqueeze(0).expand(len(gammas), *search.x.shape) for search, gammas in rounds.values()])
    gammas = torch.tensor([g for _, round_gammas in rounds.values() for g in round_gammas], dtype=torch.float64)
    ball = ball_bounds(left, rows, gammas)
    slices, start = [], 0
    for _, round_gammas in rounds.values():
        slices.append(ball.rows(start, start + len(round_gammas)))
        start += len(round_gammas)
    searches = list(rounds.values())
    if len({search.delta_eval for search, _ in searches}) != 1:
        raise ValueError("the searches of one round must share their probabilistic budget per evaluation")
    bounded = bounds_from_balls(left, slices, tuple(searches[0][0].x.shape), method=opts.bound_method,
                                delta=searches[0][0].delta_eval, power_iters=opts.power_iters,
                                exact_max_dim=opts.exact_max_dim, generators=[search.generator for search, _ in searches])
    return dict(zip(rounds, bounded))


class _LocalSearch:
    """One input's search over γ with local bounds; keeps the best radius of every evaluated γ."""

    def __init__(self, left, opts: BoundOptions, x, radius_latent, generator):
        self.left, self.opts, self.x, self.radius_latent, self.generator = left, opts, x, radius_latent, generator
        self.delta_eval = opts.bound_delta / (opts.max_evaluations * left.depth)
        self.best = RadiusResult(0.0, 0.0, math.nan, str(BoundKind(LOCAL, EXACT)), 0.0, 0, 0)
        self.failure = 0.0
        self.evaluations = 0
        self.passes = 0
        self.bounded: list[tuple[float, float, str]] = []  # (γ, L(x, γ), kind) of every γ bounded so far

    def fresh(self, gammas: list[float]) -> list[float]:
        """The γ's of a round that need a bound of their own.

        A γ at or below an already bounded γ' whose radius reaches it (``R / L(x, γ') ≥ γ``) does not:
        ``L(x, γ')`` bounds ``f_L`` on ``B(x, γ') ⊇ B(x, γ)``, so it is a valid bound at γ, the radius there is γ
        itself and ``h(γ) ≤ 0`` as with ``L(x, γ)``. That skips about 30 % of the bisection's bound evaluations on
        trained LeNets (the radius is the same; the ``L`` reported for such a γ is the larger ball's)."""
        return [g for g in gammas if self._covering(g) is None]

    def record(self, gammas: list[float], bound: LipschitzBound | None) -> list[float]:
        """Take the bounds of this round's fresh γ's (in :meth:`fresh`'s order), record every γ's radius, and return
        the bound used at each γ of the round."""
        if bound is not None:
            self.passes += 1
            for gamma, value, kind, failure in zip(self.fresh(gammas), bound.value, bound.kind, bound.failure_prob):
                self.failure += failure
                self.evaluations += 1
                self.bounded.append((gamma, float(value), str(BoundKind.of(LOCAL, kind))))
        lips = []
        for gamma in gammas:
            lip, kind = self._own(gamma) or self._covering(gamma)
            radius = gamma if lip == 0 else min(self.radius_latent / lip, gamma)
            if radius > self.best.radius or math.isnan(self.best.lipschitz):
                self.best = RadiusResult(radius, gamma, lip, kind, 0.0, 0, 0)
            lips.append(lip)
        return lips

    def _own(self, gamma: float) -> tuple[float, str] | None:
        """``(L(x, γ), kind)`` if γ itself was bounded, else ``None``."""
        return next(((lip, kind) for bounded, lip, kind in self.bounded if bounded == gamma), None)

    def _covering(self, gamma: float) -> tuple[float, str] | None:
        """``(L(x, γ'), kind)`` of a bounded γ' ≥ γ whose radius reaches γ, or ``None``."""
        for bounded, lip, kind in self.bounded:
            if bounded >= gamma and self.holds(gamma, lip):
                return lip, kind
        return None

    def holds(self, gamma: float, lip: float) -> bool:
        """``h(γ) ≤ 0``: γ is at or below the crossing, so the radius at γ is γ itself."""
        return lip == 0 or self.radius_latent / lip >= gamma

    def steps(self) -> Generator[list[float], list[float], None]:
        """The search as a coroutine: yields the γ's of each round, receives the bound used at each (the driver,
        :meth:`RadiusSearch.search_many`, bounds several inputs' rounds together)."""
        opts = self.opts
        (lip0,) = yield [0.0]
        ceiling = self.radius_latent / lip0 if lip0 > 0 else opts.gamma_max
        if opts.gamma_search == "bisection":
            k = opts.gamma_batch
            lo, hi = 0.0, ceiling
            for p in range(opts.passes):
                points = [lo + (hi - lo) * j / k for j in range(1, k)]
                if p == 0:
                    points.append(hi)  # the ceiling itself: valid, and the best radius when L(x, γ) = L(x, 0)
                lips = yield points
                below = [g for g, lip in zip(points, lips) if self.holds(g, lip)]
                new_lo = max(below, default=lo)
                above = [g for g in points if g > new_lo]
                lo, hi = new_lo, min(above, default=hi)
        else:
            reference = opts.reference_lipschitz if opts.reference_lipschitz is not None else lip0
            gamma1 = self.radius_latent / reference if reference > 0 else opts.gamma_max
            (lip1,) = yield [gamma1]
            gamma2 = self.radius_latent / lip1 if lip1 > 0 else opts.gamma_max
            if gamma2 != gamma1:
                yield [gamma2]

    def result(self) -> RadiusResult:
        best = self.best
        return RadiusResult(best.radius, best.gamma, best.lipschitz, best.kind, self.failure, self.evaluations,
                            self.passes)
