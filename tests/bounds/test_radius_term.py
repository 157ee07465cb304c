"""The radius training term (MACER's hinge on the soft SPLITZ radius min(γ_i, σΦ⁻¹(p̃_A)/L̃(x, γ_i))): off it changes
nothing, its L̃ is the certificate's bound at the input's own ball, its gradient reaches both halves, split 0 is
MACER's radius, and the command line sets and logs it."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

import splitz_fast.training.loss as loss_module
from splitz_fast.bounds.intervals import ball_bounds
from splitz_fast.cli.main import build_parser, main
from splitz_fast.cli.train import _TRAIN_OPTIONS, _train_config
from splitz_fast.bounds.estimate import PowerIterationState, lipschitz_estimate
from splitz_fast.bounds.lipschitz import lipschitz_bound
from splitz_fast.zoo.models import build_model, tabular_mlp
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig, radius_weight_at
from splitz_fast.training.loop import train
from splitz_fast.training.loss import P_A_CLAMP, radius_penalty, splitz_loss, torch_training_noise


def _lenet(seed=0, dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    return build_model("lenet", split_index=1, **kwargs).to(dtype)


def _digits(n=4, seed=0, dtype=torch.float32):
    return torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------ 1. off changes nothing
def _todays_loss(model, x, y, config, lam, state, generator, gamma):
    """The SPLITZ loss as it is without the radius term: cross-entropy of the noisy copies plus the per-sample hinge
    on the training estimate (the fused first layer where the native kernels run, as splitz_loss takes it)."""
    fused = loss_module._fused_first_layer(model.left, x, gamma)
    latent, bounds = (model.left(x), None) if fused is None else fused
    noisy = torch_training_noise(latent, config.noise_samples, config.sigma, generator)
    ce = F.cross_entropy(model.right(noisy), y.repeat_interleave(config.noise_samples)) * 1.0
    lip = lipschitz_estimate(model.left, x, gamma, power_iters=config.power_iters, state=state, generator=generator,
                             bounds=bounds)
    return (1.0 - lam) * ce + lam * (torch.clamp(lip, min=config.theta_lip).mean() * 1.0)


def test_weight_zero_gives_todays_loss_gradients_and_state_bitwise(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the radius term ran with radius_weight 0")

    x, y = _digits(6), torch.tensor([0, 1, 2, 3, 4, 5])
    base = dict(sigma=0.25, noise_samples=3, lambda_start=0.6, gamma_train=0.2)
    results = []
    for config in (None, TrainConfig(**base),
                   TrainConfig(**base, radius_weight=0.0, radius_target=0.5, radius_beta=4.0, radius_ramp_fraction=0)):
        model = _lenet()
        state = PowerIterationState()
        for step in range(2):  # a second step reads the warm starts the first one left
            gen = torch.Generator().manual_seed(step)
            if config is None:
                loss = _todays_loss(model, x, y, TrainConfig(**base), 0.6, state, gen, 0.2)
            else:
                monkeypatch.setattr(loss_module, "radius_penalty", never)
                loss, parts = splitz_loss(model, x, y, config, 0.6, state, gen, training_noise=torch_training_noise)
                assert "radius" not in parts and "soft_radius" not in parts
            grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss.detach(), grads, [v.clone() for v in state.vectors]))
    reference = results[0]
    for loss, grads, vectors in results[1:]:
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(g, r) for g, r in zip(grads, reference[1]))
        assert all(torch.equal(v, r) for v, r in zip(vectors, reference[2]))


def test_weight_zero_records_no_radius_in_training(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(40, 5, generator=torch.Generator().manual_seed(0)),
                                          torch.arange(40) % 2)
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=16, val_fraction=0.25, lr_schedule="none")
    torch.manual_seed(0)
    result = train(tabular_mlp(5, num_classes=2, hidden=(8,)), data, config, tmp_path,
                   model_spec={"name": "mlp"})
    assert not any(key.startswith(("train_radius", "train_soft_radius")) for key in result.history[0])


# ------------------------------------------------------------------------ 2. the certificate's bound at γ_i
def _logits_for(p_a: torch.Tensor, y: torch.Tensor, classes: int, q: int, beta: float) -> torch.Tensor:
    """Logits whose soft classifier puts exactly ``p_a`` on ``y`` (the rest spread evenly), the same for every draw."""
    probs = ((1 - p_a) / (classes - 1)).view(-1, 1).repeat(1, classes)
    probs[torch.arange(len(y)), y] = p_a
    return (probs.log() / beta).repeat_interleave(q, dim=0)


def test_the_terms_lipschitz_estimate_is_the_certificates_bound_at_each_inputs_ball():
    """A one-layer conv f_L in float64 with many power steps: L̃(x, γ_i) equals the exact certified bound of
    sz.certify's sound protocol (lipschitz_bound, method "exact") at the same γ_i to 1e-4 and never exceeds it beyond
    rounding; and γ_i is the input's own ball, whose masks differ from the training ball's, and L̃ follows γ_i."""
    model = _lenet(seed=1, dtype=torch.float64)
    x = _digits(3, seed=2, dtype=torch.float64)
    y = torch.tensor([3, 1, 7])
    sigma, gamma_train = 0.5, 0.1
    p_a = torch.tensor([0.999, 0.99, 0.95], dtype=torch.float64)
    radius = sigma * torch.special.ndtri(p_a)
    wanted = torch.tensor([0.6, 1.2, 0.35], dtype=torch.float64)  # the balls, through the start estimate
    term = radius_penalty(model.left, x, y, _logits_for(p_a, y, 10, 2, 16.0), sigma=sigma, target=2.0, beta=16.0,
                          start_lip=radius / wanted, power_iters=2000, state=PowerIterationState(),
                          generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(term.gamma, wanted, rtol=1e-12, atol=0)
    exact = lipschitz_bound(model.left, x, term.gamma, method="exact").value
    assert torch.allclose(term.lip.detach(), exact, rtol=1e-4, atol=0)
    assert bool((term.lip.detach() <= exact * (1 + 1e-9)).all())
    # The masks at γ_i are not the training ball's, and the estimate follows γ_i, not γ_train.
    at_gamma, at_train = ball_bounds(model.left, x, term.gamma), ball_bounds(model.left, x, gamma_train)
    for b in range(3):
        assert not torch.equal(at_gamma.masks[0][b], at_train.masks[0][b])
    at_train_bound = lipschitz_bound(model.left, x, gamma_train, method="exact").value
    assert bool((at_train_bound < exact * (1 - 1e-3)).all())
    # r̃ = min(γ_i, R / L̃(x, γ_i)): Theorem 1's radius at that ball.
    expected = torch.minimum(term.gamma, radius / term.lip.detach())
    torch.testing.assert_close(term.radius.detach(), expected, rtol=1e-12, atol=0)


def test_splitz_loss_places_the_ball_by_one_fixed_point_step_from_the_training_ball():
    """In the loss, γ_i = clamp(σΦ⁻¹(p̃_A) / L̃(x, γ_train), 0, target) with the Lipschitz term's own estimate."""
    model = _lenet(seed=3)
    x, y = _digits(4, seed=4), torch.tensor([0, 1, 2, 3])
    config = TrainConfig(sigma=0.5, noise_samples=2, gamma_train=0.1, radius_weight=1.0, radius_target=1.0)
    seen = {}
    original = loss_module.radius_penalty

    def spy(*args, **kwargs):
        seen.update(kwargs, term=original(*args, **kwargs), logits=args[3])
        return seen["term"]

    loss_module.radius_penalty = spy
    try:
        state = PowerIterationState()
        splitz_loss(model, x, y, config, 0.8, state, torch.Generator().manual_seed(0),
                    training_noise=torch_training_noise)
    finally:
        loss_module.radius_penalty = original
    gen = torch.Generator().manual_seed(0)
    torch_training_noise(model.left(x), 2, 0.5, gen)  # the noise comes first from the same generator
    start = lipschitz_estimate(model.left, x, 0.1, power_iters=config.power_iters, state=PowerIterationState(),
                               generator=gen)
    assert torch.allclose(seen["start_lip"], start.detach(), rtol=1e-5)
    r0 = seen["sigma"] * torch.special.ndtri(seen["term"].p_a.detach().clamp(P_A_CLAMP, 1 - P_A_CLAMP))
    expected = torch.where(r0 > 0, r0 / seen["start_lip"], torch.zeros_like(r0)).clamp(0, 1.0)
    torch.testing.assert_close(seen["term"].gamma, expected)


