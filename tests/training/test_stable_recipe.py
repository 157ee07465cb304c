"""The `stable` recipe — the stability term (neurons constant on the training ball), its interval
bounds (those of the certificate), the per-step γ ramp, and resumable training with the new fields."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.bounds.intervals import ball_bounds
from splitz_fast.cli.main import main
from splitz_fast.zoo.models import tabular_mlp
from splitz_fast.training.recipes import RECIPES, recipe_config
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loop import train
from splitz_fast.training.loss import ball_intervals, splitz_loss, stability_penalty


def _mlp(seed=0, **kwargs):
    torch.manual_seed(seed)
    return tabular_mlp(5, num_classes=3, hidden=(4, 3), split_index=2, **kwargs).double()


def _naive_penalty(model, x, gamma, scale):
    """Neuron by neuron, in Python loops: the ball bound of the first layer (rows of W/sd), interval arithmetic with
    the clipped ReLU's clamp for the second, then tanh(max(min(u, θ − l), 0)/τ) averaged over all neurons."""
    left = model.left
    mean, std = left.standardize.mean.double(), left.standardize.std.double()
    costs, varying = [], []
    for b in range(x.shape[0]):
        per_input, count = [], 0
        lo_prev = hi_prev = None
        for k, layer in enumerate(left.layers):
            theta = left.activation(k).threshold
            los, his = [], []
            for i in range(layer.out_features):
                w, bias = layer.weight[i], layer.bias[i]
                if k == 0:
                    center = sum(w[j] * (x[b, j] - mean[j]) / std[j] for j in range(x.shape[1])) + bias
                    norm = torch.sqrt(sum((w[j] / std[j]) ** 2 for j in range(x.shape[1])))
                    lo, hi = center - gamma[b] * norm, center + gamma[b] * norm
                else:
                    lo = hi = bias
                    for j in range(layer.in_features):
                        lo = lo + (w[j] * lo_prev[j] if w[j] >= 0 else w[j] * hi_prev[j])
                        hi = hi + (w[j] * hi_prev[j] if w[j] >= 0 else w[j] * lo_prev[j])
                th = theta[i] if theta.ndim else theta
                d = torch.minimum(hi, th - lo)
                per_input.append(torch.tanh(torch.clamp(d, min=0) / scale))
                count += int(d > 0)
                los.append(lo)
                his.append(hi)
            lo_prev = [torch.minimum(torch.clamp(v, min=0), theta[i] if theta.ndim else theta) for i, v in enumerate(los)]
            hi_prev = [torch.minimum(torch.clamp(v, min=0), theta[i] if theta.ndim else theta) for i, v in enumerate(his)]
        costs.append(sum(per_input) / len(per_input))
        varying.append(count / len(per_input))
    return torch.stack(costs), torch.tensor(varying, dtype=torch.float64)


def test_stability_penalty_value_and_gradient_match_a_naive_reference():
    model = _mlp(threshold=0.4, learnable_threshold=True, threshold_per_element=True,
                 mean=[0.1, 0.2, 0.0, -0.3, 0.5], std=[0.5, 1.0, 2.0, 0.7, 1.3])
    with torch.no_grad():  # spread the thresholds so both stable regions and the linear one occur
        for k in range(2):
            theta = model.left.activation(k).threshold
            theta.copy_(torch.linspace(0.05, 1.5, theta.numel(), dtype=theta.dtype).view_as(theta))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    gamma = torch.tensor([0.0, 0.2, 0.7], dtype=torch.float64)
    params = [p for p in model.left.parameters() if p.requires_grad]

    penalty, varying = stability_penalty(model.left, ball_intervals(model.left, x, gamma), scale=0.3)
    grads = torch.autograd.grad(penalty.sum(), params)
    ref_penalty, ref_varying = _naive_penalty(model, x, gamma, 0.3)
    ref_grads = torch.autograd.grad(ref_penalty.sum(), params)

    assert penalty.shape == (3,) and torch.allclose(penalty, ref_penalty, rtol=1e-10, atol=1e-12)
    assert torch.equal(varying, ref_varying)
    assert 0 < float(varying.min()) and float(varying.max()) < 1  # both kinds of neuron are present
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-8, atol=1e-12)
    assert all(float(g.abs().sum()) > 0 for g in grads)  # every weight, bias and threshold takes part
    # Thresholds get a gradient that pushes them down (saturation side): never up.
    for k in range(2):
        theta = model.left.activation(k).threshold
        g = next(g for g, p in zip(grads, params) if p is theta)
        assert torch.all(g >= 0) and float(g.sum()) > 0


