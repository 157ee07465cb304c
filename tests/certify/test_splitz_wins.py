"""The constructed example of scripts/splitz_wins_example.py: on a class-0 point of the box task,
sound SPLITZ certifies about ``t − ‖x‖_∞`` (its detectors stay inactive on the ball, so L = 0), more than randomized
smoothing of the same network at any σ of the grid — the mechanism by which SPLITZ can beat RS, end to end."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import splitz_fast as sz

_spec = importlib.util.spec_from_file_location(
    "splitz_wins_example", Path(__file__).resolve().parents[2] / "scripts" / "splitz_wins_example.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_inactive_detectors_give_splitz_a_larger_radius_than_rs_at_any_sigma():
    d = 16
    x, y = example.box_data(d, per_class=2)
    splitz_model, rs_model = example.models(d)
    inside = x[0]
    splitz = sz.Smoother(splitz_model, example.SIGMA_LATENT, bound_options=sz.BoundOptions(bound_method="exact")
                         ).certify(inside, 100, 2000, 0.001, seed=0)
    assert splitz.prediction == 0 and splitz.lipschitz == 0.0  # every detector constant on the certified ball
    reach = example.THRESHOLD_T - float(inside.abs().max())
    resolution = 10.0 / 2 ** 8  # the bisection's bracket [0, gamma_max = 10] after gamma_steps = 8 halvings
    assert reach - resolution <= splitz.radius <= reach
    rs = [sz.Smoother(rs_model, s).certify(inside, 100, 2000, 0.001, seed=0) for s in example.RS_SIGMAS]
    assert all(r.prediction in (0, -1) for r in rs)
    assert splitz.radius > 1.2 * max(r.radius for r in rs)