# ----------------------------------------------------------------------------------------- 3. gradients, zeros
def test_the_terms_gradient_reaches_both_halves_and_through_the_estimate():
    model = _lenet(seed=5)
    conv1, last = model.left.layers[0].weight, list(model.right.parameters())[-2]
    with torch.no_grad():  # a confident f_R: p̃_A well above 1/2 (R > 0) where its top class is the label
        last.mul_(100.0)
    x, y = _digits(4, seed=6), torch.tensor([9, 9, 9, 0])
    noisy = torch_training_noise(model.left(x), 2, 0.5, torch.Generator().manual_seed(0))
    logits = model.right(noisy)
    start = torch.full((4,), 2.0)
    term = radius_penalty(model.left, x, y, logits, sigma=0.5, target=5.0, beta=1.0, start_lip=start)
    assert term.correct.tolist() == [True, True, True, False] and float(term.penalty[:3].detach().min()) > 0
    g_left, g_right = torch.autograd.grad(term.penalty.sum(), [conv1, last])
    assert float(g_left.abs().sum()) > 0 and float(g_right.abs().sum()) > 0
    # Through L̃ alone (logits without gradient): f_L's first layer still gets one.
    term = radius_penalty(model.left, x, y, logits.detach(), sigma=0.5, target=5.0, beta=1.0, start_lip=start)
    positive = term.correct & (term.radius < term.gamma)  # where r̃ = R / L̃
    assert bool(positive.any())
    (g_lip,) = torch.autograd.grad(term.penalty.sum(), [conv1])
    assert float(g_lip.abs().sum()) > 0


