"""How a stream of inputs goes through the sampling engine: in groups (*windows*) whose samples fill
:data:`WINDOW_BATCHES` ``f_R`` batches, shared between inputs, with one host synchronisation per window; then each
window's results, the radius searches of its inputs run together (:meth:`Smoother.certify_many` and
:meth:`Smoother.predict_many`, which may overlap the searches of one window with the sampling of the next)."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ..bounds.radius import RadiusResult, RadiusSearch
from ..model.modules import SplitModel
from ..sampling.engine import NoiseStream, SamplingEngine, SamplingJob
from ..kinds import NO_BOUND
from .inputs import CallGuard, PreparedInput, evaluating, prepare_input, resolve_seed
from .outcomes import ABSTAIN, CertifyResult, PredictResult, about_given_input, predict_result
from .protocols import CertificationProtocol
from .stats import clopper_pearson_lower, latent_radius


class SmootherParts(Protocol):
    """What the window loop uses of a :class:`~splitz_fast.certify.smoothing.Smoother` (which it does not import:
    the smoother hands itself in)."""

    model: SplitModel
    sigma: float
    overlap_bounds: bool | None
    protocol: CertificationProtocol
    radius_search: RadiusSearch

    @property
    def device(self) -> torch.device: ...

    def engine_and_guard(self) -> tuple[SamplingEngine, CallGuard]: ...

    def latent(self, x: torch.Tensor) -> torch.Tensor: ...

    def batch_size_for(self, engine: SamplingEngine, latent: torch.Tensor, batch_size: int | None) -> int: ...

# A window gathers inputs until their samples fill this many batches, then synchronises once for all of them.
WINDOW_BATCHES = 4


@dataclass
class PendingInput:
    """One input of a certify_many window: its samples' jobs and, once counted, its result."""

    x: PreparedInput
    latent: torch.Tensor
    stream: NoiseStream
    selection: SamplingJob
    estimation: SamplingJob


def certify_stream(smoother: SmootherParts, seeded, n0, n, alpha, batch_size) -> Iterator[CertifyResult]:
    """The results of :meth:`Smoother.certify_many`, in order: windows sampled in turn, each finished at once, or on
    CUDA (``overlap_bounds``) on a worker thread and side stream while the next window samples."""
    with evaluating(smoother.model):
        engine, guard = smoother.engine_and_guard()
        overlap = smoother.device.type == "cuda" if smoother.overlap_bounds is None else smoother.overlap_bounds
        with ThreadPoolExecutor(max_workers=1) if overlap else contextlib.nullcontext() as pool:
            finishing = None  # the previous window's radius searches, running on the worker (results not yet given)
            try:
                for window, batch, counts, seconds in sample_windows(smoother, engine, guard, seeded, n0, n,
                                                                     batch_size):
                    if pool is None:
                        yield from checked(guard, finish_window(smoother, guard, window, counts, seconds, n, alpha))
                        continue
                    if finishing is not None:
                        done, finishing = finishing, None
                        yield from checked(guard, done.result())
                    finishing = pool.submit(finish_on_side_stream, smoother, guard, window, counts, seconds, n, alpha)
            except Exception:
                if finishing is not None:  # a bad input ends the stream: the results before it still come out first
                    yield from checked(guard, finishing.result())
                raise
            if finishing is not None:
                yield from checked(guard, finishing.result())


def predict_stream(smoother: SmootherParts, seeded, n, alpha, batch_size) -> Iterator[PredictResult]:
    """The results of :meth:`Smoother.predict_many`, in order."""
    with evaluating(smoother.model):
        engine, guard = smoother.engine_and_guard()
        for window, _, counts, seconds in sample_windows(smoother, engine, guard, seeded, 0, n, batch_size):
            yield from checked(guard, (predict_result(counts[1, i], alpha, pending.stream.seed, seconds,
                                                        pending.x.rounding)
                                        for i, pending in enumerate(window)))


