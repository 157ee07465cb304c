"""The kind of bound behind a radius (splitz_fast.kinds): every string a run file's ``bound`` column has ever
held reads back to itself, is labelled certificate or estimate as before, and nothing else reads as a kind."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from splitz_fast.bounds.radius import BoundOptions, RadiusSearch
from splitz_fast.certify.protocols import PROTOCOLS
from splitz_fast.kinds import (DISPLACEMENT, ESTIMATE, EXACT, GLOBAL, IDENTITY_KIND, LOCAL, NO_BOUND,
                               PROBABILISTIC, BoundKind, certificate_status, results_are)
from splitz_fast.model.modules import ClippedReLU, split_sequential

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


def test_reading_kinds_imports_no_bound_code():
    """Deciding whether rows are certificates needs only this leaf: not torch, not the bounds or protocols (the
    package's face imports its names on first use)."""
    code = ("import sys, splitz_fast.kinds; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('splitz_fast')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['splitz_fast', 'splitz_fast._moved', 'splitz_fast.kinds']"


def test_the_radius_search_writes_its_kinds_through_boundkind(monkeypatch):
    """The sound side builds its kinds with BoundKind: a kind it could not parse back would be refused there."""
    import splitz_fast.bounds.radius as radius

    built = []
    real = radius.BoundKind.of

    def recording(scope, method):
        built.append((scope, method))
        return real(scope, method)

    monkeypatch.setattr(radius.BoundKind, "of", staticmethod(recording))
    torch.manual_seed(0)
    model = split_sequential(nn.Sequential(nn.Flatten(), nn.Linear(4, 6), ClippedReLU(1.0), nn.Linear(6, 3)), 1,
                             num_classes=3, input_shape=(4,))
    result = RadiusSearch(model, BoundOptions()).search(torch.rand(4), 0.5, torch.Generator().manual_seed(0))
    assert built and all(scope == LOCAL for scope, _ in built)
    assert BoundKind.parse(result.kind).scope == LOCAL and result.kind == str(BoundKind.parse(result.kind))
