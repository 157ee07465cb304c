"""The kind of bound behind a radius (splitz_fast.certify.kinds): every string a run file's ``bound`` column has ever
held reads back to itself, is labelled certificate or estimate as before, and nothing else reads as a kind."""
from __future__ import annotations

import pytest

from splitz_fast.certify.kinds import (DISPLACEMENT, ESTIMATE, EXACT, GLOBAL, IDENTITY_KIND, LOCAL, NO_BOUND,
                                       PROBABILISTIC, BoundKind, certificate_status, results_are)
from splitz_fast.certify.protocols import PROTOCOLS

CERTIFICATES = ["identity", "local-exact", "local-probabilistic", "global-exact", "global-probabilistic",
                "displacement-exact", "displacement-probabilistic"]
ESTIMATES = ["paper-estimate", "published-code-estimate"]


@pytest.mark.parametrize("text", [*CERTIFICATES, *ESTIMATES, "none"])
def test_every_kind_string_reads_back_to_itself(text):
    kind = BoundKind.parse(text)
    assert str(kind) == text and BoundKind.parse(kind) is kind
    assert BoundKind(kind.scope, kind.method) == kind


@pytest.mark.parametrize("text", CERTIFICATES)
def test_bounds_are_certificates(text):
    kind = BoundKind.parse(text)
    assert kind.is_certificate and not kind.is_estimate


@pytest.mark.parametrize("text", ESTIMATES)
def test_estimates_are_not_certificates(text):
    kind = BoundKind.parse(text)
    assert kind.is_estimate and not kind.is_certificate and kind.method == ESTIMATE


def test_no_bound_is_neither():
    assert BoundKind.parse("none") == NO_BOUND and not NO_BOUND.is_certificate and not NO_BOUND.is_estimate


def test_the_builders_write_todays_strings():
    assert str(BoundKind.of(LOCAL, EXACT)) == "local-exact"
    assert str(BoundKind.of(GLOBAL, PROBABILISTIC)) == "global-probabilistic"
    assert str(BoundKind.of(DISPLACEMENT, EXACT)) == "displacement-exact"
    assert BoundKind.of(LOCAL, "identity") == IDENTITY_KIND and str(IDENTITY_KIND) == "identity"
    assert str(BoundKind.estimate("paper")) == "paper-estimate"
    # The protocols' kinds, and whether each is a certificate, agree with the protocol itself.
    for protocol in PROTOCOLS.values():
        if hasattr(protocol, "kind"):
            assert BoundKind.parse(protocol.kind).is_certificate == protocol.certificate


@pytest.mark.parametrize("text", ["", "local", "exact", "local-estimate", "identity-exact", "none-none", "none-estimate",
                                  "-estimate", "global-exactly", "Local-exact", "0.5"])
def test_other_strings_are_no_kind(text):
    with pytest.raises(ValueError, match="not a bound kind"):
        BoundKind.parse(text)


@pytest.mark.parametrize("scope, method", [("identity", "probabilistic"), ("local", "estimate"), ("none", "exact")])
def test_impossible_pairs_are_refused(scope, method):
    with pytest.raises(ValueError, match="no bound kind"):
        BoundKind(scope, method)


def test_the_certificate_label_of_rows():
    assert certificate_status(["local-exact", "none", "identity"], "f") is True
    assert certificate_status(["paper-estimate", "none"], "f") is False
    assert certificate_status(["none", "none"], "f") is None and certificate_status([], "f") is None
    with pytest.raises(ValueError, match="f mixes certificates"):
        certificate_status(["local-exact", "paper-estimate"], "f")
    with pytest.raises(ValueError, match="f has a bound column entry that is no bound kind"):
        certificate_status(["local-exact", "lokal-exact"], "f")
    assert (results_are(True), results_are(False)) == ("certificates", "estimates (not certificates)")
