"""Certification protocols: the sound certificate, and the two estimates behind the SPLITZ paper's numbers.

Users who compare with the paper need to know which part of its numbers comes from the certification protocol and
which from training. A protocol turns ``R`` (the certified latent radius of the smoothed ``f_R``, the same for all
three) into a radius in input space:

* ``sound`` (:class:`SoundCertificate`, the default, a *certificate*): Theorem 1 with a proven upper bound on
  ``L(x, γ)`` and the configured γ search (:class:`~splitz_fast.bounds.radius.RadiusSearch`).
* ``displacement`` (:class:`DisplacementCertificate`, a *certificate*, never smaller than ``sound``): the same search,
  then the latent-displacement bound of :mod:`splitz_fast.bounds.displacement` (clipped output ranges of the varying
  neurons), which only needs ``sup ‖f_L(x') − f_L(x)‖ < R`` on the ball rather than ``L·γ ≤ R``. An option until it
  shows a gain on real models (docs/results/displacement: none on LeNet).
* ``paper`` (:class:`PaperAlgorithm1`): Algorithm 1 and Remark 1 of the paper as written — the masked operator
  ``I^v W D`` of every layer (masks from the same float64 interval bounds), its spectral norm by 5 steps of power
  iteration from a random start, and the one-step γ search: ``γ' = R / L̃_ref``, ``γ* = R / L̃(x, γ')``, radius
  ``min(R / L̃(x, γ*), γ*)``. ``L̃_ref`` is the search's ``reference_lipschitz`` when given (the paper's mean
  over inference data), else ``L̃(x, 0)``.
* ``published-code`` (:class:`PublishedCode`): what the published SPLITZ code computes at certification (SPEC §2) —
  the masks switched off (a default argument), so ``L`` is the product of the layers' unmasked spectral norms by
  power iteration; and ``1/sd`` left out: ``L`` is the norm of the map from the *standardized* input
  ``z = (x − μ)/sd``, so the radius is in standardized units but reported as raw ones (×1/sd ≈ 3.25 on MNIST, the
  error the ICLR 2024 review found), radius ``R / L̃``. A model that standardizes inside ``f_L`` gets its
  ``Standardize``'s ``1/sd`` dropped; a model that takes raw inputs (our MNIST LeNets) is read as the published code
  read its network, behind a standardization by the dataset's ``data_std`` (``W_z = W diag(sd)``: MNIST 0.3081,
  :data:`PUBLISHED_DATA_STD`). Its carried-over ``L`` (the previous image's ``L`` placing this image's γ) changes
  nothing once ``L`` ignores the input, and its noise σ differing from the radius formula's cannot happen here (one
  σ): neither is modelled. Its normalisation constant is unsettled: one stored version of the code multiplies ``L`` by
  0.2023 (CIFAR-10's std, applied for every dataset), another divides by it; ``PublishedCode(lipschitz_factor=c)``
  reports ``c · L̃`` (default ``c = 1``; ``c = 0.2023`` for the multiplying version, ``1/0.2023`` for the dividing
  one), ``splitz certify --published-lipschitz-factor C``.

Power iteration (any Rayleigh quotient) is a *lower* estimate of a spectral norm, and the published code's radius is
in the wrong units, so ``paper`` and ``published-code`` are **estimates, not certificates**: their results carry the
kind ``paper-estimate`` / ``published-code-estimate`` in every row, a failure probability of NaN (nothing is
guaranteed), and runs record ``certificate: false`` (analysis and envelope plots draw them dashed, labelled "not a
certificate"). They exist to decompose the paper's numbers and to be falsified by attacks (docs/results).
"""
from __future__ import annotations

import abc
import dataclasses
import math

import torch

from ..bounds.displacement import displacement_radius
from ..bounds.estimate import lipschitz_estimate
from ..bounds.lipschitz import masked_operators
from ..bounds.radius import RadiusResult, RadiusSearch
from ..kinds import DISPLACEMENT, BoundKind

# Power steps of the paper's certification (its MNIST/CIFAR setting) and of the published code's estimate.
PAPER_POWER_ITERS = 5
# The per-channel std the published code standardized each dataset's inputs with (torchvision's MNIST constants).
PUBLISHED_DATA_STD: dict[str, tuple[float, ...]] = {"mnist": (0.3081,)}
# The constant one stored version of the published code multiplies L by (another divides by it): CIFAR-10's std of
# its first channel, applied for every dataset (PublishedCode's lipschitz_factor).
PUBLISHED_CIFAR10_STD0 = 0.2023