def sample_windows(smoother: SmootherParts, engine, guard: CallGuard, seeded, n0, n, batch_size):
    """Groups of inputs sampled together: yields ``(window, batch, counts [2, W, C] on the host, seconds)``.

    An input that cannot be taken (a wrong shape, NaN, a seed missing, an error of the caller's iterator) ends the
    stream with its error, after the window of the inputs before it: no result that could be computed is lost."""
    window: list[PendingInput] = []
    batch = None
    try:
        for x, seed in seeded:
            x = prepare_input(smoother.model, x)
            stream = NoiseStream(resolve_seed(seed), smoother.device)
            guard.check()
            latent = smoother.latent(x.x)
            if batch is None:
                batch = smoother.batch_size_for(engine, latent, batch_size)
            window.append(PendingInput(x, latent, stream, SamplingJob(latent, stream, n0, _zero_counts(smoother)),
                                       SamplingJob(latent, stream, n, _zero_counts(smoother))))
            if len(window) * (n0 + n) >= WINDOW_BATCHES * batch:
                full, window = window, []
                yield _sample(smoother, engine, full, batch)
    except Exception:
        if window and not guard.edited():  # an edited model's inputs get no results (the guard's error follows)
            yield _sample(smoother, engine, window, batch)
        raise
    if window:
        yield _sample(smoother, engine, window, batch)


def _zero_counts(smoother: SmootherParts) -> torch.Tensor:
    return torch.zeros(smoother.model.num_classes, dtype=torch.int64, device=smoother.device)


def _sample(smoother: SmootherParts, engine, window: list[PendingInput], batch: int):
    start = time.perf_counter()
    # Selection then estimation of each input: consecutive, disjoint ranges of its noise stream.
    engine.run([job for p in window for job in (p.selection, p.estimation)], batch)
    counts = torch.stack([torch.stack([p.selection.counts for p in window]),
                          torch.stack([p.estimation.counts for p in window])]).cpu()  # the one host sync
    return window, batch, counts, (time.perf_counter() - start) / len(window)


def finish_on_side_stream(smoother: SmootherParts, guard, window, counts, seconds, n, alpha) -> list[CertifyResult]:
    if smoother.device.type != "cuda":
        return list(finish_window(smoother, guard, window, counts, seconds, n, alpha))
    side = torch.cuda.Stream(smoother.device)
    side.wait_stream(torch.cuda.current_stream(smoother.device))
    with torch.cuda.stream(side):
        results = list(finish_window(smoother, guard, window, counts, seconds, n, alpha))
    side.synchronize()
    return results


def finish_window(smoother: SmootherParts, guard: CallGuard, window, counts, seconds, n, alpha) -> Iterator[CertifyResult]:
    """The window's results in order. The radius searches of its non-abstaining inputs run together
    (:meth:`~splitz_fast.certify.protocols.CertificationProtocol.radii`: one batched ball-bound pass per round of all of
    them), each equal to its own search (on CUDA up to the last bits of the certified bounds:
    :meth:`~splitz_fast.bounds.radius.RadiusSearch.search_many`); each input's ``seconds`` adds an equal share of that time."""
    guard.check()  # the caller's code ran since the previous window: the bounds must be of the sampled f_L
    start = time.perf_counter()
    decided = []
    for i, pending in enumerate(window):
        candidate = int(counts[0, i].argmax())  # ties go to the lowest class index
        count_a = int(counts[1, i, candidate])
        decided.append((candidate, count_a, clopper_pearson_lower(count_a, n, alpha)))
    certified = [i for i, (_, _, p_lower) in enumerate(decided) if p_lower >= 0.5]
    found = dict(zip(certified, smoother.protocol.radii(
        smoother.radius_search, [window[i].x.x for i in certified],
        [latent_radius(smoother.sigma, decided[i][2]) for i in certified],
        [window[i].stream.generator for i in certified])))
    seconds = seconds + (time.perf_counter() - start) / len(window)
    for i, pending in enumerate(window):
        candidate, count_a, p_lower = decided[i]
        source, seed = pending.stream.source, pending.stream.seed
        if i not in found:
            yield about_given_input(CertifyResult(ABSTAIN, 0.0, p_lower, 0.0, math.nan, math.nan, str(NO_BOUND),
                                                  alpha, count_a, n, 0, seed, seconds, source), pending.x.rounding)
            continue
        best: RadiusResult = found[i]
        yield about_given_input(CertifyResult(
            prediction=candidate, radius=best.radius, p_a_lower=p_lower,
            latent_radius=latent_radius(smoother.sigma, p_lower), lipschitz=best.lipschitz, gamma=best.gamma,
            bound_kind=best.kind, failure_prob=alpha + best.failure, count_a=count_a, n=n,
            gamma_evaluations=best.evaluations, seed=seed, seconds=seconds, noise_source=source,
        ), pending.x.rounding)


_Result = TypeVar("_Result")


def checked(guard: CallGuard, results: Iterable[_Result]) -> Iterator[_Result]:
    """``results`` one by one, each after checking that the caller has not edited the model since the previous one:
    results computed before an edit describe the model as it was sampled, not the edited one."""
    for result in results:
        guard.check()
        yield result
