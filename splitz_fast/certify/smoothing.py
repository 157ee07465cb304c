"""The SPLITZ smoothed classifier: Cohen's CERTIFY and PREDICT around ``f_R``, for one input or a stream of them.

``g(x) = argmax_c P_δ[f_R(f_L(x) + δ) = c]`` with ``δ ~ N(0, σ² I)`` in the latent space of ``f_L``. The smoother
owns σ: the sampling engine (:mod:`splitz_fast.sampling.engine`) draws the noise with it, and the same σ enters the radius.
Certification of one input is a pure function of that input, the model and the seed — also inside
:meth:`Smoother.certify_many`, which packs the samples of several inputs into shared ``f_R`` batches — up to the
float rounding of ``f_R``, which the batch size and, on CUDA, the engine's measured choices (CUDA graph, fused copy,
``torch.compile``, cuDNN's autotuned convolution algorithms) may change: a vote that sits on a class boundary may
then fall the other way.

Radius (Theorem 1): ``max over evaluated γ of min(R / L(x, γ), γ)`` with ``R = σ Φ⁻¹(p_A_lower)`` and ``L`` a
certificate bound (:mod:`splitz_fast.bounds.radius`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from .._checks import check_certify_counts, check_count, check_positive
from .inputs import CallGuard, inputs_of, model_device, with_seeds
from ..cuda_math import ieee_float32
from ..model.modules import SplitModel, latent_of
from .outcomes import ABSTAIN, CertifyResult, PredictResult, about_given_input
from .protocols import CertificationProtocol, get_protocol
from ..bounds.radius import BoundOptions, RadiusSearch, check_bound_options
from ..sampling.engine import PRECISIONS, SamplingEngine, check_engine_settings, default_max_batch
from .windows import certify_stream, predict_stream


class Smoother:
    """Randomized smoothing of ``f_R`` in the latent space of ``f_L``, with SPLITZ certificates.

    Args:
        model: a :class:`~splitz_fast.model.modules.SplitModel` (``split_index == 0`` is Cohen's plain RS).
        sigma: noise level σ > 0, in latent units.
        bound_options: the bound and γ search, a :class:`~splitz_fast.bounds.radius.BoundOptions` (default: its defaults).
        precision: how ``f_R`` computes while sampling, a key of ``sampling.PRECISIONS`` (``"float32"``,
            IEEE also on CUDA, the default): the base classifier, not the validity of its certificates, changes.
        compile, cuda_graphs, fused_kernels: how the engine runs ``f_R`` (:class:`~splitz_fast.sampling.engine.SamplingEngine`):
            compiled (tried on CUDA after a minute of sampling), as a CUDA graph, fused; ``None`` (default): where faster.
        max_batch_size: the largest batch the tuner tries (default 4096; on CUDA 32768: ``sampling.default_max_batch``).
        overlap_bounds: compute the radius search of one group of inputs on a worker thread (a side CUDA stream)
            while the next group samples; default: on CUDA only (on a CPU both compete for the same cores).
        protocol: ``"sound"`` (default: a certificate), or ``"paper"`` / ``"published-code"`` (or a
            :class:`~splitz_fast.certify.protocols.CertificationProtocol` such as ``PublishedCode(data_std=(0.3081,))``), the
            estimates behind the SPLITZ paper's numbers (:mod:`splitz_fast.certify.protocols`): **not certificates** — their
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
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        fused_kernels: bool | None = None,
        max_batch_size: int | None = None,
        overlap_bounds: bool | None = None,
        protocol: str | CertificationProtocol = "sound",
        **deprecated_bound_keywords,
    ):
        if not isinstance(model, SplitModel):
            raise TypeError(f"model must be a splitz_fast.SplitModel, got {type(model).__name__}; "
                            "build one with split_sequential() or SplitModel(left, right, num_classes)")
        check_engine_settings(precision, cuda_graphs, fused_kernels, compile)
        self._model = model
        self.sigma = check_positive("sigma", sigma)
        self.options = check_bound_options(bound_options, deprecated_bound_keywords, "Smoother")
        self.radius_search = RadiusSearch(model, self.options)
        self.protocol = get_protocol(protocol)
        self.protocol.check(model)
        self.precision, self.compile, self.cuda_graphs = precision, compile, cuda_graphs
        self._max_batch_size = None if max_batch_size is None else check_count("max_batch_size", max_batch_size)
        self.overlap_bounds, self.fused_kernels = overlap_bounds, fused_kernels
        self._engine: SamplingEngine | None = None
        model.check_structure()

    @property
    def model(self) -> SplitModel:
        """The model this smoother certifies (fixed at construction); every call reads its halves as they are then."""
        return self._model

    # The settings a run records (CLI sidecars) read these names.
    bound = property(lambda self: self.options.bound)
    bound_method = property(lambda self: self.options.bound_method)
    gamma_search = property(lambda self: self.options.gamma_search)

    max_batch_size = property(lambda self: self._max_batch_size or default_max_batch(self.device),
                              doc="The largest ``f_R`` batch the tuner tries: the one given, or the device's default.")

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def engine(self) -> SamplingEngine:
        """The sampling engine for ``f_R`` as the model holds it now, on its current device: rebuilt when ``model.right``
        was replaced, its copies when ``f_R`` changed (:meth:`~splitz_fast.sampling.prepared.PreparedClassifier.check_current`)."""
        model, device = self.model, self.device
        engine = self._engine
        if engine is None or engine.device != device or engine.source is not model.right \
                or engine.num_classes != model.num_classes:
            engine = self._engine = SamplingEngine(model.right, model.num_classes, self.sigma, device, self.precision,
                                                   self.compile, self.cuda_graphs, self.fused_kernels)
        engine.prepared.check_current()
        return engine

    @torch.inference_mode()
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``f_L(x)`` for one input as float32, from the weights the bound reads (:func:`~splitz_fast.model.modules.latent_of`:
        no module call, no hook) in IEEE float32 also on CUDA (:func:`~splitz_fast.cuda_math.ieee_float32`)."""
        with ieee_float32(self.device):
            return latent_of(self.model.left, x.unsqueeze(0))[0].float().contiguous()

    def batch_size_for(self, engine: SamplingEngine, latent: torch.Tensor, batch_size: int | None) -> int:
        """The ``f_R`` batch of a call: ``batch_size`` checked, or the engine's measured one when ``None``."""
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
        (:func:`~splitz_fast.certify.inputs.with_seeds`). Editing the model while the results are being consumed stops the call
        with a ``RuntimeError`` before the next result (start a new call to certify the edited model).
        """
        n0, n, alpha, batch_size = check_certify_counts(n0, n, alpha, batch_size)
        return certify_stream(self, with_seeds(inputs_of(inputs), seeds), n0, n, alpha, batch_size)

    def engine_and_guard(self) -> tuple[SamplingEngine, CallGuard]:
        """The sampling engine for one certify/predict call (:meth:`engine`) and the guard that stops the call if the
        model is edited while it runs (:class:`~splitz_fast.certify.inputs.CallGuard`, sharing the snapshot of ``f_R`` that
        the engine has just checked instead of copying ``f_R`` again). Lazy calls of other certifiers built on this
        smoother (:class:`~splitz_fast.certify.sequential.SequentialCertifier`) start with it too."""
        _check_sampled_as_given(self.model)
        engine = self.engine()
        return engine, CallGuard(self.model, right=engine.prepared.snapshot)

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
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        return predict_stream(self, with_seeds(inputs_of(inputs), seeds), n, alpha, batch_size)


def _check_sampled_as_given(model: SplitModel) -> None:
    """:meth:`SplitModel.check_structure`, and refuse what sampling ``f_R(f_L(x) + noise)`` would silently leave out:
    hooks on the SplitModel itself (its ``forward`` is never called), and a model kept in another floating dtype
    (inputs, latents and bounds are float32, float64 inside the bounds; a reduced-precision f_R is a labelled sampling
    setting, not a dtype of the weights)."""
    model.check_structure()
    if model._forward_hooks or model._forward_pre_hooks:
        raise ValueError("the SplitModel has forward hooks: certifiers call model.left and model.right, never "
                         "model(x), so a hook there would not take part in what is certified; register it on "
                         "model.right (f_R) instead, or remove it (handle.remove())")
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                    if p.is_floating_point() and p.dtype != torch.float32})
    if found:
        raise TypeError(f"the model's weights must be float32, found {', '.join(found)}: convert it with "
                        "model.float(), and for a reduced-precision f_R pass precision='bfloat16' or 'float16' to the "
                        "Smoother")


__all__ = ["ABSTAIN", "CertifyResult", "PredictResult", "Smoother", "PRECISIONS", "about_given_input"]
