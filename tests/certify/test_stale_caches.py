"""No cached bound or prepared copy survives a change of the model."""
from __future__ import annotations

import copy

import pytest
import torch

import splitz_fast as sz
from splitz_fast import Smoother
from splitz_fast.bounds.radius import BoundOptions
from _helpers import small_splitz as _small_splitz


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- stale caches
def _edits():
    """Ways users change f_L's first layer without bumping what a version counter sees, or at all in place."""

    def data_write(left):
        left.layers[0].weight.data *= 3.0

    def copy_under_no_grad(left):
        with torch.no_grad():
            left.layers[0].weight.copy_(left.layers[0].weight * 3.0)

    def load_state_dict(left):
        state = copy.deepcopy(left.state_dict())
        state["layers.0.weight"] = state["layers.0.weight"] * 3.0
        left.load_state_dict(state)

    def swap_module(left):
        old = left.layers[0]
        new = copy.deepcopy(old)
        with torch.no_grad():
            new.weight.mul_(3.0)
        left.layers[0] = new

    return [data_write, copy_under_no_grad, load_state_dict, swap_module]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_global_bound_follows_every_change_of_f_l(edit):
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.4, bound_options=BoundOptions(bound="global"))
    before = smoother.certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    edit(model.left)
    after = smoother.certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    fresh = Smoother(model, 0.4, bound_options=smoother.options).certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    # 3x the weights, 3x the norm (up to the certificate's own slack: the Cholesky shift sits ~1e-8 above λ_max) ...
    assert after.lipschitz == pytest.approx(3.0 * before.lipschitz, rel=1e-6)
    # ... and exactly what a fresh smoother computes: nothing of the old weights survives.
    assert (after.lipschitz, after.radius) == (fresh.lipschitz, fresh.radius)


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_margin_certifier_follows_every_change_of_f_l(edit):
    model = sz.tabular_mlp(4, hidden=(6,), split_index=2)
    x = torch.randn(4, generator=_gen(9))
    certifier = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound="global"))
    certifier.certify(x, seed=0)
    edit(model.left)
    after = certifier.certify(x, seed=0)
    fresh = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound="global")).certify(x, seed=0)
    assert (after.prediction, after.latent_radius, after.lipschitz, after.radius) == \
           (fresh.prediction, fresh.latent_radius, fresh.lipschitz, fresh.radius)
