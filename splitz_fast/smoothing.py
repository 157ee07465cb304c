"""The SPLITZ smoothed classifier: Cohen's CERTIFY and PREDICT around ``f_R``, and the SPLITZ radius.

``g(x) = argmax_c P_δ[f_R(f_L(x) + δ) = c]`` with ``δ ~ N(0, σ² I)`` in the latent space of ``f_L``. The smoother
owns σ: it draws the noise (float32, on the input's device, from a seeded generator), and the same σ enters the
radius. Certification of one input is a pure function of that input, the model and the seed.

Radius (Theorem 1): ``max over evaluated γ of min(R / L(x, γ), γ)`` with ``R = σ Φ⁻¹(p_A_lower)`` and ``L`` a
certificate bound from :mod:`splitz_fast.lipschitz`.
"""
from __future__ import annotations

import contextlib
import copy
import math
import secrets
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ._checks import check_count, check_positive, check_probability, check_tensor
from .lipschitz import (
    DEFAULT_EXACT_MAX_DIM,
    DEFAULT_PROBABILISTIC_ITERS,
    LipschitzBound,
    global_lipschitz_bound,
    lipschitz_bound,
)
from .modules import SplitModel
from .kernels import select_backend
from .kernels.noise_votes import count_votes, count_votes_reference, noisy_latents, noisy_latents_reference
from .stats import clopper_pearson_lower, latent_radius, two_sided_binomial_pvalue

