"""The kinds of run over a dataset (:class:`RunTask`): CERTIFY, PREDICT, margin certificates and attacks, each with the
TSV header and rows it writes and the settings its sidecar records (the loop that runs them:
:func:`~splitz_fast.runs.loop.run_over_dataset`; the certification rows: :mod:`splitz_fast.runs.rows`)."""
from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._checks import check_certify_counts
from ..certify.attacks import ATTACK_HEADER, Attacker
from ..certify.margin import MarginCertifier
from ..certify.sequential import SequentialCertifier
from ..certify.smoothing import PredictResult, Smoother
from ..model.modules import SplitModel
from ..sampling.folding import unfolded_batchnorms
from .rows import HEADER as CERTIFY_HEADER
from .rows import format_row

PREDICT_HEADER = "\t".join(("idx", "label", "predict", "correct", "time", "count_top", "count_second", "p_value"))


class RunTask(abc.ABC):
    """One kind of run over a dataset: its TSV header, the settings its sidecar records, how it computes results for
    labelled inputs and their seeds, and how a result becomes a row. :func:`~splitz_fast.runs.loop.run_over_dataset`
    (resume, sharding, progress, interruption) and :func:`~splitz_fast.runs.shards.merge_shards` know nothing else
    about it. Constructing a task validates its arguments (once)."""

    kind: str  # recorded in the sidecar; names the header when shards are merged (HEADERS)
    header: str
    #: Whether the task's radii are certificates; False for an estimate protocol's (``certificate: false`` in the
    #: sidecar). A file never mixes the two: resume and merge refuse it
    #: (:func:`~splitz_fast.kinds.certificate_status`).
    certificate: bool = True

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """What determines the rows besides the model, the data, the indices and the seed (the sidecar's entries)."""

    @abc.abstractmethod
    def results(self, pairs: Iterable[tuple[torch.Tensor, int]], seeds: list[int]) -> Iterator[Any]:
        """One result per ``(input, label)`` pair, in order, input ``i`` drawing its noise from ``seeds[i]``."""

    @abc.abstractmethod
    def row(self, idx: int, label: int, result: Any) -> str:
        """The TSV line of one result (no newline)."""

    #: Whether the rows depend on noise drawn from the inputs' seeds (:class:`~splitz_fast.sampling.engine.NoiseStream`).
    draws_noise = True

    @property
    def model(self) -> SplitModel | None:
        """The model the task runs: its ``num_classes`` bounds the labels a dataset may give (``None``: labels
        unchecked)."""
        return None


def _sampling_settings(smoother: Smoother) -> dict[str, Any]:
    """How ``f_R`` is sampled: in which precision (another than float32 is another base classifier) and whether
    with a BatchNorm left unfolded (``bn_folded``: false; the scores round differently)."""
    return {"precision": getattr(smoother, "precision", "float32"),
            "bn_folded": not unfolded_batchnorms(smoother.model.right)}


def _inputs(pairs: Iterable[tuple[torch.Tensor, int]]) -> Iterator[torch.Tensor]:
    return (x for x, _ in pairs)


class CertifyRun(RunTask):
    """Cohen's CERTIFY with the SPLITZ radius (``splitz certify``): a :class:`~splitz_fast.certify.smoothing.Smoother` or a
    :class:`~splitz_fast.certify.sequential.SequentialCertifier` (``n`` is then its budget)."""

    kind, header = "certify", CERTIFY_HEADER

    def __init__(self, certifier: Smoother | SequentialCertifier, n0: int, n: int, alpha: float,
                 batch_size: int | None = None):
        n0, n, alpha, batch_size = check_certify_counts(n0, n, alpha, batch_size)
        self.certifier, self.n0, self.n, self.alpha, self.batch_size = certifier, n0, n, alpha, batch_size
        self.certificate = certifier.protocol.certificate

    @property
    def model(self) -> SplitModel:
        return self.certifier.model

    def settings(self) -> dict[str, Any]:
        protocol = self.certifier.protocol
        smoother = getattr(self.certifier, "smoother", self.certifier)
        settings = {"kind": self.kind, "n0": self.n0, "n": self.n, "alpha": self.alpha, "sigma": self.certifier.sigma,
                    "protocol": protocol.name, "certificate": protocol.certificate,
                    # published-code's normalisation constant (1 for every other protocol)
                    "lipschitz_factor": getattr(protocol, "lipschitz_factor", 1.0),
                    # which γ a bisection evaluates, and so the radii
                    "gamma_batch": smoother.options.gamma_batch,
                    "sequential": isinstance(self.certifier, SequentialCertifier),
                    **_sampling_settings(smoother)}
        if settings["sequential"]:  # n is the sample budget of each input
            settings.update(radii=list(self.certifier.radii), budget=self.n)
        return settings

    def results(self, pairs, seeds):
        return self.certifier.certify_many(_inputs(pairs), self.n0, self.n, self.alpha, batch_size=self.batch_size,
                                           seeds=seeds)

    def row(self, idx, label, result):
        return format_row(idx, label, result)


