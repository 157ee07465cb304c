"""The tools for comparing training recipes: recipes and objectives, warm start, the held-out split, best-σ envelopes
and the certificate diagnostics (constant neurons checked against sampled points of the ball)."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.analysis.tables import CertificationTable
from splitz_fast.cli.main import main
from splitz_fast.analysis.diagnostics import neuron_states
from splitz_fast.analysis.envelope import MNIST_REFERENCES, envelope, envelope_report
from splitz_fast.bounds.estimate import PowerIterationState, lipschitz_estimate
from splitz_fast.training.recipes import RECIPES, recipe_config
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.batches import held_out_part
from splitz_fast.training.config import LIP_OBJECTIVES, TrainConfig
from splitz_fast.training.loop import train, warm_start_
from splitz_fast.training.loss import splitz_loss


def _batch(seed=0, n=8):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _estimates(model, x, state):
    return lipschitz_estimate(model.left, x, 0.1, power_iters=5, state=copy.deepcopy(state)).detach()


@pytest.fixture
def warm():
    torch.manual_seed(0)
    model = sz.lenet(split_index=1)
    x, y = _batch()
    state = PowerIterationState()
    lipschitz_estimate(model.left, x, 0.1, power_iters=5, state=state, generator=torch.Generator().manual_seed(0))
    return model, x, y, state


# ------------------------------------------------------------------------------------------------ objectives
def test_batch_mean_hinge_is_the_published_codes_objective(warm):
    model, x, y, state = warm
    lip = _estimates(model, x, state)
    lam = 0.3
    below = TrainConfig(sigma=0.5, lip_objective="batch-mean-hinge", theta_lip=float(lip.mean()) + 1.0)
    loss, parts = splitz_loss(model, x, y, below, lam, copy.deepcopy(state), torch.Generator().manual_seed(3))
    assert float(loss.detach()) == pytest.approx(parts["ce"], rel=1e-6)  # mean L̂ under θ_lip: cross-entropy at weight 1
    above = TrainConfig(sigma=0.5, lip_objective="batch-mean-hinge", theta_lip=float(lip.min()) - 1e-3)
    loss, parts = splitz_loss(model, x, y, above, lam, copy.deepcopy(state), torch.Generator().manual_seed(3))
    assert float(loss.detach()) == pytest.approx((1 - lam) * parts["ce"] + lam * float(lip.mean()), rel=1e-5)


def test_lagrangian_objective_and_its_multiplier(warm):
    model, x, y, state = warm
    lip = _estimates(model, x, state)
    config = TrainConfig(sigma=0.5, lip_objective="lagrangian", lip_target=0.5)
    loss, parts = splitz_loss(model, x, y, config, 2.0, copy.deepcopy(state), torch.Generator().manual_seed(3))
    assert float(loss.detach()) == pytest.approx(parts["ce"] + 2.0 * (float(lip.mean()) - 0.5), rel=1e-5)
    # μ = 0 still measures L̂ (the multiplier's update needs it), and the loss is the cross-entropy alone.
    loss, parts = splitz_loss(model, x, y, config, 0.0, copy.deepcopy(state), torch.Generator().manual_seed(3))
    assert "lip" in parts and float(loss.detach()) == pytest.approx(parts["ce"] + 0.0, rel=1e-6)


def test_lagrangian_multiplier_rises_while_the_constraint_is_violated(tmp_path):
    x, y = _batch(n=96)
    torch.manual_seed(0)
    model = sz.lenet(split_index=1)  # fresh LeNet: L̂ ≈ 3, far above the target
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=32, lip_objective="lagrangian", lip_target=0.1,
                         dual_step=0.05, dual_init=0.0, val_fraction=0.25, lr_schedule="none")
    train(model, TensorDataset(x, y), config, tmp_path, model_spec={"name": "lenet"})
    ckpt = load_checkpoint_file(tmp_path / "last.pt")
    steps = 3  # 72 training images, batch 32
    assert ckpt["multiplier"] > 0.05 * steps * 0.5  # each step adds dual_step · (L̂ − 0.1) with L̂ well above 0.6
    assert ckpt["history"][0]["multiplier"] == ckpt["multiplier"]


def test_gamma_ramp_and_config_checks():
    config = TrainConfig(sigma=0.5, epochs=5, gamma_train=0.2, gamma_ramp=True)
    assert [config.gamma_at(e) for e in range(5)] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    assert TrainConfig(sigma=0.5, epochs=5, gamma_train=0.2).gamma_at(0) == 0.2
    with pytest.raises(ValueError, match="lip_objective"):
        TrainConfig(sigma=0.5, lip_objective="mean").validate()
    with pytest.raises(ValueError, match="lip_target"):
        TrainConfig(sigma=0.5, lip_target=0.0).validate()
    assert set(LIP_OBJECTIVES) == {"per-sample-hinge", "batch-mean-hinge", "lagrangian"}


# ------------------------------------------------------------------------------------------------ recipes
def test_recipes_set_their_fields_and_options_override_them():
    for name, recipe in RECIPES.items():
        assert recipe.source
        if recipe.needs_init:
            with pytest.raises(ValueError, match="--init"):
                recipe_config(name, sigma=0.5)
            continue
        config = recipe_config(name, sigma=0.5)
        assert all(getattr(config, key) == value for key, value in recipe.train.items())
    published = recipe_config("published-code", sigma=0.5, lambda_end=0.2)
    assert published.lip_objective == "batch-mean-hinge" and published.gamma_ramp and published.lambda_end == 0.2
    assert RECIPES["published-code"].model["threshold_per_element"]
    assert recipe_config(None, sigma=0.5) == TrainConfig(sigma=0.5)  # no recipe: TrainConfig's defaults
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe_config("fast", sigma=0.5)


def test_per_element_thresholds_have_the_activation_shape_and_keep_the_function():
    torch.manual_seed(0)
    scalar = sz.lenet(split_index=1, threshold=0.7)
    torch.manual_seed(0)
    element = sz.lenet(split_index=1, threshold=0.7, learnable_threshold=True, threshold_per_element=True)
    theta = element.left.activation(0).threshold
    assert isinstance(theta, torch.nn.Parameter) and theta.shape == (32, 28, 28) and torch.all(theta == 0.7)
    x, _ = _batch()
    assert torch.equal(element(x), scalar(x))


def test_warm_start_copies_the_rs_layers_and_refuses_another_sigma(tmp_path):
    torch.manual_seed(1)
    rs = sz.lenet(split_index=0)
    ckpt = {"format": 1, "model": rs.state_dict(), "config": {"sigma": 0.5},
            "model_spec": {"name": "lenet", "kwargs": {"split_index": 0}}}
    torch.manual_seed(2)
    target = sz.lenet(split_index=1)
    warm_start_(target, ckpt, TrainConfig(sigma=0.5, init_checkpoint="rs.pt"))
    rs_layers = [m for m in rs.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    new_layers = [m for m in target.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(rs_layers) == len(new_layers) == 4
    assert all(torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias) for a, b in zip(rs_layers, new_layers))
    with pytest.raises(ValueError, match="same σ"):
        warm_start_(target, ckpt, TrainConfig(sigma=0.25, init_checkpoint="rs.pt"))


def test_old_checkpoints_without_the_new_fields_still_resume(tmp_path):
    x, y = _batch(n=40)
    data = TensorDataset(x, y)
    config = TrainConfig(sigma=0.5, epochs=2, batch_size=16, val_fraction=0.25, lr_schedule="none")
    torch.manual_seed(0)
    train(sz.lenet(split_index=1), data, config, tmp_path, model_spec={"name": "lenet"}, stop_after_epochs=1)
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    for key in ("lip_objective", "lip_target", "dual_step", "dual_init", "gamma_ramp", "init_checkpoint"):
        del ckpt["config"][key]  # as written before these fields existed
    torch.save(ckpt, tmp_path / "last.pt")
    torch.manual_seed(0)
    result = train(sz.lenet(split_index=1), data, config, tmp_path, model_spec={"name": "lenet"}, resume=True)
    assert [r["epoch"] for r in result.history] == [0, 1]


def test_cli_recipe_train_warm_start_and_held_out_certification(tmp_path, capsys):
    common = ["--sigma", "0.5", "--epochs", "1", "--batch", "32", "--max-batches", "1", "--val-fraction", "0.002"]
    assert main(["train", "mnist", "lenet", str(tmp_path / "rs"), "--recipe", "rs", *common]) == 0
    rs = load_checkpoint_file(tmp_path / "rs" / "best.pt")
    assert rs["model_spec"]["kwargs"]["split_index"] == 0 and rs["model_spec"]["recipe"] == "rs"
    assert main(["train", "mnist", "lenet", str(tmp_path / "ws"), "--recipe", "warm-start", *common]) == 2
    assert "--init" in capsys.readouterr().err
    assert main(["train", "mnist", "lenet", str(tmp_path / "ws"), "--recipe", "warm-start", "--init",
                 str(tmp_path / "rs" / "best.pt"), "--threshold-per-element", "--learnable-threshold", *common]) == 0
    ws = load_checkpoint_file(tmp_path / "ws" / "best.pt")
    assert ws["config"]["init_checkpoint"].endswith("best.pt") and ws["config"]["lambda_start"] == 0.8
    assert ws["model"]["left.activations.0.threshold"].shape == (32, 28, 28)
    # Certify on the held-out images of the run: the indices are positions in the held-out part (120 images here).
    out = tmp_path / "heldout.tsv"
    assert main(["certify", "mnist", str(tmp_path / "ws" / "best.pt"), "0.5", str(out), "--split", "heldout",
                 "--skip", "60", "--N0", "10", "--N", "50"]) == 0
    rows = out.read_text().splitlines()[1:]
    assert [int(r.split("\t")[0]) for r in rows] == [0, 60]
    held_out = held_out_part(sz.get_dataset("mnist", "train").dataset, ws)
    assert len(held_out) == 120 and [int(r.split("\t")[1]) for r in rows] == [int(held_out[i][1]) for i in (0, 60)]


# ------------------------------------------------------------------------------------------------ envelope
def _table(radius, correct):
    radius = np.asarray(radius, dtype=np.float64)
    n = radius.size
    correct = np.asarray(correct, dtype=bool)
    return CertificationTable(idx=np.arange(n), label=np.zeros(n, np.int64), predict=np.where(correct, 0, 1),
                              radius=radius, correct=correct, time=np.zeros(n))


def test_envelope_is_the_best_sigma_at_each_radius():
    runs = {0.25: _table([0.3, 0.6, 0.9, 0.1], [1, 1, 1, 1]), 1.0: _table([2.0, 1.5, 0.0, 0.2], [1, 1, 0, 1])}
    best, sigmas = envelope(runs, [0.0, 0.5, 1.0, 1.5])
    assert best.tolist() == [1.0, 0.5, 0.5, 0.5] and sigmas == [0.25, 0.25, 1.0, 1.0]
    text = envelope_report({"RS": runs, "SPLITZ": {1.0: _table([3.0, 3.0, 3.0, 0.0], [1, 1, 1, 0])}},
                           [0.0, 1.5], MNIST_REFERENCES)
    assert "| RS envelope | 100.0 (σ=0.25) | 50.0 (σ=1) |" in text
    assert "| 1 | +0.0 | +25.0 | +1.325 |" in text  # same σ: SPLITZ − RS, points and ACR
    assert "67.8" in text and "—" in text


def test_cli_envelope_reads_sigma_from_the_sidecars(tmp_path, capsys):
    paths = []
    for name, sigma, radii in (("a", 0.25, [0.5, 0.1]), ("b", 0.5, [1.0, 0.0])):
        path = tmp_path / f"{name}.tsv"
        path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n" + "".join(
            f"{i}\t0\t0\t{r}\t1\t0.1\n" for i, r in enumerate(radii)))
        (tmp_path / f"{name}.tsv.json").write_text(json.dumps({"sigma": sigma}))
        paths.append(str(path))
    assert main(["envelope", "--group", "RS", *paths, "--radii", "0.5", "--out", str(tmp_path / "env")]) == 0
    assert "| RS envelope | 50.0 (σ=0.25) |" in capsys.readouterr().out
    assert (tmp_path / "env" / "envelope.png").stat().st_size > 0
    (tmp_path / "b.tsv.json").write_text(json.dumps({"sigma": 0.25}))
    assert main(["envelope", "--group", "RS", *paths]) == 2
    assert "two runs of σ = 0.25" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ diagnostics
def test_constant_neurons_never_change_state_inside_the_ball():
    """Every neuron the diagnostics call inactive (saturated) stays ≤ 0 (≥ θ) at sampled points of the ball, and the
    three states partition the neurons."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=1, threshold=0.3)
    x, _ = _batch(n=3)
    gamma = torch.tensor([0.05, 0.5, 2.0], dtype=torch.float64)
    states = neuron_states(model.left, x, gamma)
    assert np.allclose(states.inactive + states.saturated + states.varying, 1.0)
    assert states.inactive[0] > states.inactive[2]  # a larger ball keeps fewer neurons constant
    from splitz_fast.bounds.intervals import ball_bounds
    bounds = ball_bounds(model.left, x, gamma)
    layer = model.left.layers[0]
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        direction = torch.randn(x.shape, generator=gen)
        direction = direction / direction.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        scale = gamma.float().view(-1, 1, 1, 1) * torch.rand(3, 1, 1, 1, generator=gen)
        z = layer(x + scale * direction).double()
        assert torch.all(z[bounds.upper[0] <= 0] <= 1e-6)
        assert torch.all(z[bounds.lower[0] >= 0.3] >= 0.3 - 1e-6)