def test_stability_penalty_gradient_matches_finite_differences():
    model = _mlp(seed=3, threshold=0.6, learnable_threshold=True)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weight = model.left.layers[0].weight

    def f(w):
        with torch.no_grad():
            saved = weight.detach().clone()
            weight.copy_(w)
        try:
            return stability_penalty(model.left, ball_intervals(model.left, x, 0.3), scale=0.5)[0].sum()
        finally:
            with torch.no_grad():
                weight.copy_(saved)

    value = stability_penalty(model.left, ball_intervals(model.left, x, 0.3), scale=0.5)[0].sum()
    (grad,) = torch.autograd.grad(value, weight)
    eps = 1e-6
    for idx in [(0, 0), (1, 3), (2, 2), (3, 4)]:
        step = torch.zeros_like(weight)
        step[idx] = eps
        with torch.no_grad():
            numeric = (f(weight.detach() + step) - f(weight.detach() - step)) / (2 * eps)
        assert float(grad[idx]) == pytest.approx(float(numeric), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("split", [1, 2])
def test_ball_intervals_are_the_certificates_bounds(split):
    """Same intervals as splitz_fast.bounds.intervals.ball_bounds (conv first layer with border taps, pool, second conv), up to
    the certificate's rounding margin; and the stability term's varying count is the certificate's mask."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=split, threshold=0.5).double()
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gamma = torch.tensor([0.0, 0.3, 1.5], dtype=torch.float64)
    intervals = ball_intervals(model.left, x, gamma)
    bounds = ball_bounds(model.left, x, gamma)
    assert len(intervals) == split
    for (lower, upper), lo, up in zip(intervals, bounds.lower, bounds.upper):
        assert torch.allclose(lower, lo, rtol=0, atol=1e-7) and torch.allclose(upper, up, rtol=0, atol=1e-7)
    _, varying = stability_penalty(model.left, intervals)
    total = sum(m[0].numel() for m in bounds.masks)
    certified = torch.stack([sum(m[b].sum() for m in bounds.masks) for b in range(3)]).double() / total
    assert torch.allclose(varying, certified, atol=2.0 / total)  # a neuron exactly on a boundary may differ


def test_stability_term_reduces_the_share_of_varying_neurons():
    """A few Adam steps on a toy problem: with the term the share of neurons varying on the ball falls, and ends below
    the run without it (same data, noise and initial weights)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    def run(weight):
        torch.manual_seed(0)
        model = tabular_mlp(5, num_classes=3, hidden=(16, 16), learnable_threshold=True, threshold_per_element=True)
        config = TrainConfig(sigma=0.25, lambda_start=0.0, lambda_end=0.0, stability_weight=weight,
                             gamma_train=0.3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        noise = torch.Generator().manual_seed(1)
        shares = []
        for _ in range(30):
            loss, parts = splitz_loss(model, x, y, config, 0.0, None, noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.left.project_thresholds_()
            shares.append(float(stability_penalty(model.left, ball_intervals(model.left, x, 0.3))[1].mean()))
        return shares, model

    with_term, model = run(2.0)
    without, _ = run(0.0)
    assert with_term[-1] < 0.7 * with_term[0] and with_term[-1] < without[-1] - 0.2
    assert all(bool((model.left.activation(k).threshold >= 0).all()) for k in range(model.left.depth))


def test_stability_term_enters_the_loss_with_its_weight():
    model = _mlp(seed=4).float()
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    base = TrainConfig(sigma=0.5, lambda_start=0.0, lambda_end=0.0)
    penalty, varying = stability_penalty(model.left, ball_intervals(model.left, x, 0.4))
    plain, plain_parts = splitz_loss(model, x, y, base, 0.0, None, torch.Generator().manual_seed(0), gamma=0.4)
    config = TrainConfig(sigma=0.5, lambda_start=0.0, lambda_end=0.0, stability_weight=0.7)
    loss, parts = splitz_loss(model, x, y, config, 0.0, None, torch.Generator().manual_seed(0), gamma=0.4)
    penalty = penalty.detach()
    assert float(loss.detach()) == pytest.approx(float(plain.detach()) + 0.7 * float(penalty.mean()), rel=1e-6)
    assert parts["stability"] == pytest.approx(float(penalty.mean()))
    assert parts["varying"] == pytest.approx(float(varying.mean())) and "stability" not in plain_parts


# ------------------------------------------------------------------------------------------------ recipe and ramp
def test_stable_recipe_config_and_its_per_step_ramp():
    recipe = RECIPES["stable"]
    config = recipe_config("stable", sigma=0.75, epochs=4)
    assert config.gamma_train == 1.5 and config.gamma_ramp and config.gamma_ramp_fraction == 0.5
    assert config.stability_weight > 0 and config.lip_objective == "per-sample-hinge"
    assert recipe.model["learnable_threshold"] and recipe.model["threshold_per_element"]
    assert recipe.model["split_index"] == 1
    steps = 10  # per epoch; the ramp reaches γ_train after half of the 40 steps
    assert config.gamma_at(0, 0, steps) == 0.0
    assert config.gamma_at(0, 5, steps) == pytest.approx(1.5 * 5 / 20)
    assert config.gamma_at(1, 0, steps) == pytest.approx(0.75)
    assert config.gamma_at(2, 0, steps) == config.gamma_at(3, 9, steps) == 1.5
    assert recipe_config("stable", sigma=0.75, epochs=4, gamma_train=2.0).gamma_at(3, 0, 10) == 2.0
    # Without a fraction the ramp is the per-epoch one, whatever the step.
    old = TrainConfig(sigma=0.5, epochs=5, gamma_train=0.2, gamma_ramp=True)
    assert old.gamma_at(1, 7, 10) == old.gamma_at(1) == pytest.approx(0.05)
    for bad, match in (({"gamma_ramp_fraction": 0.0, "gamma_ramp": True}, "gamma_ramp_fraction"),
                       ({"gamma_ramp_fraction": 0.5}, "needs gamma_ramp"),
                       ({"stability_weight": -1.0}, "stability_weight"),
                       ({"stability_scale": 0.0}, "stability_scale")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(sigma=0.5, **bad).validate()


def _toy_data(n=48):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _toy_model():
    torch.manual_seed(0)
    return tabular_mlp(5, num_classes=2, hidden=(8,), learnable_threshold=True, threshold_per_element=True)


def test_training_with_the_new_fields_resumes_to_the_same_model(tmp_path):
    config = TrainConfig(sigma=0.5, epochs=3, batch_size=16, val_fraction=0.25, lr_schedule="none", gamma_train=1.0,
                         gamma_ramp=True, gamma_ramp_fraction=0.5, stability_weight=0.5, stability_scale=0.5)
    full = train(_toy_model(), _toy_data(), config, tmp_path / "full", model_spec={"name": "mlp"})
    train(_toy_model(), _toy_data(), config, tmp_path / "part", model_spec={"name": "mlp"}, stop_after_epochs=1)
    resumed = train(_toy_model(), _toy_data(), config, tmp_path / "part", model_spec={"name": "mlp"}, resume=True)
    assert resumed.history == full.history
    a, b = (load_checkpoint_file(tmp_path / run / "last.pt") for run in ("full", "part"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["config"]["stability_weight"] == 0.5 and a["config"]["gamma_ramp_fraction"] == 0.5
    # The log records the last step's γ (3 steps per epoch, the ramp reaching 1.0 after 4.5 of the 9) and the term.
    assert [r["gamma_train"] for r in full.history] == pytest.approx([2 / 4.5, 1.0, 1.0])
    assert all(0 <= r["train_varying"] <= 1 and r["train_stability"] >= 0 for r in full.history)
    # Another stability weight is another run: resuming with it is refused by name.
    other = TrainConfig(**{**a["config"], "stability_weight": 0.1})
    with pytest.raises(ValueError, match="stability_weight"):
        train(_toy_model(), _toy_data(), other, tmp_path / "part", model_spec={"name": "mlp"}, resume=True)


def test_checkpoints_without_the_new_fields_resume_as_before(tmp_path):
    config = TrainConfig(sigma=0.5, epochs=2, batch_size=16, val_fraction=0.25, lr_schedule="none")
    train(_toy_model(), _toy_data(), config, tmp_path, model_spec={"name": "mlp"}, stop_after_epochs=1)
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    for key in ("gamma_ramp_fraction", "stability_weight", "stability_scale", "flatness_weight"):
        del ckpt["config"][key]  # as written before these fields existed
    torch.save(ckpt, tmp_path / "last.pt")
    result = train(_toy_model(), _toy_data(), config, tmp_path, model_spec={"name": "mlp"}, resume=True)
    assert [r["epoch"] for r in result.history] == [0, 1] and "train_varying" not in result.history[1]


def test_cli_trains_the_stable_recipe_and_options_override_it(tmp_path):
    common = ["--sigma", "0.75", "--epochs", "1", "--batch", "16", "--max-batches", "1", "--val-fraction", "0.002"]
    assert main(["train", "mnist", "lenet", str(tmp_path / "s"), "--recipe", "stable", "--stability-weight", "0.25",
                 *common]) == 0
    ckpt = load_checkpoint_file(tmp_path / "s" / "best.pt")
    assert ckpt["model_spec"]["recipe"] == "stable" and ckpt["config"]["stability_weight"] == 0.25
    assert ckpt["config"]["gamma_ramp_fraction"] == 0.5 and ckpt["config"]["gamma_train"] == 1.5
    assert ckpt["model"]["left.activations.0.threshold"].shape == (32, 28, 28)
    assert math.isfinite(ckpt["history"][0]["train_stability"])