ABSTAIN = -1
GAMMA_SEARCHES = ("bisection", "one-step")
BOUNDS = ("local", "global")
# Precision of f_R during sampling: the noisy latent is formed in float32 and cast to this dtype, and f_R runs under
# autocast. The base classifier of the smoothed classifier is then "f_R in this precision": the certificate holds for
# it as long as the same precision is used for PREDICT and CERTIFY (a Smoother applies it to both).
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CertifyResult:
    """Outcome of CERTIFY for one input.

    ``radius`` is in raw input units (``ABSTAIN`` prediction → radius 0). ``failure_prob`` is the total probability
    that the certificate is wrong: α plus the failure probability of every probabilistic Lipschitz bound evaluated.
    ``bound_kind`` says what produced ``lipschitz``: ``identity`` (s = 0), ``local-exact``, ``local-probabilistic``,
    ``global-exact`` or ``global-probabilistic``. ``noise_source`` says which generator drew the noise (``philox-triton``
    or ``torch-<device>``): with the seed, it is what a rerun needs to reproduce the certificate.
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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PredictResult:
    """Outcome of PREDICT: ``prediction`` is ``ABSTAIN`` unless the top class wins the binomial test at level α."""

    prediction: int
    count_top: int
    count_second: int
    p_value: float
    seed: int


@dataclass
class NoiseStream:
    """Where one certify/predict call draws its noise: the seed (the Philox key of the Triton kernel), the torch
    generator seeded with it (the reference path), and the next unused Philox sample index."""

    seed: int
    generator: torch.Generator
    offset: int = 0


class Smoother:
    """Randomized smoothing of ``f_R`` in the latent space of ``f_L``, with SPLITZ certificates.

    Args:
        model: a :class:`~splitz_fast.modules.SplitModel` (``split_index == 0`` is Cohen's plain RS).
        sigma: noise level σ > 0, in latent units.
        bound: ``"local"`` (``L(x, γ)``, the paper's method) or ``"global"`` (input-independent product of norms).
        bound_method: ``"auto"``, ``"exact"`` or ``"probabilistic"``, see :func:`~splitz_fast.lipschitz.lipschitz_bound`.
        bound_delta: total failure probability allowed to probabilistic bounds *per certified input*; it is split
            evenly over the γ evaluations and layers and added to α in the result. Unused by exact bounds.
        power_iters: power steps of the probabilistic bound.
        exact_max_dim: largest Gram dimension handled by the exact bound under ``"auto"``.
        gamma_search: ``"bisection"`` (``gamma_steps`` halvings of ``[0, R/L(x,0)]``) or ``"one-step"`` (paper
            Remark 1: ``γ₁ = R/L_ref``, then ``γ₂ = R/L(x, γ₁)``). Every evaluated γ gives a valid radius; the best
            is reported.
        reference_lipschitz: ``L_ref`` of the one-step search (e.g. the mean ``L`` over data); ``L(x, 0)`` if None.
        gamma_max: search ceiling when ``L(x, 0) = 0`` (``f_L`` locally constant), in raw input units.
        precision: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the dtype ``f_R`` runs in while sampling
            (noise and the noisy latent are float32 until the cast). Lower precision changes the base classifier, not
            the validity of its certificates; compare runs only at the same precision.
    """

    def __init__(
        self,
        model: SplitModel,
        sigma: float,
        *,
        bound: str = "local",
        bound_method: str = "auto",
        bound_delta: float = 1e-6,
        power_iters: int = DEFAULT_PROBABILISTIC_ITERS,
        exact_max_dim: int = DEFAULT_EXACT_MAX_DIM,
        gamma_search: str = "bisection",
        gamma_steps: int = 8,
        reference_lipschitz: float | None = None,
        gamma_max: float = 10.0,
        precision: str = "float32",
    ):
        if not isinstance(model, SplitModel):
            raise TypeError(f"model must be a splitz_fast.SplitModel, got {type(model).__name__}; "
                            "build one with split_sequential() or SplitModel(left, right, num_classes)")
        if bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
        if gamma_search not in GAMMA_SEARCHES:
            raise ValueError(f"gamma_search must be one of {GAMMA_SEARCHES}, got {gamma_search!r}")
        if bound_method not in ("auto", "exact", "probabilistic"):
            raise ValueError(f"bound_method must be 'auto', 'exact' or 'probabilistic', got {bound_method!r}")
        self.model = model
        self.sigma = check_positive("sigma", sigma)
        self.bound = bound
        self.bound_method = bound_method
        self.bound_delta = check_probability("bound_delta", bound_delta)
        self.power_iters = check_count("power_iters", power_iters)
        self.exact_max_dim = check_count("exact_max_dim", exact_max_dim, 0)
        self.gamma_search = gamma_search
        self.gamma_steps = check_count("gamma_steps", gamma_steps, 0)
        if reference_lipschitz is not None:
            check_positive("reference_lipschitz", reference_lipschitz)
        self.reference_lipschitz = reference_lipschitz
        self.gamma_max = check_positive("gamma_max", gamma_max)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self._global: LipschitzBound | None = None
        self._global_key: tuple | None = None
        model.left.check_thresholds()

    # ------------------------------------------------------------------ sampling engine
    @contextlib.contextmanager
    def _evaluating(self):
        """Run the model in eval mode (BatchNorm running statistics, no dropout) and restore its modes afterwards:
        votes must be i.i.d. draws of one fixed base classifier, and certifying must not change the model."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.model.input_shape
        check_tensor("x", x, ndim=None if shape is None else (len(shape), len(shape) + 1), shape_tail=shape)
        if shape is not None and x.ndim == len(shape) + 1:
            if x.shape[0] != 1:
                raise ValueError(f"certify/predict take one input at a time, got a batch of {x.shape[0]}")
            x = x[0]
        return x.to(self.device, torch.float32)

    def _generator(self, seed: int | None) -> tuple[torch.Generator, int]:
        if seed is None:
            seed = secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen, seed

    @staticmethod
    def noise_source(device: torch.device) -> str:
        """``philox-triton`` where the Triton noise kernel runs, else ``torch-<device type>``."""
        return "philox-triton" if select_backend("noisy_latents", device) == "triton" else f"torch-{device.type}"

    @torch.inference_mode()
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``f_L(x)`` for one input ``x`` (computed once per input; noise is added after it)."""
        return self.model.left(x.unsqueeze(0))[0]

    @torch.inference_mode()
    def sample_counts(self, latent: torch.Tensor, num: int, batch_size: int, noise: NoiseStream) -> torch.Tensor:
        """Class counts of ``f_R(latent + δ)`` over ``num`` float32 noise draws: ``[num_classes]`` int64, left on the
        latent's device (votes are counted there; the caller synchronises once per input). Noise and votes use the
        Triton kernels on CUDA (``splitz_fast.kernels.noise_votes``), their PyTorch references elsewhere.
        """
        num_classes = self.model.num_classes
        device = latent.device
        counts = torch.zeros(num_classes, dtype=torch.int64, device=device)
        triton_noise = select_backend("noisy_latents", device) == "triton"
        count = count_votes if select_backend("count_votes", device) == "triton" else count_votes_reference
        channels_last = latent.ndim == 3  # image-shaped latents: NHWC batches for the convolutions of f_R
        latent32 = latent.float().contiguous()
        dtype = PRECISIONS[self.precision]
        # Lower precision: the cast happens in the noise kernel; autocast runs f_R's weights in the same dtype.
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        remaining = num
        while remaining > 0:
            b = min(batch_size, remaining)
            if triton_noise:
                noisy = noisy_latents(latent32, b, self.sigma, noise.seed, noise.offset, out_dtype=dtype,
                                      channels_last=channels_last)
                noise.offset += b  # Philox sample indices are never reused: independent draws
            else:
                noisy = noisy_latents_reference(latent32, b, self.sigma, noise.generator, out_dtype=dtype,
                                                channels_last=channels_last)
            with autocast:
                logits = self.model.right(noisy)
            if logits.ndim != 2 or logits.shape[1] != num_classes:
                raise ValueError(f"f_R returned scores of shape {tuple(logits.shape)}, expected [batch, num_classes="
                                 f"{num_classes}]; fix num_classes of the SplitModel or the last layer of f_R")
            count(logits, counts)
            remaining -= b
        return counts

    # ------------------------------------------------------------------ Lipschitz bounds and γ search
    def global_bound(self) -> LipschitzBound:
        """The global bound of ``f_L``, reused until a weight or buffer of ``f_L`` changes (an optimizer step or
        ``load_state_dict`` bumps the tensors' versions), so a stale bound can never certify a changed model."""
        key = self._left_version_key()
        if self._global is None or key != self._global_key:
            self._global_key = key
            if self.model.input_shape is None:
                raise ValueError("the global bound needs the model's input_shape (LeftHalf(input_shape=...))")
            gen = torch.Generator(device=self.device)
            gen.manual_seed(0)
            self._global = global_lipschitz_bound(
                self.model.left, self.model.input_shape, method=self.bound_method,
                delta=self.bound_delta / max(1, self.model.split_index), n_iter=self.power_iters,
                exact_max_dim=self.exact_max_dim, generator=gen,
            )
        return self._global

    def _left_version_key(self) -> tuple:
        """Identity and version of every tensor of ``f_L``: changes whenever a weight or buffer of ``f_L`` does."""
        return tuple((id(t), t._version) for t in (*self.model.left.parameters(), *self.model.left.buffers()))

    def _max_evaluations(self) -> int:
        return 2 + self.gamma_steps if self.gamma_search == "bisection" else 3

    def _search_gamma(self, x: torch.Tensor, radius_latent: float, generator: torch.Generator) -> dict:
        """Best ``min(R/L(x,γ), γ)`` over the γ evaluated by the configured search."""
        if self.model.split_index == 0:
            return dict(radius=radius_latent, gamma=radius_latent, lipschitz=1.0, kind="identity",
                        failure=0.0, evaluations=0)
        if self.bound == "global":
            g = self.global_bound()
            lip = float(g.value[0])
            radius = radius_latent / lip if lip > 0 else self.gamma_max
            return dict(radius=radius, gamma=radius, lipschitz=lip, kind=f"global-{g.kind[0]}",
                        failure=g.failure_prob[0], evaluations=0)

        delta_eval = self.bound_delta / (self._max_evaluations() * self.model.split_index)
        best = dict(radius=0.0, gamma=0.0, lipschitz=math.nan, kind="local-exact", failure=0.0, evaluations=0)
        failure = 0.0
        evaluations = 0

        def evaluate(gamma: float) -> float:
            nonlocal failure, evaluations
            bound = lipschitz_bound(
                self.model.left, x.unsqueeze(0), gamma, method=self.bound_method, delta=delta_eval,
                n_iter=self.power_iters, exact_max_dim=self.exact_max_dim, generator=generator,
            )
            lip = float(bound.value[0])
            failure += bound.failure_prob[0]
            evaluations += 1
            radius = gamma if lip == 0 else min(radius_latent / lip, gamma)
            if radius > best["radius"] or evaluations == 1:
                best.update(radius=radius, gamma=gamma, lipschitz=lip, kind=f"local-{bound.kind[0]}")
            return lip

        lip0 = evaluate(0.0)
        ceiling = radius_latent / lip0 if lip0 > 0 else self.gamma_max
        if self.gamma_search == "bisection":
            # h(γ) = γ − R/L(x,γ) is increasing and crosses 0 in [0, R/L(x,0)].
            evaluate(ceiling)
            lo, hi = 0.0, ceiling
            for _ in range(self.gamma_steps):
                mid = (lo + hi) / 2
                lip = evaluate(mid)
                if lip == 0 or radius_latent / lip >= mid:
                    lo = mid
                else:
                    hi = mid
        else:
            reference = self.reference_lipschitz if self.reference_lipschitz is not None else lip0
            gamma1 = radius_latent / reference if reference > 0 else self.gamma_max
            lip1 = evaluate(gamma1)
            gamma2 = radius_latent / lip1 if lip1 > 0 else self.gamma_max
            if gamma2 != gamma1:
                evaluate(gamma2)
        best.update(failure=failure, evaluations=evaluations)
        return best

    # ------------------------------------------------------------------ Cohen's CERTIFY and PREDICT
    def certify(
        self, x: torch.Tensor, n0: int, n: int, alpha: float, batch_size: int = 1000, seed: int | None = None
    ) -> CertifyResult:
        """CERTIFY (Cohen et al. 2019) with the SPLITZ radius, for one input ``x: [*input_shape]``.

        ``n0`` selection draws pick ``ĉ_A`` (ties to the lowest class index); ``n`` fresh, independent draws give
        ``p_A_lower = Beta.ppf(α; n_A, n − n_A + 1)``; abstain if ``p_A_lower < 1/2``. The model runs in eval mode.
        """
        with self._evaluating():
            return self._certify(x, n0, n, alpha, batch_size, seed)

    def _certify(self, x, n0, n, alpha, batch_size, seed) -> CertifyResult:
        start = time.perf_counter()
        x = self._prepare_input(x)
        check_count("n0", n0)
        check_count("n", n)
        if n0 > n:
            raise ValueError(f"n0 ({n0}) must not exceed n ({n}); n0 only selects the class, n estimates p_A")
        check_probability("alpha", alpha)
        check_count("batch_size", batch_size)
        generator, seed = self._generator(seed)
        noise = NoiseStream(seed, generator)
        latent = self.latent(x)
        # Selection and estimation draws are independent, so both run before the single host synchronisation.
        selection = self.sample_counts(latent, n0, batch_size, noise)
        estimation = self.sample_counts(latent, n, batch_size, noise)
        candidate_on_device = selection.argmax()  # ties go to the lowest class index
        summary = torch.stack([candidate_on_device, estimation[candidate_on_device]]).cpu()  # the one host sync
        candidate, count_a = int(summary[0]), int(summary[1])
        p_lower = clopper_pearson_lower(count_a, n, alpha)
        if p_lower < 0.5:
            return CertifyResult(ABSTAIN, 0.0, p_lower, 0.0, math.nan, math.nan, "none", alpha, count_a, n, 0, seed,
                                 time.perf_counter() - start, self.noise_source(latent.device))
        radius_latent = latent_radius(self.sigma, p_lower)
        best = self._search_gamma(x, radius_latent, generator)
        return CertifyResult(
            prediction=candidate, radius=best["radius"], p_a_lower=p_lower, latent_radius=radius_latent,
            lipschitz=best["lipschitz"], gamma=best["gamma"], bound_kind=best["kind"],
            failure_prob=alpha + best["failure"], count_a=count_a, n=n, gamma_evaluations=best["evaluations"],
            seed=seed, seconds=time.perf_counter() - start, noise_source=self.noise_source(latent.device),
        )

    def predict(self, x: torch.Tensor, n: int, alpha: float, batch_size: int = 1000,
                seed: int | None = None) -> PredictResult:
        """PREDICT (Cohen et al. 2019): abstain unless the two-sided binomial test of the top two counts at
        p = 1/2 has p-value ≤ α. The model runs in eval mode."""
        with self._evaluating():
            return self._predict(x, n, alpha, batch_size, seed)

    def _predict(self, x, n, alpha, batch_size, seed) -> PredictResult:
        x = self._prepare_input(x)
        check_count("n", n)
        check_probability("alpha", alpha)
        check_count("batch_size", batch_size)
        generator, seed = self._generator(seed)
        counts = self.sample_counts(self.latent(x), n, batch_size, NoiseStream(seed, generator)).cpu()
        top = int(counts.argmax())  # ties go to the lowest class index
        ordered = counts.sort(descending=True).values
        n1 = int(ordered[0])
        n2 = int(ordered[1]) if counts.numel() > 1 else 0
        p_value = two_sided_binomial_pvalue(n1, n2)
        prediction = top if p_value <= alpha else ABSTAIN
        return PredictResult(prediction, n1, n2, p_value, seed)


class MarginCertifier(Smoother):
    """Deterministic certificates for a classifier that lies *entirely* in ``f_L`` (its last affine layer gives the
    logits; ``f_R`` empty) — the "Lipschitz-only" baseline of the paper's tabular figures (local-Lipschitz-constrained
    training, Huang et al. 2021), certified without noise.

    For ``x'`` in ``B(x, γ)`` each logit difference moves by at most ``‖e_y − e_j‖·‖f(x') − f(x)‖ ≤ √2·L(x, γ)·‖x' − x‖``,
    so the prediction ``y`` cannot change within ``min(m/(√2·L(x, γ)), γ)`` where ``m = z_y − max_{j≠y} z_j`` is the
    logit margin at ``x``. That is the SPLITZ radius with ``m/√2`` in place of the latent radius ``R``, so the bound
    options and the γ search are :class:`Smoother`'s. Logits are computed in float64 (the caveat of the README
    applies: the guarantee is for the real-valued network).

    ``certify(x, ...)`` keeps :class:`Smoother`'s signature so dataset runs and TSVs work unchanged; ``n0``, ``n``,
    ``alpha`` and ``batch_size`` are ignored (no sampling), ``seed`` seeds probabilistic bounds only. Results carry
    ``p_a_lower = nan``, ``latent_radius = m/√2``, ``count_a = n = 0`` and ``failure_prob`` = the bounds' δ (0 when
    exact); a tie at the top logit abstains.
    """

    def __init__(self, model: SplitModel, **options):
        if "sigma" in options:
            raise TypeError("MarginCertifier adds no noise: it takes no sigma")
        right_params = [p for p in model.right.parameters()]
        if model.split_index == 0 or any(not isinstance(m, (nn.Sequential, nn.Identity, nn.Flatten))
                                         for m in model.right.modules()) or right_params:
            raise ValueError(
                "the margin certificate needs the whole classifier in f_L (split after the last affine layer, f_R "
                "empty): its Lipschitz bound must cover every layer up to the logits"
            )
        super().__init__(model, 1.0, **options)  # σ is unused: nothing is sampled
        self._left64: tuple[tuple, nn.Module] | None = None

    def _float64_left(self) -> nn.Module:
        """A float64 copy of ``f_L`` for the logits, rebuilt only when a weight or buffer of ``f_L`` changes."""
        key = self._left_version_key()
        if self._left64 is None or self._left64[0] != key:
            self._left64 = (key, copy.deepcopy(self.model.left).double().eval())
        return self._left64[1]

    def _certify(self, x, n0, n, alpha, batch_size, seed) -> CertifyResult:
        start = time.perf_counter()
        x = self._prepare_input(x)
        generator, seed = self._generator(seed)
        with torch.no_grad():
            logits = self.model.right(self._float64_left()(x.double().unsqueeze(0)))[0]
        if logits.numel() < 2:
            raise ValueError("the margin certificate needs at least two logits")
        top2 = logits.topk(2)
        candidate = int(top2.indices[0])
        margin = float(top2.values[0] - top2.values[1])
        if margin <= 0:
            return CertifyResult(ABSTAIN, 0.0, math.nan, 0.0, math.nan, math.nan, "none", 0.0, 0, 0, 0, seed,
                                 time.perf_counter() - start, "none")
        radius_latent = margin / math.sqrt(2.0)
        best = self._search_gamma(x, radius_latent, generator)
        return CertifyResult(
            prediction=candidate, radius=best["radius"], p_a_lower=math.nan, latent_radius=radius_latent,
            lipschitz=best["lipschitz"], gamma=best["gamma"], bound_kind=best["kind"], failure_prob=best["failure"],
            count_a=0, n=0, gamma_evaluations=best["evaluations"], seed=seed, seconds=time.perf_counter() - start,
            noise_source="none",
        )

    def predict(self, *args, **kwargs):
        raise NotImplementedError("MarginCertifier certifies the network itself; predict with model(x).argmax(-1)")