def test_misclassified_inputs_contribute_nothing_and_radii_above_the_target_cost_nothing():
    model = _lenet(seed=7)
    x = _digits(4, seed=8)
    y = torch.tensor([0, 1, 2, 3])
    p_a = torch.tensor([0.9, 0.05, 0.8, 0.02])  # inputs 1 and 3: another class is the soft classifier's top
    logits = _logits_for(p_a, y, 10, 2, 16.0).clone().requires_grad_(True)
    logits_wrong = logits.detach().clone()
    logits_wrong[2:4, 5] += 10.0 / 16  # input 1: class 5 on top
    logits_wrong[6:8, 4] += 10.0 / 16  # input 3: class 4 on top
    logits_wrong.requires_grad_(True)
    term = radius_penalty(model.left, x, y, logits_wrong, sigma=0.5, target=3.0, start_lip=torch.ones(4))
    assert term.correct.tolist() == [True, False, True, False]
    penalty = term.penalty.detach()
    assert float(penalty[1]) == 0.0 and float(penalty[3]) == 0.0
    assert float(penalty[0]) > 0 and float(penalty[2]) > 0
    (g,) = torch.autograd.grad(term.penalty[[1, 3]].sum(), [logits_wrong], allow_unused=True)
    assert g is None or float(g.abs().sum()) == 0.0
    # Confident inputs and a small target: every r̃ ≥ target, so the term and its gradient vanish.
    sure = _logits_for(torch.full((4,), 0.99999), y, 10, 2, 16.0)
    term = radius_penalty(model.left, x, y, sure, sigma=1.0, target=0.05, start_lip=torch.ones(4))
    assert bool((term.radius >= 0.05).all()) and float(term.penalty.detach().abs().sum()) == 0.0


