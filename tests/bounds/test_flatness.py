"""The spectral-flatness training term, log(L̂² n / ‖A‖_F²) of the one-layer f_L's masked operator —
checked against a dense SVD of the Jacobian, in the loss with its weight, refused where it is not defined, and
recorded by a resumable training run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.bounds.estimate import lipschitz_estimate
from splitz_fast.bounds.intervals import ball_bounds
from splitz_fast.zoo.models import tabular_mlp
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loss import flatness_penalty, splitz_loss
from splitz_fast.training.loop import train


def _conv_left(seed: int) -> sz.LeftHalf:
    torch.manual_seed(seed)
    return sz.LeftHalf([nn.Conv2d(2, 3, 3, stride=2, padding=1)], [sz.ClippedReLU(0.7)],
                       standardize=sz.Standardize([0.1, 0.2], [0.5, 2.0]), input_shape=(2, 6, 5)).double()


def _linear_left(seed: int) -> sz.LeftHalf:
    torch.manual_seed(seed)
    return tabular_mlp(7, num_classes=2, hidden=(9,), split_index=1).double().left


@pytest.mark.parametrize("make_left", [_conv_left, _linear_left], ids=["conv", "linear"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flatness_penalty_is_the_log_spread_of_the_jacobians_singular_values(make_left, seed):
    """At γ = 0 the varying mask is the clipped ReLU's derivative at x, so A is f_L's Jacobian there (standardization
    included): the term with the exact largest singular value must be log(s_1² n / Σ s_j²) of a dense SVD."""
    left = make_left(seed)
    shape = left.input_shape
    x = torch.rand(4, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    bounds = ball_bounds(left, x, 0.0)
    expected, largest = [], []
    for b in range(x.shape[0]):
        jac = torch.autograd.functional.jacobian(lambda v: left(v.view(1, *shape)).flatten(), x[b].flatten())
        s = torch.linalg.svdvals(jac)
        largest.append(s[0])
        expected.append(math.log(float(s[0] ** 2) * x[b].numel() / float((s ** 2).sum())))
    got = flatness_penalty(left, x, torch.stack(largest), bounds)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert bool((got >= -1e-9).all())


def test_a_tight_frame_costs_nothing_and_a_rank_one_layer_the_most():
    left = sz.LeftHalf([nn.Linear(4, 8, bias=False)], [sz.ClippedReLU(float("inf"))], input_shape=(4,)).double()
    with torch.no_grad():  # two stacked copies of the identity: all singular values √2
        left.layers[0].weight.copy_(torch.cat([torch.eye(4), torch.eye(4)]).double())
    x = torch.full((1, 4), 0.5, dtype=torch.float64)
    bounds = ball_bounds(left, x, 0.0)
    tight = flatness_penalty(left, x, torch.tensor([math.sqrt(2.0)], dtype=torch.float64), bounds)
    assert float(tight.detach()) == pytest.approx(0.0, abs=1e-12)
    with torch.no_grad():  # every row the same vector: rank one, s_1² = ‖A‖_F²
        left.layers[0].weight.copy_(torch.ones(8, 4, dtype=torch.float64))
    s1 = math.sqrt(8 * 4)
    rank_one = flatness_penalty(left, x, torch.tensor([s1], dtype=torch.float64), bounds)
    assert float(rank_one.detach()) == pytest.approx(math.log(4), rel=1e-12)
    # No varying neuron (every pre-activation below 0): A = 0, nothing to flatten, and a finite gradient.
    dead = flatness_penalty(left, -x, torch.tensor([0.0], dtype=torch.float64), ball_bounds(left, -x, 0.0))
    dead.sum().backward()
    assert float(dead.detach()) == 0.0 and bool(torch.isfinite(left.layers[0].weight.grad).all())


def test_flatness_term_enters_the_loss_with_its_weight_and_pulls_the_spectrum_flat():
    torch.manual_seed(3)
    model = tabular_mlp(6, num_classes=3, hidden=(12,), split_index=1)
    x = torch.rand(10, 6, generator=torch.Generator().manual_seed(4))
    y = torch.arange(10) % 3
    base = TrainConfig(sigma=0.5, lambda_start=0.5, lambda_end=0.5)
    plain, plain_parts = splitz_loss(model, x, y, base, 0.5, None, torch.Generator().manual_seed(0))
    config = TrainConfig(sigma=0.5, lambda_start=0.5, lambda_end=0.5, flatness_weight=0.3)
    loss, parts = splitz_loss(model, x, y, config, 0.5, None, torch.Generator().manual_seed(0))
    assert "flatness" not in plain_parts and parts["flatness"] > 0
    assert float(loss.detach()) == pytest.approx(float(plain.detach()) + 0.3 * parts["flatness"], rel=1e-5)
    # Gradient steps on the term alone (λ = 0: no hinge; the estimate is still computed for it) flatten the spectrum.
    alone = TrainConfig(sigma=0.5, lambda_start=0.0, lambda_end=0.0, flatness_weight=1.0)
    optimizer = torch.optim.SGD(model.left.parameters(), lr=0.05)
    spreads = []
    for _ in range(60):
        _, parts = splitz_loss(model, x, y, alone, 0.0, None, torch.Generator().manual_seed(0))
        spreads.append(parts["flatness"])
        optimizer.zero_grad()
        bounds = ball_bounds(model.left, x, 0.1, dtype=torch.float32)
        lip = lipschitz_estimate(model.left, x, 0.1, power_iters=20, bounds=bounds)
        flatness_penalty(model.left, x, lip, bounds).mean().backward()
        optimizer.step()
    assert spreads[-1] < 0.7 * spreads[0]


def test_flatness_term_is_refused_for_a_deeper_f_l_before_training():
    torch.manual_seed(0)
    model = tabular_mlp(5, num_classes=2, hidden=(6, 4), split_index=2)
    data = TensorDataset(torch.randn(40, 5), torch.randint(0, 2, (40,)))
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=10, val_fraction=0.25, flatness_weight=0.1)
    with pytest.raises(ValueError, match="one-layer f_L"):
        train(model, data, config, "unused-dir-never-created", model_spec={"name": "mlp"})
    with pytest.raises(ValueError, match="flatness_weight"):
        TrainConfig(sigma=0.5, flatness_weight=-0.1).validate()


def test_training_with_the_flatness_term_records_it_and_resumes_to_the_same_model(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=gen)
    data = TensorDataset(x, (x[:, 0] > 0).long())

    def model():
        torch.manual_seed(0)
        return tabular_mlp(5, num_classes=2, hidden=(8,), split_index=1)

    config = TrainConfig(sigma=0.5, epochs=3, batch_size=16, val_fraction=0.25, lr_schedule="none",
                         flatness_weight=0.5)
    full = train(model(), data, config, tmp_path / "full", model_spec={"name": "mlp"})
    train(model(), data, config, tmp_path / "part", model_spec={"name": "mlp"}, stop_after_epochs=1)
    resumed = train(model(), data, config, tmp_path / "part", model_spec={"name": "mlp"}, resume=True)
    assert resumed.history == full.history
    assert all(r["train_flatness"] >= -1e-3 for r in full.history)
    a, b = (load_checkpoint_file(tmp_path / run / "last.pt") for run in ("full", "part"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["config"]["flatness_weight"] == 0.5


def test_diagnose_reports_the_flatness_of_the_masked_operator_on_the_certified_ball(capsys):
    """diagnose's flatness is ‖A‖_F² / (n L²) with A the Jacobian-like masked operator on B(x, γ*): checked against a
    dense SVD where γ* = 0 (A is then f_L's Jacobian at x) and the table's L is its exact norm."""
    from splitz_fast.analysis.tables import CertificationTable
    from splitz_fast.analysis.diagnostics import diagnose, diagnostics_report

    left = _conv_left(5).float()
    model = sz.SplitModel(left, nn.Sequential(nn.Flatten(), nn.Linear(3 * 3 * 3, 2)), num_classes=2)
    x = torch.rand(3, 2, 6, 5, generator=torch.Generator().manual_seed(6))
    data = TensorDataset(x, torch.zeros(3, dtype=torch.long))
    norms, expected = [], []
    for b in range(3):
        jac = torch.autograd.functional.jacobian(lambda v: left(v.view(1, 2, 6, 5)).flatten(), x[b].flatten())
        s = torch.linalg.svdvals(jac.double())
        norms.append(float(s[0]))
        expected.append(float((s ** 2).sum()) / (x[b].numel() * float(s[0]) ** 2))
    ones = np.ones(3)
    table = CertificationTable(idx=np.arange(3), label=np.zeros(3, dtype=np.int64), predict=np.zeros(3, dtype=np.int64),
                               radius=0.1 * ones, correct=ones.astype(bool), time=ones,
                               extra={"L": np.array(norms), "gamma": 0 * ones, "pA_lower": 0.9 * ones})
    diag = diagnose(model, data, table)
    np.testing.assert_allclose(diag.flatness, expected, rtol=1e-5)
    assert "spectral flatness" in diagnostics_report(diag, "toy")
    assert capsys.readouterr().err == ""  # a progress bar only where asked (the command line asks)
    np.testing.assert_allclose(diagnose(model, data, table, batch=2, progress=True).flatness, expected, rtol=1e-5)
    bar = capsys.readouterr().err
    assert "diagnose: 100%" in bar and "3/3" in bar
