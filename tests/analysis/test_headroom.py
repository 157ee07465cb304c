"""The headroom diagnostic (splitz_fast.analysis.headroom) against f_Ls whose cells and Jacobians are known by hand,
a Monte Carlo check of the exit bound, and `splitz diagnose --headroom` end to end."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import norm

import splitz_fast as sz
from splitz_fast.analysis.headroom import face_distances, headroom, headroom_report
from splitz_fast.certify.stats import clopper_pearson_lower
from splitz_fast.cli.main import main

from _helpers import TINY_TRAIN_OPTIONS as TRAIN, one_line_error as _one_line_error


def _linear_left(weight, bias, theta, standardize=None):
    weight = torch.as_tensor(weight, dtype=torch.float32)
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
    return sz.LeftHalf([layer], [sz.ClippedReLU(theta)], standardize=standardize, input_shape=(weight.shape[1],))


def test_one_neuron_at_a_known_distance_gives_exactly_phi_of_minus_d_over_s():
    # w = (0, 2, 0), b = −1, x = (0, 0, 0): z = −1 (inactive), its only face z = 0 at distance 1/‖w‖ = 0.5; L̄ = 2.
    left = _linear_left([[0.0, 2.0, 0.0]], [-1.0], theta=1.0)
    x = torch.zeros(1, 3)
    result = headroom(left, x, sigma=0.5, p_lower=np.array([0.99]), correct=np.array([True]), radii=(0.4, 0.6))
    assert result.global_lipschitz == pytest.approx(2.0, rel=1e-9)
    assert result.exit_bound[0] == pytest.approx(norm.cdf(-0.5 * 2.0 / 0.5), rel=1e-9)
    assert result.faces_within.tolist() == [[0, 1]]
    assert result.local_lipschitz[0] == 0.0  # inactive at x: a constant cell
    assert result.rs_radius[0] == pytest.approx(0.25 * norm.ppf(0.99 - norm.cdf(-2.0)), rel=1e-9)


def test_an_active_neuron_has_both_faces_and_standardization_and_borders_fold_into_the_distance():
    # Active neuron: faces at 0 and θ; standardization 1/sd = 2 doubles the row, so distances halve.
    std = sz.Standardize([0.0, 0.0], [0.5, 0.5])
    left = _linear_left([[1.0, 0.0]], [0.0], theta=1.0, standardize=std)
    x = torch.tensor([[0.1, 0.7]])  # z = 0.2: 0.2 from 0 and 0.8 from θ in z; row norm 2
    dist = face_distances(left, x)
    assert sorted(dist[0].tolist()) == pytest.approx([0.1, 0.4], rel=1e-6)  # x in float32
    # A 3×3 convolution with zero padding: the exact distance uses the in-image taps' norm (the Jacobian row).
    torch.manual_seed(3)
    conv = sz.LeftHalf([nn.Conv2d(2, 3, 3, padding=1)], [sz.ClippedReLU(0.4)],
                       standardize=sz.Standardize([0.1, 0.2], [0.3, 0.6]), input_shape=(2, 5, 4))
    x = torch.rand(2, 2, 5, 4, generator=torch.Generator().manual_seed(4))
    dist = face_distances(conv, x)
    for b in range(2):
        pre = lambda v: conv.layers[0](conv.standardize(v.view(1, 2, 5, 4))).flatten()  # noqa: E731
        z = pre(x[b].flatten()).double().detach()
        rows = torch.autograd.functional.jacobian(pre, x[b].flatten()).double().norm(dim=1)
        theta = 0.4
        expected_zero = torch.where(z < theta, z.abs() / rows, torch.inf)
        expected_theta = torch.where(z > 0, (z - theta).abs() / rows, torch.inf)
        torch.testing.assert_close(dist[b], torch.cat([expected_zero, expected_theta]), rtol=1e-5, atol=1e-7)


def test_a_constant_cell_has_an_infinite_jacobian_ratio_and_splitz_can_beat_rs():
    # The box detectors of docs/results/splitz-wins: every detector inactive at the centre, L(x, 0⁺) = 0.
    d = 4
    left = _linear_left(torch.cat([torch.eye(d), -torch.eye(d)]), torch.full((2 * d,), -1.4), theta=0.2)
    x = torch.zeros(1, d)
    result = headroom(left, x, sigma=0.02, p_lower=np.array([0.999]), correct=np.array([True]), radii=(0.5, 1.0))
    assert np.isinf(result.jacobian_ratio[0]) and np.isinf(result.splitz_radius_max[0])
    assert result.exit_bound[0] < 1e-300  # 8 faces at 1.4 with s = 0.02
    assert result.global_lipschitz == pytest.approx(2 ** 0.5, rel=1e-9)  # ‖[I; −I]‖ = √2: RS on F at s = σ/√2
    assert result.rs_radius[0] == pytest.approx(0.02 / 2 ** 0.5 * norm.ppf(0.999), rel=1e-9)
    assert result.can_beat().tolist() == [[True, True]]
    assert "constant cells (∞): 1" in headroom_report(result, "box")


def test_an_identity_f_l_has_no_faces_and_splitz_never_beats_rs():
    left = sz.LeftHalf([], [], input_shape=(3,))
    p = np.array([0.6, 0.9, 0.999, 0.4])
    result = headroom(left, torch.zeros(4, 3), sigma=0.5, p_lower=p, correct=np.ones(4, dtype=bool),
                      radii=(0.0, 0.1, 1.0))
    assert result.exit_bound.tolist() == [0.0] * 4 and result.faces_within.sum() == 0
    np.testing.assert_allclose(result.splitz_radius_max, result.rs_radius)
    np.testing.assert_allclose(result.rs_radius, np.where(p > 0.5, 0.5 * norm.ppf(p), 0.0))
    assert not result.can_beat().any()


def _pattern(left: sz.LeftHalf, x: torch.Tensor) -> torch.Tensor:
    """The activation state of every neuron (0 inactive, 1 active, 2 saturated), ``[N, neurons]``."""
    h, states = x.double(), []
    for k, layer in enumerate(left.layers):
        z = nn.functional.linear(h, layer.weight.double(), layer.bias.double())
        theta = left.activation(k).broadcast_threshold(z).detach()
        states.append((z > 0).long() + (z >= theta).long())
        h = torch.minimum(z.clamp_min(0), theta)
    return torch.cat(states, 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_exit_bound_is_at_least_the_monte_carlo_exit_probability(depth):
    """The bound may fail this test only if it is below the true exit probability, or with probability ≤ 1e-6 per
    input (the one-sided Clopper–Pearson bound at α = 1e-6 on the empirical exits). For one layer with a single
    neuron near its face the union bound is exact, so the bound must also sit below the upper confidence bound."""
    torch.manual_seed(depth)
    layers = [nn.Linear(5, 6)] + [nn.Linear(6, 4)] * (depth - 1)
    left = sz.LeftHalf(layers, [sz.ClippedReLU(0.8) for _ in layers], input_shape=(5,))
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + depth))
    sigma, n = 0.6, 40_000
    result = headroom(left, x, sigma, p_lower=np.full(6, 0.9), correct=np.ones(6, dtype=bool))
    s = result.input_sigma
    gen = torch.Generator().manual_seed(20 + depth)
    for b in range(6):
        noisy = x[b].double() + s * torch.randn(n, 5, generator=gen, dtype=torch.float64)
        exits = int((_pattern(left, noisy) != _pattern(left, x[b:b + 1])).any(1).sum())
        assert result.exit_bound[b] >= clopper_pearson_lower(exits, n, 1e-6), (b, exits)
    one = _linear_left([[1.0, -1.0]], [0.3], theta=5.0)
    x1 = torch.zeros(1, 2)
    single = headroom(one, x1, 0.5, p_lower=np.array([0.9]), correct=np.array([True]))
    noisy = single.input_sigma * torch.randn(n, 2, generator=gen, dtype=torch.float64)
    exits = int((_pattern(one, noisy) != _pattern(one, x1)).any(1).sum())
    upper = 1 - clopper_pearson_lower(n - exits, n, 1e-6)
    assert clopper_pearson_lower(exits, n, 1e-6) <= single.exit_bound[0] <= upper


def test_twenty_inputs_of_a_one_layer_lenet_take_seconds():
    model = sz.build_model("lenet", split_index=1)
    x = torch.rand(20, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    result = headroom(model.left, x, 0.75, p_lower=np.full(20, 0.99), correct=np.ones(20, dtype=bool))
    assert time.perf_counter() - start < 30
    assert np.all(result.splitz_radius_max > 0) and np.all(result.local_lipschitz <= result.global_lipschitz * 1.001)


def test_diagnose_headroom_end_to_end_and_its_one_line_errors(tmp_path, tiny, capsys):
    assert main(["train", "tiny", "mlp", str(tmp_path / "run"), *TRAIN]) == 0
    ckpt, tsv = tmp_path / "run" / "best.pt", tmp_path / "cert.tsv"
    assert main(["certify", "tiny", str(ckpt), "0.5", str(tsv), "--skip", "4", "--N0", "10", "--N", "200"]) == 0
    capsys.readouterr()
    out = tmp_path / "headroom"
    assert main(["diagnose", str(ckpt), str(tsv), "--headroom", "--radii", "0.1", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SPLITZ can beat RS (%)" in printed and (out / "headroom.md").read_text() in printed
    rows = (out / "headroom.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:3] == ["idx", "correct", "pA_lower"] and len(rows) == 1 + 10
    assert main(["diagnose", str(ckpt), str(tsv), "--radii", "0.5"]) == 2
    assert "--radii is read only with --headroom" in _one_line_error(capsys)
    assert main(["diagnose", str(ckpt), str(tsv), "--headroom", "--radii", "-1"]) == 2
    assert "--radii must be finite and >= 0, got -1" in _one_line_error(capsys)