def test_radius_weight_and_its_ramp_enter_the_loss():
    model = _lenet(seed=9)
    x, y = _digits(4, seed=10), torch.tensor([4, 5, 6, 7])
    config = TrainConfig(sigma=0.5, noise_samples=2, radius_weight=0.3, radius_target=1.5, radius_beta=2.0)
    plain = TrainConfig(sigma=0.5, noise_samples=2)
    off, _ = splitz_loss(model, x, y, plain, 0.8, PowerIterationState(), torch.Generator().manual_seed(0))
    on, parts = splitz_loss(model, x, y, config, 0.8, PowerIterationState(), torch.Generator().manual_seed(0))
    zero, zparts = splitz_loss(model, x, y, config, 0.8, PowerIterationState(), torch.Generator().manual_seed(0),
                               radius_weight=0.0)
    assert parts["radius"] > 0 and zparts["radius"] == parts["radius"]
    assert float(on.detach()) == pytest.approx(float(off.detach()) + 0.3 * parts["radius"], rel=1e-5)
    assert float(zero.detach()) == pytest.approx(float(off.detach()), rel=1e-6)
    # The ramp: 0 at the first step, the full weight after half of all steps.
    ramped = TrainConfig(sigma=0.5, epochs=4, radius_weight=0.8)
    assert radius_weight_at(ramped, 0, 0, 10) == 0.0
    assert radius_weight_at(ramped, 1, 0, 10) == pytest.approx(0.4)
    assert radius_weight_at(ramped, 2, 0, 10) == radius_weight_at(ramped, 3, 9, 10) == pytest.approx(0.8)
    assert radius_weight_at(TrainConfig(sigma=0.5, radius_weight=0.8, radius_ramp_fraction=0), 0, 0, 10) == 0.8


