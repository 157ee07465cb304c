"""What a result's ``bound`` column says: the kind of bound behind its radius, and whether that radius is a certificate.

Every CERTIFY row names what produced its ``L`` (:attr:`~splitz_fast.certify.outcomes.CertifyResult.bound_kind`, the
``bound`` column of a run's TSV). A kind is a *scope* (where the bound holds) and a *method* (how it was computed):

* ``identity``: ``s = 0``, ``f_L`` is the identity and ``L = 1`` exactly;
* ``local-exact``, ``local-probabilistic``: a bound of ``f_L`` on the ball ``B(x, γ)`` (Theorem 1's search);
* ``global-exact``, ``global-probabilistic``: one bound of ``f_L`` everywhere (``bound="global"``);
* ``displacement-exact``, ``displacement-probabilistic``: the latent-displacement bound of
  :mod:`splitz_fast.bounds.displacement` (the ``displacement`` protocol, where it won);
* ``PROTOCOL-estimate`` (``paper-estimate``, ``published-code-estimate``): an estimate protocol's radius (its scope
  is the protocol that made it), **not a certificate**;
* ``none``: no radius (an abstention, an undecided sequential row): neither certificate nor estimate.

:class:`BoundKind` is that pair, built, written (``str``) and read (:meth:`BoundKind.parse`) here, to and from exactly
the strings the TSVs have always held; :func:`certificate_status` is the one test every reader of results applies
(run files, resume, merge, analysis, envelopes, diagnostics). A leaf: it imports nothing of the package, so reading a
TSV needs neither the protocols nor the bounds behind them, and the sound side (:mod:`splitz_fast.bounds.radius`,
:mod:`splitz_fast.bounds.displacement`) builds its kinds here too.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

IDENTITY, LOCAL, GLOBAL, DISPLACEMENT = "identity", "local", "global", "displacement"
EXACT, PROBABILISTIC, ESTIMATE = "exact", "probabilistic", "estimate"
NONE = "none"
#: The scopes of a proven bound besides ``identity`` (whose method is always exact and is not written).
BOUNDED_SCOPES = (LOCAL, GLOBAL, DISPLACEMENT)

#: How a run of estimates is marked wherever it is shown (run names in tables, plots and envelopes).
NOT_A_CERTIFICATE = "not a certificate"
#: How estimates are named in a figure's title (diagnostics).
ESTIMATES = "estimates, not certificates"


@dataclass(frozen=True)
class BoundKind:
    """The kind of bound behind a radius (see the module docstring): ``scope`` × ``method``.

    ``scope``: ``identity``, ``local``, ``global``, ``displacement``, the estimate protocol's name (``paper``,
    ``published-code``), or ``none``; ``method``: ``exact``, ``probabilistic``, ``estimate``, or ``none`` (no bound).
    ``str(kind)`` is the ``bound`` column's text and :meth:`parse` reads it back."""

    scope: str
    method: str

    def __post_init__(self) -> None:
        valid = ((self.scope, self.method) in ((NONE, NONE), (IDENTITY, EXACT))
                 or (self.scope in BOUNDED_SCOPES and self.method in (EXACT, PROBABILISTIC))
                 or (self.method == ESTIMATE and bool(self.scope)
                     and self.scope not in (NONE, IDENTITY, *BOUNDED_SCOPES)))
        if not valid:
            raise ValueError(f"no bound kind has scope {self.scope!r} and method {self.method!r}")

    @classmethod
    def of(cls, scope: str, method: str) -> "BoundKind":
        """The kind of a ``scope`` bound (``local``, ``global``, ``displacement``) whose own kind is ``method``:
        ``"exact"``, ``"probabilistic"``, or ``"identity"`` (``s = 0`` left nothing to bound: then the kind is
        ``identity``, whatever the scope)."""
        return IDENTITY_KIND if method == IDENTITY else cls(scope, method)

    @classmethod
    def estimate(cls, protocol: str) -> "BoundKind":
        """The kind of the estimates of the protocol called ``protocol`` (``paper`` → ``paper-estimate``)."""
        return cls(protocol, ESTIMATE)

    @classmethod
    def parse(cls, text: "str | BoundKind") -> "BoundKind":
        """The kind a ``bound`` column's text names (a :class:`BoundKind` is returned as it is); ``ValueError`` for a
        text that names none."""
        if isinstance(text, BoundKind):
            return text
        text = str(text)
        if text in (NONE, IDENTITY):
            return NO_BOUND if text == NONE else IDENTITY_KIND
        scope, sep, method = text.rpartition("-")
        if sep and method != NONE and scope != IDENTITY:
            try:
                return cls(scope, method)
            except ValueError:
                pass
        raise ValueError(f"{text!r} is not a bound kind (identity; local-, global- or displacement-exact or "
                         "-probabilistic; PROTOCOL-estimate; none)")

    def __str__(self) -> str:
        return self.scope if self.scope in (NONE, IDENTITY) else f"{self.scope}-{self.method}"

    @property
    def is_certificate(self) -> bool:
        """Whether a radius of this kind is certified (a proven or probabilistic bound; ``identity`` included)."""
        return self.method in (EXACT, PROBABILISTIC)

    @property
    def is_estimate(self) -> bool:
        """Whether a radius of this kind is an estimate protocol's (not a certificate)."""
        return self.method == ESTIMATE


#: The kind of ``s = 0`` (``f_L`` the identity, ``L = 1``).
IDENTITY_KIND = BoundKind(IDENTITY, EXACT)
#: The ``bound`` of an abstention (and of an undecided sequential row): no radius, so neither certificate nor estimate.
NO_BOUND = BoundKind(NONE, NONE)


def results_are(certificate: bool) -> str:
    """What the rows of a run are, in messages: ``"certificates"`` or ``"estimates (not certificates)"``."""
    return "certificates" if certificate else "estimates (not certificates)"


def certificate_status(bound_kinds: Iterable[str], where: str) -> bool | None:
    """Whether rows with these ``bound`` kinds are certificates — the one test every reader of results applies (run
    files, resume, merge, analysis, envelopes, diagnostics). ``True``: every row with a radius is a certificate;
    ``False``: every one is an estimate (:attr:`BoundKind.is_estimate`); ``None``: no row has a radius (all abstained).

    Raises ``ValueError`` naming ``where`` when certificates and estimates are mixed: a radius next to an estimate
    would read as certified, so such a set of rows is never accepted; and for a text that names no bound kind."""
    certificate = estimate = None
    for text in map(str, bound_kinds):
        try:
            kind = BoundKind.parse(text)
        except ValueError as err:
            raise ValueError(f"{where} has a bound column entry that is no bound kind: {err}") from None
        if kind == NO_BOUND:
            continue
        if kind.is_estimate:
            estimate = estimate or text
        else:
            certificate = certificate or text
    if certificate and estimate:
        raise ValueError(f"{where} mixes certificates ({certificate}) with estimates ({estimate}, "
                         "not certificates); keep each protocol's rows in a file of their own")
    if certificate is None and estimate is None:
        return None
    return estimate is None


__all__ = ["BoundKind", "IDENTITY", "LOCAL", "GLOBAL", "DISPLACEMENT", "EXACT", "PROBABILISTIC", "ESTIMATE", "NONE",
           "BOUNDED_SCOPES", "IDENTITY_KIND", "NO_BOUND", "NOT_A_CERTIFICATE", "ESTIMATES", "results_are",
           "certificate_status"]
