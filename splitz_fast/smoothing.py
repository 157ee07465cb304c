"""The SPLITZ smoothed classifier: Cohen's CERTIFY and PREDICT around ``f_R``, for one input or a stream of them.

``g(x) = argmax_c P_δ[f_R(f_L(x) + δ) = c]`` with ``δ ~ N(0, σ² I)`` in the latent space of ``f_L``. The smoother
owns σ: the sampling engine (:mod:`splitz_fast.sampling`) draws the noise with it, and the same σ enters the radius.
Certification of one input is a pure function of that input, the model and the seed — also inside
:meth:`Smoother.certify_many`, which packs the samples of several inputs into shared ``f_R`` batches.

Radius (Theorem 1): ``max over evaluated γ of min(R / L(x, γ), γ)`` with ``R = σ Φ⁻¹(p_A_lower)`` and ``L`` a
certificate bound (:mod:`splitz_fast.radius`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch

from ._checks import check_certify_counts, check_count, check_positive
from .inputs import (CallGuard, PreparedInput, evaluating, inputs_of, model_device, prepare_input, resolve_seed,
                     with_seeds)
from .modules import SplitModel
from .protocols import CertificationProtocol, get_protocol, is_estimate_kind
from .radius import BoundOptions, RadiusResult, RadiusSearch, check_bound_options
from .sampling import PRECISIONS, NoiseStream, SamplingEngine, SamplingJob
from .stats import clopper_pearson_lower, latent_radius, two_sided_binomial_pvalue

ABSTAIN = -1
# Largest f_R batch the tuner tries (an explicit batch_size may be larger).
DEFAULT_MAX_BATCH = 4096
# certify_many gathers inputs until their samples fill this many batches, then synchronises once for all of them.
WINDOW_BATCHES = 4


@dataclass
class CertifyResult:
    """Outcome of CERTIFY for one input.

    ``radius`` is in raw input units (``ABSTAIN`` prediction → radius 0). ``failure_prob`` is the total probability
    that the certificate is wrong: α plus the failure probability of every probabilistic Lipschitz bound evaluated.
    ``bound_kind`` says what produced ``lipschitz``: ``identity`` (s = 0), ``local-exact``, ``local-probabilistic``,
    ``global-exact`` or ``global-probabilistic``. ``noise_source`` says which stream drew the noise (``philox4x32-10``:
    the Philox stream of kernels/noise_votes.py, the same on every device and backend; or ``torch-<device>``: the
    fallback's torch generator): with the seed, it is what a rerun needs to reproduce the certificate. ``seconds`` is this
    input's share of the sampling time of the batches it was packed in, plus its own radius search.

    ``input_rounding``: an upper bound on ``‖x − x̃‖₂`` where ``x̃`` is the given input ``x`` rounded to float32 (the
    dtype the model computes in); 0 for float32 and narrower inputs. The certificate is computed at ``x̃`` and
    ``radius`` is already reduced by it, so it is a radius about the input as given (:func:`about_given_input`).
    """

    prediction: int
    radius: float
    p_a_lower: float
    latent_radius: float
    lipschitz: float
    gamma: float
    bound_kind: str
    failure_prob: float
    count_a: int
    n: int
    gamma_evaluations: int
    seed: int
    seconds: float
    noise_source: str = ""
    input_rounding: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def is_certificate(self) -> bool:
        """False for the results of an estimate protocol (``bound_kind`` ``paper-estimate`` /
        ``published-code-estimate``): their radii are not certified (:mod:`splitz_fast.protocols`)."""
        return not is_estimate_kind(self.bound_kind)


@dataclass
class PredictResult:
    """Outcome of PREDICT: ``prediction`` is ``ABSTAIN`` unless the top class wins the binomial test at level α.
    ``seconds``: this input's share of the sampling time of the batches it was packed in.

    ``input_rounding``: an upper bound on ``‖x − x̃‖₂`` where ``x̃`` is the given input ``x`` rounded to float32 (the
    dtype the model computes in); 0 for float32 and narrower inputs. PREDICT's answer is about ``x̃``, not ``x``; it
    has no radius to reduce (CERTIFY reduces its radius by this distance, :func:`about_given_input`), so the distance
    is reported here."""

    prediction: int
    count_top: int
    count_second: int
    p_value: float
    seed: int
    seconds: float = field(default=0.0, compare=False)  # timing, not part of the outcome
    input_rounding: float = 0.0


# ---------------------------------------------------------------------------------------------- the result
def about_given_input(result: CertifyResult, rounding: float) -> CertifyResult:
    """``result`` (certified at the float32 rounding ``x̃`` of the input ``x``) as a certificate about ``x`` itself.

    If no point within ``r`` of ``x̃`` changes the prediction and ``‖x − x̃‖ ≤ ρ``, then by the triangle inequality no
    point within ``r − ρ`` of ``x`` does, and ``x`` itself (at distance ``ρ < r``) gets the same prediction. So the
    radius is ``r − ρ`` rounded down; when ``ρ ≥ r`` nothing is certified about ``x``: abstain."""
    if rounding == 0.0 or result.prediction == ABSTAIN:
        return dataclasses.replace(result, input_rounding=rounding)
    radius = math.nextafter(result.radius - rounding, -math.inf)
    if radius <= 0:
        return dataclasses.replace(result, prediction=ABSTAIN, radius=0.0, input_rounding=rounding)
    return dataclasses.replace(result, radius=radius, input_rounding=rounding)


@dataclass
class _Pending:
    """One input of a certify_many window: its samples' jobs and, once counted, its result."""

    x: PreparedInput
    latent: torch.Tensor
    stream: NoiseStream
    selection: SamplingJob
    estimation: SamplingJob


class Smoother:
    """Randomized smoothing of ``f_R`` in the latent space of ``f_L``, with SPLITZ certificates.

    Args:
        model: a :class:`~splitz_fast.modules.SplitModel` (``split_index == 0`` is Cohen's plain RS).
        sigma: noise level σ > 0, in latent units.
        bound_options: the Lipschitz bound and γ search, a :class:`~splitz_fast.radius.BoundOptions` (``None``: its
            defaults); kept as :attr:`options`.
        precision: ``"float32"`` (default: IEEE float32, also on CUDA, where cuDNN's default TF32 convolutions are
            switched off while sampling), ``"tf32"`` (float32 with TF32 tensor-core convolutions and matmuls on CUDA;
            float32 elsewhere), ``"bfloat16"`` or ``"float16"``: how ``f_R`` computes while sampling (noise and the
            noisy latent are float32 until the cast). Lower precision changes the base classifier, not the validity of
            its certificates; compare runs only at the same precision.
        compile: sample through ``torch.compile(f_R)`` with static batch shapes (falls back to eager with a warning).
        max_batch_size: the largest ``f_R`` batch the tuner tries when ``batch_size`` is not given.
        overlap_bounds: compute the radius search of one group of inputs on a worker thread (a side CUDA stream)
            while the next group samples; default: on CUDA only (on a CPU both compete for the same cores).
        protocol: ``"sound"`` (default: a certificate), or ``"paper"`` / ``"published-code"`` (or a
            :class:`~splitz_fast.protocols.CertificationProtocol` such as ``PublishedCode(data_std=(0.3081,))``), the
            estimates behind the SPLITZ paper's numbers (:mod:`splitz_fast.protocols`): **not certificates** — their
            rows say ``paper-estimate`` / ``published-code-estimate`` and a failure probability of NaN.

    Deprecated: the 0.1.0 keywords ``bound``, ``bound_method``, ``bound_delta``, ``power_iters``, ``exact_max_dim``,
    ``gamma_search``, ``gamma_steps``, ``gamma_batch``, ``reference_lipschitz`` and ``gamma_max`` still work, with a
    ``DeprecationWarning``, until 0.3.0: pass ``bound_options=BoundOptions(...)`` with the same names instead.
    """

    def __init__(
        self,
        model: SplitModel,
        sigma: float,
        *,
        bound_options: BoundOptions | None = None,
        precision: str = "float32",
        compile: bool = False,
        max_batch_size: int = DEFAULT_MAX_BATCH,
        overlap_bounds: bool | None = None,
        protocol: str | CertificationProtocol = "sound",
        **deprecated_bound_keywords,
    ):
        if not isinstance(model, SplitModel):
            raise TypeError(f"model must be a splitz_fast.SplitModel, got {type(model).__name__}; "
                            "build one with split_sequential() or SplitModel(left, right, num_classes)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        self._model = model
        self.sigma = check_positive("sigma", sigma)
        self.options = check_bound_options(bound_options, deprecated_bound_keywords, "Smoother")
        self.radius_search = RadiusSearch(model, self.options)
        self.protocol = get_protocol(protocol)
        self.protocol.check(model)
        self.precision = precision
        self.compile = bool(compile)
        self.max_batch_size = check_count("max_batch_size", max_batch_size)
        self.overlap_bounds = overlap_bounds
        self._engine: SamplingEngine | None = None
        model.check_structure()

    @property
    def model(self) -> SplitModel:
        """The model this smoother certifies (fixed at construction). Its halves may be edited or replaced between
        calls (``model.left = ...``): every call reads them as they are then."""
        return self._model

    # The settings a run records (CLI sidecars) read these names.
    bound = property(lambda self: self.options.bound)
    bound_method = property(lambda self: self.options.bound_method)
    gamma_search = property(lambda self: self.options.gamma_search)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def engine(self) -> SamplingEngine:
        """The sampling engine for ``f_R`` as the model holds it now, on the model's current device: rebuilt when
        ``model.right`` was replaced, its prepared copy when the module's tensors or layers changed
        (:meth:`SamplingEngine.check_current`, which also refuses a batch-dependent ``f_R``)."""
        model, device = self.model, self.device
        engine = self._engine
        if engine is None or engine.device != device or engine.source is not model.right \
                or engine.num_classes != model.num_classes:
            engine = self._engine = SamplingEngine(model.right, model.num_classes, self.sigma, device,
                                                   precision=self.precision, compile=self.compile)
        engine.check_current()
        return engine

    @torch.inference_mode()
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``f_L(x)`` for one input ``x`` as float32 (computed once per input; noise is added after it)."""
        return self.model.left(x.unsqueeze(0))[0].float().contiguous()

    def _batch_size(self, engine: SamplingEngine, latent: torch.Tensor, batch_size: int | None) -> int:
        if batch_size is None:
            return engine.batch_size(latent.shape, self.max_batch_size)
        return check_count("batch_size", batch_size)

    # ------------------------------------------------------------------ CERTIFY
    def certify(self, x: torch.Tensor, n0: int, n: int, alpha: float, batch_size: int | None = None,
                seed: int | None = None) -> CertifyResult:
        """CERTIFY (Cohen et al. 2019) with the SPLITZ radius, for one input ``x: [*input_shape]``.

        ``n0`` selection draws pick ``ĉ_A`` (ties to the lowest class index); ``n`` fresh, independent draws give
        ``p_A_lower = Beta.ppf(α; n_A, n − n_A + 1)``; abstain if ``p_A_lower < 1/2``. ``batch_size``: ``f_R``'s
        batch (``None``: the fastest measured one up to ``max_batch_size``); it does not change the noise an input
        sees. The model runs in eval mode and is left unchanged.
        """
        with contextlib.closing(self.certify_many([x], n0, n, alpha, batch_size=batch_size, seeds=[seed])) as results:
            return next(results)

    def certify_many(self, inputs: torch.Tensor | Iterable[torch.Tensor], n0: int, n: int, alpha: float,
                     batch_size: int | None = None, seeds: Iterable[int | None] | None = None
                     ) -> Iterator[CertifyResult]:
        """CERTIFY every input of ``inputs`` (a ``[M, *input_shape]`` tensor or an iterable of inputs, consumed lazily)
        and yield the results in order, each equal to ``certify(x, ..., seed=s)`` for its own seed.

        The engine keeps the device busy: one ``f_R`` batch carries samples of several inputs when one input cannot
        fill it, votes are counted per input on the device, and the host synchronises once per group of inputs. On
        CUDA the radius search of one group overlaps the sampling of the next (``overlap_bounds``).
        ``seeds``: one per input (``None``: fresh random seeds); as many seeds as inputs, else a ``ValueError``
        (:func:`~splitz_fast.inputs.with_seeds`). Editing the model while the results are being consumed stops the call
        with a ``RuntimeError`` before the next result (start a new call to certify the edited model).
        """
        check_certify_counts(n0, n, alpha, batch_size)
        return self._certify_stream(with_seeds(inputs_of(inputs), seeds), n0, n, alpha, batch_size)

    def engine_and_guard(self) -> tuple[SamplingEngine, CallGuard]:
        """The sampling engine for one certify/predict call (:meth:`engine`) and the guard that stops the call if the
        model is edited while it runs (:class:`~splitz_fast.inputs.CallGuard`, sharing the snapshot of ``f_R`` that
        the engine has just checked instead of copying ``f_R`` again). Lazy calls of other certifiers built on this
        smoother (:class:`~splitz_fast.sequential.SequentialCertifier`) start with it too."""
        self.model.check_structure()
        engine = self.engine()
        return engine, CallGuard(self.model, right=engine.snapshot)

    def _certify_stream(self, seeded, n0, n, alpha, batch_size) -> Iterator[CertifyResult]:
        with evaluating(self.model):
            engine, guard = self.engine_and_guard()
            overlap = self.device.type == "cuda" if self.overlap_bounds is None else self.overlap_bounds
            with ThreadPoolExecutor(max_workers=1) if overlap else contextlib.nullcontext() as pool:
                finishing = None  # the previous window's radius searches, running on the worker
                for window, batch, counts, seconds in self._windows(engine, guard, seeded, n0, n, batch_size):
                    if pool is None:
                        yield from _checked(guard, self._finish(guard, window, counts, seconds, n, alpha))
                        continue
                    if finishing is not None:
                        yield from _checked(guard, finishing.result())
                    finishing = pool.submit(self._finish_on_side_stream, guard, window, counts, seconds, n, alpha)
                if finishing is not None:
                    yield from _checked(guard, finishing.result())

    def _windows(self, engine, guard: CallGuard, seeded, n0, n, batch_size):
        """Groups of inputs sampled together: yields ``(window, batch, counts [2, W, C] on the host, seconds)``."""
        window: list[_Pending] = []
        batch = None
        for x, seed in seeded:
            x = prepare_input(self.model, x)
            stream = NoiseStream(resolve_seed(seed), self.device)
            guard.check()
            latent = self.latent(x.x)
            if batch is None:
                batch = self._batch_size(engine, latent, batch_size)
            window.append(_Pending(x, latent, stream, SamplingJob(latent, stream, n0, self._zero_counts()),
                                   SamplingJob(latent, stream, n, self._zero_counts())))
            if len(window) * (n0 + n) >= WINDOW_BATCHES * batch:
                yield self._sample(engine, window, batch)
                window = []
        if window:
            yield self._sample(engine, window, batch)

    def _zero_counts(self) -> torch.Tensor:
        return torch.zeros(self.model.num_classes, dtype=torch.int64, device=self.device)

    def _sample(self, engine, window: list[_Pending], batch: int):
        start = time.perf_counter()
        # Selection then estimation of each input: consecutive, disjoint ranges of its noise stream.
        engine.run([job for p in window for job in (p.selection, p.estimation)], batch)
        counts = torch.stack([torch.stack([p.selection.counts for p in window]),
                              torch.stack([p.estimation.counts for p in window])]).cpu()  # the one host sync
        return window, batch, counts, (time.perf_counter() - start) / len(window)

    def _finish_on_side_stream(self, guard, window, counts, seconds, n, alpha) -> list[CertifyResult]:
        if self.device.type != "cuda":
            return list(self._finish(guard, window, counts, seconds, n, alpha))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            results = list(self._finish(guard, window, counts, seconds, n, alpha))
        side.synchronize()
        return results

    def _finish(self, guard: CallGuard, window, counts, seconds, n, alpha) -> Iterator[CertifyResult]:
        """The window's results in order. The radius searches of its non-abstaining inputs run together
        (:meth:`~splitz_fast.protocols.CertificationProtocol.radii`: one batched ball-bound pass per round of all of
        them), each equal to its own search; each input's ``seconds`` adds an equal share of that time."""
        guard.check()  # the caller's code ran since the previous window: the bounds must be of the sampled f_L
        start = time.perf_counter()
        decided = []
        for i, pending in enumerate(window):
            candidate = int(counts[0, i].argmax())  # ties go to the lowest class index
            count_a = int(counts[1, i, candidate])
            decided.append((candidate, count_a, clopper_pearson_lower(count_a, n, alpha)))
        certified = [i for i, (_, _, p_lower) in enumerate(decided) if p_lower >= 0.5]
        found = dict(zip(certified, self.protocol.radii(
            self.radius_search, [window[i].x.x for i in certified],
            [latent_radius(self.sigma, decided[i][2]) for i in certified],
            [window[i].stream.generator for i in certified])))
        seconds = seconds + (time.perf_counter() - start) / len(window)
        for i, pending in enumerate(window):
            candidate, count_a, p_lower = decided[i]
            source, seed = pending.stream.source, pending.stream.seed
            if i not in found:
                yield about_given_input(CertifyResult(ABSTAIN, 0.0, p_lower, 0.0, math.nan, math.nan, "none", alpha,
                                                      count_a, n, 0, seed, seconds, source), pending.x.rounding)
                continue
            best: RadiusResult = found[i]
            yield about_given_input(CertifyResult(
                prediction=candidate, radius=best.radius, p_a_lower=p_lower,
                latent_radius=latent_radius(self.sigma, p_lower), lipschitz=best.lipschitz, gamma=best.gamma,
                bound_kind=best.kind, failure_prob=alpha + best.failure, count_a=count_a, n=n,
                gamma_evaluations=best.evaluations, seed=seed, seconds=seconds, noise_source=source,
            ), pending.x.rounding)

    # ------------------------------------------------------------------ PREDICT
    def predict(self, x: torch.Tensor, n: int, alpha: float, batch_size: int | None = None,
                seed: int | None = None) -> PredictResult:
        """PREDICT (Cohen et al. 2019): abstain unless the two-sided binomial test of the top two counts at
        p = 1/2 has p-value ≤ α. The model runs in eval mode."""
        with contextlib.closing(self.predict_many([x], n, alpha, batch_size=batch_size, seeds=[seed])) as results:
            return next(results)

    def predict_many(self, inputs: torch.Tensor | Iterable[torch.Tensor], n: int, alpha: float,
                     batch_size: int | None = None, seeds: Iterable[int | None] | None = None
                     ) -> Iterator[PredictResult]:
        """PREDICT every input (as :meth:`certify_many`: shared batches, results in order, one per seed; an edit of
        the model while the results are consumed stops the call before the next result)."""
        check_certify_counts(None, n, alpha, batch_size)
        return self._predict_stream(with_seeds(inputs_of(inputs), seeds), n, alpha, batch_size)

    def _predict_stream(self, seeded, n, alpha, batch_size) -> Iterator[PredictResult]:
        with evaluating(self.model):
            engine, guard = self.engine_and_guard()
            for window, _, counts, seconds in self._windows(engine, guard, seeded, 0, n, batch_size):
                yield from _checked(guard, (_predict_result(counts[1, i], alpha, pending.stream.seed, seconds,
                                                            pending.x.rounding)
                                            for i, pending in enumerate(window)))


_Result = TypeVar("_Result")


def _checked(guard: CallGuard, results: Iterable[_Result]) -> Iterator[_Result]:
    """``results`` one by one, each after checking that the caller has not edited the model since the previous one:
    results computed before an edit describe the model as it was sampled, not the edited one."""
    for result in results:
        guard.check()
        yield result


def _predict_result(counts: torch.Tensor, alpha: float, seed: int, seconds: float, rounding: float) -> PredictResult:
    top = int(counts.argmax())  # ties go to the lowest class index
    ordered = counts.sort(descending=True).values
    n1 = int(ordered[0])
    n2 = int(ordered[1]) if counts.numel() > 1 else 0
    p_value = two_sided_binomial_pvalue(n1, n2)
    return PredictResult(top if p_value <= alpha else ABSTAIN, n1, n2, p_value, seed, seconds, rounding)


__all__ = ["ABSTAIN", "CertifyResult", "PredictResult", "Smoother", "PRECISIONS"]