# ------------------------------------------------------------------------------------------------- 4. split 0
def test_split_zero_is_macers_radius_by_hand():
    torch.manual_seed(11)
    model = tabular_mlp(3, num_classes=3, hidden=(4,), split_index=0)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(12))
    y = torch.tensor([0, 1, 2, 0, 1])
    q, sigma, beta, target = 4, 0.5, 3.0, 2.5
    noisy = torch_training_noise(model.left(x), q, sigma, torch.Generator().manual_seed(13))
    logits = model.right(noisy)
    term = radius_penalty(model.left, x, y, logits, sigma=sigma, target=target, beta=beta, start_lip=torch.ones(5))
    z = beta * logits.detach().double().numpy()
    soft = np.exp(z - z.max(1, keepdims=True))
    soft = (soft / soft.sum(1, keepdims=True)).reshape(5, q, 3).mean(1)
    p = soft[np.arange(5), y.numpy()]
    r = sigma * scipy.stats.norm.ppf(np.clip(p, P_A_CLAMP, 1 - P_A_CLAMP))
    correct = soft.argmax(1) == y.numpy()
    assert correct.any() and not correct.all()
    np.testing.assert_allclose(term.lip.detach().numpy(), 1.0)
    np.testing.assert_allclose(term.radius.detach().numpy(), np.minimum(r, target), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(term.penalty.detach().numpy(), correct * np.maximum(0.0, target - r), rtol=1e-5,
                               atol=1e-6)
    # In the loss (RS at split 0), with its weight.
    config = TrainConfig(sigma=sigma, noise_samples=q, radius_weight=0.7, radius_target=target, radius_beta=beta)
    on, parts = splitz_loss(model, x, y, config, 0.8, None, torch.Generator().manual_seed(13),
                            training_noise=torch_training_noise)
    off, _ = splitz_loss(model, x, y, TrainConfig(sigma=sigma, noise_samples=q), 0.8, None,
                         torch.Generator().manual_seed(13), training_noise=torch_training_noise)
    assert parts["radius"] == pytest.approx(float(np.mean(correct * np.maximum(0.0, target - r))), rel=1e-5)
    assert float(on.detach()) == pytest.approx(float(off.detach()) + 0.7 * parts["radius"], rel=1e-6)


# ------------------------------------------------------------------------------------------------ 5. command line
def test_cli_options_set_the_config_and_bad_values_are_one_line_errors(tmp_path, capsys):
    args = build_parser().parse_args(["train", "mnist", "lenet", str(tmp_path / "r"), "--sigma", "0.5",
                                      "--radius-weight", "0.4", "--radius-target", "1.5", "--radius-beta", "8",
                                      "--radius-ramp-fraction", "0.25"])
    config = _train_config(args, _TRAIN_OPTIONS)
    assert (config.radius_weight, config.radius_target, config.radius_beta, config.radius_ramp_fraction) == (
        0.4, 1.5, 8.0, 0.25)
    defaults = _train_config(build_parser().parse_args(["train", "mnist", "lenet", str(tmp_path / "d"), "--sigma",
                                                        "0.5"]), _TRAIN_OPTIONS)
    assert (defaults.radius_weight, defaults.radius_target, defaults.radius_beta, defaults.radius_ramp_fraction) == (
        0.0, 2.0, 16.0, 0.5)
    for option, value in (("--radius-weight", "-1"), ("--radius-target", "0"), ("--radius-target", "-2"),
                          ("--radius-beta", "0"), ("--radius-beta", "-16"), ("--radius-ramp-fraction", "1.5")):
        assert main(["train", "mnist", "lenet", str(tmp_path / "bad"), "--sigma", "0.5", option, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {option} ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "bad").exists()


def test_cli_training_on_mnist_logs_the_radius_term(tmp_path):
    common = ["--sigma", "0.5", "--epochs", "1", "--batch", "16", "--max-batches", "2", "--val-fraction", "0.002"]
    assert main(["train", "mnist", "lenet", str(tmp_path / "r"), "--radius-weight", "0.5", "--radius-target", "1.0",
                 *common]) == 0
    record = json.loads((tmp_path / "r" / "train.log").read_text().splitlines()[0])
    assert math.isfinite(record["train_radius"]) and record["train_radius"] >= 0
    assert math.isfinite(record["train_soft_radius"]) and record["radius_weight"] == pytest.approx(0.5)
    ckpt = load_checkpoint_file(tmp_path / "r" / "last.pt")
    assert ckpt["config"]["radius_weight"] == 0.5 and ckpt["config"]["radius_target"] == 1.0


def test_the_terms_gradient_reaches_the_detectors_of_an_rs_initialised_model():
    """``lenet-rs-init`` a few steps after its RS start (detectors and f_R's extra columns slightly non-zero): the term
    alone sends gradient to the detector weights, through p̃_A and through L̃ alone (on the detectors' varying rows)."""
    torch.manual_seed(3)
    model = build_model("lenet-rs-init")
    detectors = model.left.layers[0].weight
    with torch.no_grad():
        detectors[1:].normal_(0.0, 0.02)
        model.right[0].weight[:, 1:].normal_(0.0, 0.02)
        list(model.right.parameters())[-2].mul_(100.0)  # a confident f_R: p̃_A > 1/2, so r̃ = R / L̃ involves L̃
    x = _digits(4, seed=7)
    with torch.no_grad():  # labels the model's own top classes, so the soft classifier is right and the hinge is on
        y = model.right(model.left(x)).argmax(1)
    noisy = torch_training_noise(model.left(x), 2, 0.25, torch.Generator().manual_seed(0))
    logits = model.right(noisy)
    start = torch.full((4,), 1.0)
    for scores in (logits, logits.detach()):
        term = radius_penalty(model.left, x, y, scores, sigma=0.25, target=5.0, beta=16.0, start_lip=start)
        assert bool((term.correct & (term.penalty > 0) & (term.radius < term.gamma)).any())  # r̃ = R / L̃ there
        (grad,) = torch.autograd.grad(term.penalty.sum(), [detectors], retain_graph=True)
        assert float(grad[1:].abs().sum()) > 0, "no gradient on the detector channels"
