"""Bound options say what is wrong; a window's batched searches and certificates equal each input's own."""
from __future__ import annotations

import functools

import pytest
import torch

import splitz_fast as sz
from splitz_fast import Smoother
from splitz_fast.bounds.radius import BoundOptions
from _helpers import small_splitz as _small_splitz


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_bound_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="gamma_batch"):
        BoundOptions(gamma_batch=1)
    for batch in (3, 6, 12):  # only powers of two evaluate a superset of the bisection's points
        with pytest.raises(ValueError, match=rf"gamma_batch must be a power of two \(2, 4, 8, ...\), got {batch}"):
            BoundOptions(gamma_batch=batch)
    assert BoundOptions(gamma_batch=8).passes == 3
    with pytest.raises(ValueError, match="gamma_search"):
        BoundOptions(gamma_search="grid")
    with pytest.raises(TypeError, match="gamma_stpes"):
        BoundOptions(gamma_stpes=3)
    with pytest.raises(TypeError, match="'method'"):  # one name per setting: the CLI's --bound-method
        BoundOptions(method="exact")
    # The certifiers take the options as one object, and nothing else in its place.
    model = sz.tabular_mlp(4, hidden=(8,), split_index=2)  # the whole classifier in f_L: both certifiers take it
    for build in (functools.partial(Smoother, model, 0.5), functools.partial(sz.MarginCertifier, model)):
        with pytest.raises(TypeError, match="bound_options must be a splitz_fast.BoundOptions or None, got dict"):
            build(bound_options={"bound_method": "exact"})
        assert build(bound_options=None).options == BoundOptions()
    assert BoundOptions(gamma_steps=8, gamma_batch=2).max_evaluations == 10  # L(x, 0), the ceiling, 8 midpoints
    assert BoundOptions(gamma_steps=8, gamma_batch=4).passes == 4
    assert BoundOptions(gamma_search="one-step").max_evaluations == 3


@pytest.mark.parametrize("method,search", [("exact", "bisection"), ("exact", "one-step"),
                                           ("probabilistic", "bisection")])
def test_batched_searches_of_a_window_equal_each_inputs_own_search(method, search):
    """RadiusSearch.search_many advances several inputs' searches in lockstep with one ball-bound pass per round; every
    result (radius, γ, L, kind, failure, evaluations) equals the input's own search, random starts included."""
    torch.manual_seed(0)
    model = sz.build_model("lenet-splitz", split_index=1).eval()
    xs = list(torch.rand(3, 1, 28, 28, generator=_gen(5)))
    radii = [0.3, 0.8, 1.4]
    smoother = Smoother(model, 0.5, bound_options=BoundOptions(bound_method=method, gamma_search=search, power_iters=8))

    def generators():
        return [torch.Generator().manual_seed(100 + i) for i in range(len(xs))]

    together = smoother.radius_search.search_many(xs, radii, generators())
    alone = [smoother.radius_search.search(x, r, g) for x, r, g in zip(xs, radii, generators())]
    assert together == alone


def test_batched_certificates_of_a_window_match_each_inputs_own_search(monkeypatch):
    """Where the shift is placed by squaring (CUDA's default, forced here on CPU tensors), the exact factors of all the
    inputs of a round are certified in one batch (several Grams per batched step): every result matches the input's
    own search up to the last bits of its bound, and the radius is min(R/L, γ) with L the host solver's certificate at
    that γ (to the shift's slack)."""
    import splitz_fast.bounds.certificate as certificate

    monkeypatch.setattr(certificate, "_takes_squaring", lambda gram, estimator: gram.layout != torch.sparse_csr)
    batch_sizes = []
    squared = certificate._squared_certificates
    monkeypatch.setattr(certificate, "_squared_certificates",
                        lambda grams, terms: batch_sizes.append(len(grams)) or squared(grams, terms))
    model, xs = _small_splitz()
    xs, radii = list(xs[:4]), [0.2, 0.5, 0.9, 1.6]
    search = Smoother(model, 0.5, bound_options=BoundOptions(bound_method="exact")).radius_search
    together = search.search_many(xs, radii, [None] * len(xs))
    assert batch_sizes and max(batch_sizes) >= 2
    alone = [search.search(x, r, None) for x, r in zip(xs, radii)]
    for t, a, x, r in zip(together, alone, xs, radii):
        # (γ itself may be another point of the same radius: where R/L(γ) < γ, last-bit ties pick among them)
        assert (t.evaluations, t.kind) == (a.evaluations, a.kind) and t.radius == pytest.approx(a.radius, rel=1e-12)
        monkeypatch.undo()  # the host solver's certificate at the same γ: both are proven bounds
        host = float(sz.lipschitz_bound(model.left, x.unsqueeze(0), t.gamma, method="exact").value[0])
        assert t.lipschitz == pytest.approx(host, rel=1e-8) and t.radius == pytest.approx(min(r / t.lipschitz, t.gamma))
        monkeypatch.setattr(certificate, "_takes_squaring", lambda gram, estimator: gram.layout != torch.sparse_csr)