def test_dead_neurons_are_those_inactive_on_every_ball():
    """ever_awake marks exactly the neurons not inactive on at least one input's ball; a channel switched off (its
    bias far below zero) is dead for every input, and diagnose's report names the dead share."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=1, threshold=1.0)
    with torch.no_grad():
        model.left.layers[0].bias[:4] = -1e3  # four channels never fire
    x, _ = _batch(n=3)
    states = neuron_states(model.left, x, 0.5)
    from splitz_fast.bounds.intervals import ball_bounds
    upper = ball_bounds(model.left, x, 0.5).upper[0]
    assert np.array_equal(states.ever_awake, (upper > 0).flatten(1).any(0).numpy())
    per_channel = states.ever_awake.reshape(upper.shape[1], -1)
    assert not per_channel[:4].any() and per_channel[4:].any()


def test_cli_diagnose_reads_the_certified_split_and_refuses_another_checkpoint(tmp_path, capsys):
    common = ["--sigma", "0.25", "--epochs", "1", "--batch", "32", "--max-batches", "1", "--val-fraction", "0.01"]
    for name, seed in (("a", "0"), ("b", "1")):
        assert main(["train", "mnist", "lenet", str(tmp_path / name), "--recipe", "paper", "--seed", seed,
                     "--threshold", "0.1", *common]) == 0
    out = tmp_path / "cert.tsv"
    assert main(["certify", "mnist", str(tmp_path / "a" / "best.pt"), "0.25", str(out), "--skip", "2000",
                 "--N0", "10", "--N", "100"]) == 0
    capsys.readouterr()
    code = main(["diagnose", str(tmp_path / "a" / "best.pt"), str(out), "--out", str(tmp_path / "d")])
    text = capsys.readouterr()
    if code == 0:
        assert "| constant neurons (%) |" in text.out and (tmp_path / "d" / "diagnostics.tsv").exists()
        assert "diagnose: 100%" in text.err  # the command's progress bar, as certify and train have
    else:  # an untrained model may certify nothing; then the message says so
        assert "nothing to diagnose" in text.err
    assert main(["diagnose", str(tmp_path / "b" / "best.pt"), str(out)]) == 2
    assert "another model" in capsys.readouterr().err


def test_published_code_recipe_weights_the_lipschitz_term_as_that_code_does():
    """The published code's loss is (1 − κ)·CE + κ·L̂ (batch mean) while L̂ > θ_lip, cross-entropy alone below, with κ
    from 1.0 down to 0.7: at the first epoch the cross-entropy has no weight at all."""
    config = recipe_config("published-code", sigma=0.5, epochs=4)
    assert config.lambda_at(0) == 1.0 and config.lambda_at(3) == pytest.approx(0.7)
    ce = torch.tensor(2.0, requires_grad=True)
    lip = torch.tensor([0.9, 1.1], requires_grad=True)
    loss = config.objective.combine(ce, lip, config.lambda_at(0), config, 1.0, float(lip.detach().mean()))
    loss.backward()
    assert float(ce.grad) == 0.0 and float(loss.detach()) == pytest.approx(1.0)
    late = config.objective.combine(torch.tensor(2.0), lip.detach(), config.lambda_at(3), config, 1.0, 1.0)
    assert float(late) == pytest.approx(0.3 * 2.0 + 0.7 * 1.0)
    below = config.objective.combine(torch.tensor(2.0), torch.tensor([0.2, 0.4]), config.lambda_at(0), config, 1.0, 0.3)
    assert float(below) == pytest.approx(2.0)  # mean L̂ ≤ θ_lip = 0.5: cross-entropy alone
