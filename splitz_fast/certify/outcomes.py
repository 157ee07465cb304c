"""What CERTIFY and PREDICT return for one input (:class:`CertifyResult`, :class:`PredictResult`), shared by every
certifier (:class:`~splitz_fast.certify.smoothing.Smoother`, :class:`~splitz_fast.certify.sequential.SequentialCertifier`,
:class:`~splitz_fast.certify.margin.MarginCertifier`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch

from ..kinds import BoundKind
from .stats import two_sided_binomial_pvalue

ABSTAIN = -1


@dataclass
class CertifyResult:
    """Outcome of CERTIFY for one input.

    ``radius`` is in raw input units (``ABSTAIN`` prediction → radius 0). ``failure_prob`` is the total probability
    that the certificate is wrong: α plus the failure probability of every probabilistic Lipschitz bound evaluated.
    ``bound_kind`` says what produced ``lipschitz``: ``identity`` (s = 0), ``local-exact``, ``local-probabilistic``,
    ``global-exact`` or ``global-probabilistic``; ``none`` for an abstention (no radius searched: ``lipschitz`` and
    ``gamma`` are NaN); the estimate protocols' kinds end in ``-estimate`` (all of them:
    :class:`~splitz_fast.kinds.BoundKind`). ``noise_source`` says which stream drew the noise (``philox4x32-10``:
    the Philox stream of kernels/noise.py, the same on every device and backend; or ``torch-<device>``: the
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
        ``published-code-estimate``): their radii are not certified (:mod:`splitz_fast.certify.protocols`; the kinds:
        :class:`~splitz_fast.kinds.BoundKind`)."""
        return not BoundKind.parse(self.bound_kind).is_estimate


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


def predict_result(counts: torch.Tensor, alpha: float, seed: int, seconds: float, rounding: float) -> PredictResult:
    top = int(counts.argmax())  # ties go to the lowest class index
    ordered = counts.sort(descending=True).values
    n1 = int(ordered[0])
    n2 = int(ordered[1]) if counts.numel() > 1 else 0
    p_value = two_sided_binomial_pvalue(n1, n2)
    return PredictResult(top if p_value <= alpha else ABSTAIN, n1, n2, p_value, seed, seconds, rounding)


__all__ = ["ABSTAIN", "CertifyResult", "PredictResult", "about_given_input", "predict_result"]