class PredictRun(RunTask):
    """Cohen's PREDICT (``splitz predict``)."""

    kind, header = "predict", PREDICT_HEADER

    def __init__(self, smoother: Smoother, n: int, alpha: float, batch_size: int | None = None):
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        self.smoother, self.n, self.alpha, self.batch_size = smoother, n, alpha, batch_size

    @property
    def model(self) -> SplitModel:
        return self.smoother.model

    def settings(self) -> dict[str, Any]:
        # n0 = 0: PREDICT draws no selection samples (recorded so that sidecars written before stay resumable).
        return {"kind": self.kind, "n0": 0, "n": self.n, "alpha": self.alpha, "sigma": self.smoother.sigma,
                **_sampling_settings(self.smoother)}

    def results(self, pairs, seeds):
        return self.smoother.predict_many(_inputs(pairs), self.n, self.alpha, batch_size=self.batch_size,
                                          seeds=seeds)

    def row(self, idx, label, result: PredictResult):
        return "\t".join([str(idx), str(label), str(result.prediction), str(int(result.prediction == label)),
                          f"{result.seconds:.4f}", str(result.count_top), str(result.count_second),
                          f"{result.p_value:.6g}"])


class MarginRun(RunTask):
    """Deterministic logit-margin certificates (``splitz certify-margin``): nothing is sampled, so there are no
    sampling settings; the rows are CERTIFY's."""

    kind, header = "certify-margin", CERTIFY_HEADER
    draws_noise = False

    def __init__(self, certifier: MarginCertifier):
        self.certifier = certifier

    @property
    def model(self) -> SplitModel:
        return self.certifier.model

    def settings(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def results(self, pairs, seeds):
        return self.certifier.certify_many(_inputs(pairs), seeds=seeds)

    def row(self, idx, label, result):
        return format_row(idx, label, result)


class AttackRun(RunTask):
    """l2 attacks with PREDICT at the clean and the attacked point (``splitz attack``)."""

    kind, header = "attack", ATTACK_HEADER

    def __init__(self, attacker: Attacker, n: int, alpha: float, batch_size: int | None = None):
        _, n, alpha, batch_size = check_certify_counts(None, n, alpha, batch_size)
        self.attacker, self.n, self.alpha, self.batch_size = attacker, n, alpha, batch_size

    @property
    def model(self) -> SplitModel:
        return self.attacker.model

    def settings(self) -> dict[str, Any]:
        # n0 = 0 as for PREDICT (sidecars written before stay resumable); the attack's own settings come from the caller.
        return {"kind": self.kind, "n0": 0, "n": self.n, "alpha": self.alpha, "sigma": self.attacker.sigma,
                "precision": getattr(self.attacker.smoother, "precision", "float32")}

    def results(self, pairs, seeds):
        return self.attacker.attack_many(pairs, self.n, self.alpha, batch_size=self.batch_size, seeds=seeds)

    def row(self, idx, label, result):
        return result.row(idx)


#: The header of each task kind, by the ``kind`` its sidecars record (what merge_shards reads).
HEADERS = {task.kind: task.header for task in (CertifyRun, PredictRun, MarginRun, AttackRun)}


__all__ = ["PREDICT_HEADER", "HEADERS", "RunTask", "CertifyRun", "PredictRun", "MarginRun", "AttackRun"]