class CertificationProtocol(abc.ABC):
    """How a latent radius ``R`` becomes an input-space radius for one input (see the module docstring)."""

    name: str
    certificate: bool

    @abc.abstractmethod
    def radius(self, search: RadiusSearch, x: torch.Tensor, radius_latent: float,
               generator: torch.Generator | None) -> RadiusResult:
        """The radius of input ``x`` (``[*input_shape]``, float32 on the model's device) whose smoothed ``f_R`` is
        certified at ``radius_latent``; ``search`` holds the model (its current ``f_L``) and the bound options;
        ``generator`` (the input's own) seeds every random start."""

    def check(self, model) -> None:
        """Refuse (one clear error, before any sampling) a model this protocol cannot handle; nothing by default."""

    def radii(self, search: RadiusSearch, xs: list[torch.Tensor], radii_latent: list[float],
              generators: list[torch.Generator | None]) -> list[RadiusResult]:
        """:meth:`radius` of several inputs (a certify_many window), each equal to its own call."""
        return [self.radius(search, x, r, g) for x, r, g in zip(xs, radii_latent, generators)]


class SoundCertificate(CertificationProtocol):
    """Theorem 1 with a proven upper bound on ``L(x, γ)``: the configured :class:`RadiusSearch`, unchanged."""

    name, certificate = "sound", True

    def radius(self, search, x, radius_latent, generator):
        return search.search(x, radius_latent, generator)

    def radii(self, search, xs, radii_latent, generators):
        return search.search_many(xs, radii_latent, generators)  # the window's searches in lockstep


def _identity(radius_latent: float, kind: str) -> RadiusResult:
    return RadiusResult(radius_latent, radius_latent, 1.0, kind, math.nan, 0, 0)


class DisplacementCertificate(CertificationProtocol):
    """Theorem 1's search, then :func:`~splitz_fast.bounds.displacement.displacement_radius` from its result (sound; rows say
    ``displacement-exact`` / ``-probabilistic`` where the displacement bound won, with ``L`` = ``Δ(x, γ)/γ``, the
    effective Lipschitz constant over the ball, and the search's own kind where it did not)."""

    name, certificate = "displacement", True

    def radius(self, search, x, radius_latent, generator):
        baseline = search.search(x, radius_latent, generator)
        if search.left.depth == 0:
            return baseline
        found = displacement_radius(search.left, x, radius_latent, options=search.options, baseline=baseline,
                                    generator=generator)
        if found.candidate == "baseline":
            return dataclasses.replace(baseline, failure=found.failure, evaluations=found.evaluations)
        return RadiusResult(found.radius, found.gamma, found.displacement / found.gamma,
                            str(BoundKind.of(DISPLACEMENT, found.kind)),
                            found.failure, found.evaluations, found.evaluations)


class PaperAlgorithm1(CertificationProtocol):
    """The paper's Algorithm 1 with Remark 1's one-step γ search and 5-step masked power iteration (an estimate)."""

    name, certificate = "paper", False
    kind = str(BoundKind.estimate(name))  # "paper-estimate"

    def radius(self, search, x, radius_latent, generator):
        left = search.left
        if left.depth == 0:
            return _identity(radius_latent, self.kind)

        def estimate(gamma: float) -> float:
            value = lipschitz_estimate(left, x.unsqueeze(0).double(), gamma, power_iters=PAPER_POWER_ITERS,
                                       generator=generator)
            return float(value[0].detach())

        reference = search.options.reference_lipschitz
        evaluations = 0
        if reference is None:
            reference, evaluations = estimate(0.0), 1
        gamma_max = search.options.gamma_max
        gamma1 = radius_latent / reference if reference > 0 else gamma_max
        lip1 = estimate(gamma1)
        gamma_star = radius_latent / lip1 if lip1 > 0 else gamma_max
        lip_star = estimate(gamma_star)
        radius = gamma_star if lip_star == 0 else min(radius_latent / lip_star, gamma_star)
        return RadiusResult(radius, gamma_star, lip_star, self.kind, math.nan, evaluations + 2, evaluations + 2)


