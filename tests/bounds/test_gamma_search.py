"""Batched γ passes and skipped covered γ's never lose radius against the bisection."""
from __future__ import annotations

import pytest
import torch

import splitz_fast as sz
from splitz_fast import Smoother
from splitz_fast.bounds.radius import BoundOptions, bisection_reference


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- γ search
@pytest.mark.parametrize("name", [pytest.param("lenet", marks=pytest.mark.slow), "lenet-splitz"])  # ~9 s each, 2 cores
def test_batched_gamma_passes_never_lose_radius_against_bisection(name):
    """gamma_batch = 4 (8) evaluates a superset of the bisection's points (in half (a third of) the passes): never a
    smaller radius with exact bounds, and every reported radius is min(R/L(x, γ), γ) at its γ."""
    torch.manual_seed(0)
    model = sz.build_model(name, split_index=1).eval()
    xs = torch.rand(2, 1, 28, 28, generator=_gen(len(name)))
    for i, x in enumerate(xs):
        for radius_latent in (0.2, 0.8):
            two, four, eight = (
                Smoother(model, 0.5, bound_options=BoundOptions(gamma_batch=batch, bound_method="exact"))
                .radius_search.search(x, radius_latent, None) for batch in (2, 4, 8))
            assert four.radius >= two.radius - 1e-15 and eight.radius >= two.radius - 1e-15, (i, radius_latent)
            assert eight.passes <= 4
            # At most the bisection's passes and points (points covered by a larger bounded ball are not re-bounded).
            assert two.passes <= 9 and four.passes <= 5
            assert two.evaluations <= 10 and four.evaluations <= 14
            lip = float(sz.lipschitz_bound(model.left, x.unsqueeze(0), four.gamma, method="exact").value[0])
            assert four.lipschitz >= lip * (1 - 1e-12)  # L(x, γ) itself or a larger ball's: a bound at γ either way
            assert four.radius == pytest.approx(min(radius_latent / four.lipschitz, four.gamma), rel=1e-12)


@pytest.mark.parametrize("radius_latent", [0.2, 0.8, 1.5])
def test_skipping_covered_gammas_keeps_the_bisection_radius(radius_latent):
    """The search does not re-bound a γ that a larger bounded ball already certifies: same radius as a bisection that
    bounds every point, with fewer bound evaluations."""
    torch.manual_seed(0)
    model = sz.build_model("lenet-splitz", split_index=1).eval()
    x = torch.rand(1, 28, 28, generator=_gen(3))
    options = BoundOptions(bound_method="exact")
    found = Smoother(model, 0.5, bound_options=options).radius_search.search(x, radius_latent, None)
    reference = bisection_reference(model.left, x, radius_latent, options)
    assert found.radius == pytest.approx(reference, rel=1e-9)
    assert found.evaluations <= 10
