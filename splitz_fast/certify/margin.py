"""Deterministic logit-margin certificates for a classifier that lies entirely in ``f_L`` (no noise).

The "Lipschitz-only" baseline of the paper's tabular figures (local-Lipschitz-constrained training, Huang et al.
2021): for ``x'`` in ``B(x, γ)`` each logit difference moves by at most
``‖e_y − e_j‖·‖f(x') − f(x)‖ ≤ √2·L(x, γ)·‖x' − x‖``, so the prediction ``y`` cannot change within
``min(m/(√2·L(x, γ)), γ)`` where ``m = z_y − max_{j≠y} z_j`` is the logit margin at ``x``. That is the SPLITZ radius
with ``m/√2`` in place of the latent radius ``R``, so the bound options and the γ search are
:mod:`splitz_fast.bounds.radius`'s, shared with :class:`~splitz_fast.certify.smoothing.Smoother`.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

from ..model.modules import SplitModel
from ..model.snapshot import ModuleSnapshot
from ..bounds.radius import BoundOptions, RadiusSearch, check_bound_options
from ..kinds import NO_BOUND
from .inputs import CallGuard, evaluating, inputs_of, prepare_input, resolve_seed, with_seeds
from .smoothing import ABSTAIN, CertifyResult, about_given_input


def check_margin_model(model: SplitModel) -> None:
    """Refuse a model whose logits are not all computed by ``f_L``: the margin certificate's Lipschitz bound covers
    ``f_L`` only, so ``f_R`` must be parameter-free glue (exactly ``nn.Sequential``, ``nn.Identity``, ``nn.Flatten``:
    a subclass could compute something else with its own ``forward``)."""
    model.check_structure()
    right = model.right
    if model.split_index == 0 or any(type(m) not in (nn.Sequential, nn.Identity, nn.Flatten)
                                     for m in right.modules()) or any(True for _ in right.parameters()) \
            or any(m._forward_hooks or m._forward_pre_hooks for m in right.modules()):
        raise ValueError(
            "the margin certificate needs the whole classifier in f_L (split after the last affine layer, f_R "
            "empty, no hooks): its Lipschitz bound must cover every layer up to the logits"
        )


class MarginCertifier:
    """Margin certificates (module docstring) for a model whose last affine layer gives the logits (``f_R`` empty).

    Args:
        model: a :class:`~splitz_fast.model.modules.SplitModel` split after its last affine layer.
        bound_options: the Lipschitz bound and γ search, a :class:`~splitz_fast.bounds.radius.BoundOptions` (``None``: its
            defaults) as :class:`~splitz_fast.certify.smoothing.Smoother` takes it; kept as :attr:`options`. The 0.1.0 keywords
            (``bound_method=...``, …) still work with a ``DeprecationWarning`` until 0.3.0, as for the Smoother.

    Logits are computed in float64 from a float64 copy of ``f_L`` (rebuilt whenever ``f_L`` changes; the README's
    caveat applies: the guarantee is for the real-valued network). Results carry ``p_a_lower = nan``,
    ``latent_radius = m/√2``, ``count_a = n = 0`` and ``failure_prob`` = the bounds' δ (0 when exact); a tie at the
    top logit abstains. Nothing is sampled: ``seed`` seeds probabilistic bounds only (dataset runs:
    :class:`~splitz_fast.runs.tasks.MarginRun`).
    """

    def __init__(self, model: SplitModel, *, bound_options: BoundOptions | None = None,
                 **deprecated_bound_keywords):
        if not isinstance(model, SplitModel):
            raise TypeError(f"model must be a splitz_fast.SplitModel, got {type(model).__name__}")
        check_margin_model(model)
        self._model = model
        if "sigma" in deprecated_bound_keywords:
            raise TypeError("MarginCertifier adds no noise: it takes no sigma")
        self.options = check_bound_options(bound_options, deprecated_bound_keywords, "MarginCertifier")
        self.radius_search = RadiusSearch(model, self.options)
        self._left64: tuple[nn.Module, ModuleSnapshot, nn.Module] | None = None

    @property
    def model(self) -> SplitModel:
        """The model certified (fixed at construction; its halves are read as they are at each call)."""
        return self._model

    bound = property(lambda self: self.options.bound)
    bound_method = property(lambda self: self.options.bound_method)
    gamma_search = property(lambda self: self.options.gamma_search)

    def _float64_left(self) -> nn.Module:
        """A float64 copy of ``f_L`` for the logits, rebuilt whenever ``f_L`` was replaced or any of its weights,
        buffers or layers changed."""
        left = self.model.left
        if self._left64 is None or self._left64[0] is not left or not self._left64[1].matches(left):
            self._left64 = (left, ModuleSnapshot(left), copy.deepcopy(left).double().eval())
        return self._left64[2]

    def certify(self, x: torch.Tensor, seed: int | None = None) -> CertifyResult:
        check_margin_model(self.model)  # as the model is now: either half may have been replaced since __init__
        with evaluating(self.model):
            prepared = prepare_input(self.model, x)
            return about_given_input(self._certify(prepared.x, resolve_seed(seed)), prepared.rounding)

    def certify_many(self, inputs: torch.Tensor | Iterable[torch.Tensor],
                     seeds: Iterable[int | None] | None = None) -> Iterator[CertifyResult]:
        """Certificates of every input, in order (one seed per input: as many seeds as inputs, else a
        ``ValueError``). Editing the model while the results are consumed stops the call with a ``RuntimeError``
        before the next result, as in :meth:`~splitz_fast.certify.smoothing.Smoother.certify_many`."""
        return self._certify_stream(with_seeds(inputs_of(inputs), seeds))

    def _certify_stream(self, seeded) -> Iterator[CertifyResult]:
        check_margin_model(self.model)
        guard = CallGuard(self.model)
        for x, seed in seeded:
            guard.check()  # the caller's code ran since the previous result
            yield self.certify(x, seed=seed)

    def _certify(self, x: torch.Tensor, seed: int) -> CertifyResult:
        start = time.perf_counter()
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed)
        with torch.no_grad():
            logits = self.model.right(self._float64_left()(x.double().unsqueeze(0)))[0]
        if logits.numel() < 2:
            raise ValueError("the margin certificate needs at least two logits")
        top2 = logits.topk(2)
        candidate = int(top2.indices[0])
        margin = float(top2.values[0] - top2.values[1])
        if margin <= 0:
            return CertifyResult(ABSTAIN, 0.0, math.nan, 0.0, math.nan, math.nan, str(NO_BOUND), 0.0, 0, 0, 0, seed,
                                 time.perf_counter() - start, "none")
        radius_latent = margin / math.sqrt(2.0)
        best = self.radius_search.search(x, radius_latent, generator)
        return CertifyResult(
            prediction=candidate, radius=best.radius, p_a_lower=math.nan, latent_radius=radius_latent,
            lipschitz=best.lipschitz, gamma=best.gamma, bound_kind=best.kind, failure_prob=best.failure,
            count_a=0, n=0, gamma_evaluations=best.evaluations, seed=seed, seconds=time.perf_counter() - start,
            noise_source="none",
        )


__all__ = ["MarginCertifier"]