class PublishedCode(CertificationProtocol):
    """The published code's certification: unmasked power-iteration norms of the map from standardized inputs (an
    estimate). ``data_std``: the per-channel std the published code standardized inputs with, needed for a model
    without ``Standardize`` in ``f_L`` (e.g. ``PUBLISHED_DATA_STD["mnist"]``); a model with one uses its own.

    ``lipschitz_factor`` ``c`` (> 0, finite): the published code's normalisation constant, which its stored versions
    disagree on; the reported ``L`` is ``c · L̃`` and the radius ``R / (c · L̃)``. ``1.0`` (the default, the ICLR
    review's account: no constant); ``0.2023`` (:data:`PUBLISHED_CIFAR10_STD0`: the version that multiplies ``L`` by
    CIFAR-10's first std for every dataset); ``1 / 0.2023`` (the version that divides by it)."""

    name, certificate = "published-code", False
    kind = str(BoundKind.estimate(name))  # "published-code-estimate"

    def __init__(self, data_std: tuple[float, ...] | None = None, lipschitz_factor: float = 1.0):
        self.data_std = None if data_std is None else tuple(float(s) for s in data_std)
        factor = float(lipschitz_factor)
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"lipschitz_factor must be finite and > 0, got {lipschitz_factor!r}")
        self.lipschitz_factor = factor

    def check(self, model) -> None:
        self._check_std(model.left)

    def _check_std(self, left) -> None:
        if left.depth > 0 and left.standardize is None and self.data_std is None:
            raise ValueError("the published-code protocol reads a model without Standardize in f_L behind the "
                             "dataset standardization the published code applied: give its std, "
                             "PublishedCode(data_std=(0.3081,)) for MNIST; splitz certify knows it for mnist only")

    def _input_scale(self, left, x: torch.Tensor) -> torch.Tensor | None:
        """The first layer's input scale of the standardized-input map: none when ``f_L`` standardizes (its ``1/sd``
        is what the published code leaves out), else ``diag(data_std)``."""
        self._check_std(left)
        if left.standardize is not None:
            return None
        std = torch.tensor(self.data_std, dtype=torch.float64, device=x.device)
        view = std.view(-1, *([1] * (x.ndim - 1))) if x.ndim > 1 else std
        return view.expand_as(x).unsqueeze(0)

    def radius(self, search, x, radius_latent, generator):
        left = search.left
        if left.depth == 0:
            return _identity(radius_latent, self.kind)
        lip = 1.0
        # No masks (bounds=None), and the first layer seen from standardized inputs.
        for op in masked_operators(left, None, tuple(x.shape), 1, self._input_scale(left, x)):
            lip *= _power_iteration_norm(op, PAPER_POWER_ITERS, generator)
        lip *= self.lipschitz_factor
        radius = radius_latent / lip if lip > 0 else search.options.gamma_max
        return RadiusResult(radius, radius, lip, self.kind, math.nan, 1, 1)


def _power_iteration_norm(op, power_iters: int, generator: torch.Generator | None) -> float:
    """``‖A v‖ / ‖v‖`` after ``power_iters`` power steps on ``AᵀA`` from a Gaussian start: a lower estimate of ``‖A‖₂``."""
    v = torch.randn((1, *op.in_shape), dtype=op.dtype, device=op.weight.device, generator=generator)
    with torch.no_grad():
        for _ in range(power_iters):
            v = op.gram_matvec(v)
            v = v / v.norm().clamp_min(1e-300)
        return float(op.matvec(v).norm() / v.norm().clamp_min(1e-300))


PROTOCOLS: dict[str, CertificationProtocol] = {p.name: p for p in (SoundCertificate(), DisplacementCertificate(),
                                                                     PaperAlgorithm1(), PublishedCode())}


def get_protocol(protocol: str | CertificationProtocol) -> CertificationProtocol:
    """``protocol`` itself, or the protocol called so (a key of :data:`PROTOCOLS`)."""
    if isinstance(protocol, CertificationProtocol):
        return protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)} (or a CertificationProtocol), "
                         f"got {protocol!r}")
    return PROTOCOLS[protocol]


__all__ = ["CertificationProtocol", "SoundCertificate", "DisplacementCertificate", "PaperAlgorithm1", "PublishedCode", "PROTOCOLS",
           "PUBLISHED_DATA_STD", "get_protocol", "PAPER_POWER_ITERS"]
