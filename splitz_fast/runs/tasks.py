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

    def earlier_settings(self, previous: dict[str, Any]) -> dict[str, Any]:
        """A sidecar found on resume, read as this version of the task records it (a task whose recorded settings
        changed names or placeholders maps them here, so its earlier runs stay resumable); unchanged by default."""
        return previous


def _precision_setting(smoother: Smoother) -> dict[str, Any]:
    """``{"precision": ...}`` where ``f_R`` samples in another precision than float32 (another base classifier); empty
    for float32, so files written before this entry still resume."""
    precision = getattr(smoother, "precision", "float32")
    return {} if precision == "float32" else {"precision": precision}


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
        settings = {"kind": self.kind, "n0": self.n0, "n": self.n, "alpha": self.alpha, "sigma": self.certifier.sigma}
        protocol = self.certifier.protocol
        if protocol.name != "sound":  # recorded only when set, so sound files written before still resume
            settings["protocol"] = protocol.name
        factor = getattr(protocol, "lipschitz_factor", 1.0)
        if factor != 1.0:  # published-code's normalisation constant; recorded only when set (older files resume)
            settings["lipschitz_factor"] = factor
        if not protocol.certificate:
            settings["certificate"] = False
        return {**settings, **_precision_setting(getattr(self.certifier, "smoother", self.certifier))}

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
                **_precision_setting(self.smoother)}

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

    #: How margin runs were recorded before the run tasks (up to a9ddd72): as CERTIFY runs with placeholder sampling
    #: settings. Their rows are those of today's margin runs.
    _EARLIER_PLACEHOLDERS = {"kind": "certify", "n0": 1, "n": 1, "alpha": 0.5, "sigma": None}

    def earlier_settings(self, previous):
        missing = object()
        if previous.get("certifier") == "margin" and all(
                previous.get(key, missing) == value for key, value in self._EARLIER_PLACEHOLDERS.items()):
            kept = {key: value for key, value in previous.items() if key not in self._EARLIER_PLACEHOLDERS}
            return {**kept, "kind": self.kind}
        return previous

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
                **_precision_setting(self.attacker.smoother)}

    def results(self, pairs, seeds):
        return self.attacker.attack_many(pairs, self.n, self.alpha, batch_size=self.batch_size, seeds=seeds)

    def row(self, idx, label, result):
        return result.row(idx)


#: The header of each task kind, by the ``kind`` its sidecars record (what merge_shards reads).
HEADERS = {task.kind: task.header for task in (CertifyRun, PredictRun, MarginRun, AttackRun)}


__all__ = ["PREDICT_HEADER", "HEADERS", "RunTask", "CertifyRun", "PredictRun", "MarginRun", "AttackRun"]
