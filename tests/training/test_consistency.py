"""Consistency regularization (Jeong & Shin, NeurIPS 2020) as a training option: the term against a direct float64
computation, its gradients where probabilities underflow, its place in the SPLITZ loss at split 0 and split 1, the
recipe, the config's checks and checkpoints written before the option existed."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import splitz_fast as sz
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loop import train
from splitz_fast.training.loss import consistency_penalty, splitz_loss, torch_training_noise
from splitz_fast.training.recipes import recipe_config


def _direct(logits: torch.Tensor, batch: int) -> tuple[list[float], list[float]]:
    """mean_j KL(p̂ ‖ p_j) and H(p̂) per input by explicit loops over the draws and classes, in float64."""
    m = logits.shape[0] // batch
    rows = logits.double().tolist()
    kls, entropies = [], []
    for i in range(batch):
        probs = []
        for j in range(m):
            row = rows[i * m + j]
            top = max(row)
            total = sum(math.exp(v - top) for v in row)
            probs.append([math.exp(v - top) / total for v in row])
        mean = [sum(p[c] for p in probs) / m for c in range(len(row))]
        entropies.append(-sum(q * math.log(q) for q in mean if q > 0))
        kls.append(sum(sum(q * (math.log(q) - math.log(p[c])) for c, q in enumerate(mean) if q > 0)
                       for p in probs) / m)
    return kls, entropies


@pytest.mark.parametrize("m", [2, 3, 5])
def test_the_term_is_the_mean_kl_to_the_mean_prediction_and_its_entropy(m):
    batch = 4
    logits = 3.0 * torch.randn(batch * m, 10, generator=torch.Generator().manual_seed(m))
    kl, entropy = consistency_penalty(logits, batch)
    want_kl, want_entropy = _direct(logits, batch)
    assert kl.shape == entropy.shape == (batch,)
    assert kl.tolist() == pytest.approx(want_kl, rel=1e-5, abs=1e-6)
    assert entropy.tolist() == pytest.approx(want_entropy, rel=1e-5, abs=1e-6)
    assert min(want_kl) > 1e-3  # distinct draws: the KL is not trivially 0


def test_draws_that_agree_cost_no_kl_and_one_draw_is_exactly_its_own_mean():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    kl, entropy = consistency_penalty(logits.repeat_interleave(4, dim=0), 3)
    assert kl.abs().max() < 1e-6
    one_kl, one_entropy = consistency_penalty(logits, 3)
    assert torch.equal(one_kl, torch.zeros(3))
    p = logits.double().softmax(1)
    assert one_entropy.tolist() == pytest.approx((-(p * p.log()).sum(1)).tolist(), rel=1e-5)
    assert entropy.tolist() == pytest.approx(one_entropy.tolist(), rel=1e-5)


def test_gradients_stay_finite_where_probabilities_underflow():
    """Logits 10³ apart: most probabilities are 0 in float32, where p log p on the probabilities is 0 · (−∞)."""
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 1000.0, -1000.0], [-1000.0, 0.0, 1000.0], [5.0, 0.0, 0.0]],
                          requires_grad=True)
    kl, entropy = consistency_penalty(logits, 2)
    assert torch.isfinite(kl).all() and torch.isfinite(entropy).all()
    assert kl[0] > 100  # the two draws of input 0 disagree with certainty
    (kl.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_logits_that_do_not_split_into_draws_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"logits must be \[batch · m, C\] with m draws per input: \(5, 10\) for 2"):
        consistency_penalty(torch.zeros(5, 10), 2)


def _batch(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _noisy_logits(model, x, config, seed):
    noisy = torch_training_noise(model.left(x), config.noise_samples, config.sigma, torch.Generator().manual_seed(seed))
    return model.right(noisy)


def test_without_the_weights_the_loss_is_the_plain_noisy_cross_entropy_bitwise():
    torch.manual_seed(0)
    model = sz.lenet(split_index=0)
    x, y = _batch()
    for q in (1, 2):
        config = TrainConfig(sigma=0.5, noise_samples=q, lambda_start=0.0, lambda_end=0.0)
        loss, parts = splitz_loss(model, x, y, config, 0.0, None, torch.Generator().manual_seed(1),
                                  training_noise=torch_training_noise)
        plain = F.cross_entropy(_noisy_logits(model, x, config, 1), y.repeat_interleave(q))
        assert torch.equal(loss, plain) and "consistency_kl" not in parts


def test_at_split_0_the_loss_is_cross_entropy_plus_both_terms():
    torch.manual_seed(0)
    model = sz.lenet(split_index=0)
    x, y = _batch()
    config = TrainConfig(sigma=0.5, noise_samples=2, lambda_start=0.0, lambda_end=0.0, consistency_lambda=20.0,
                         consistency_eta=0.5)
    loss, parts = splitz_loss(model, x, y, config, 0.0, None, torch.Generator().manual_seed(1),
                              training_noise=torch_training_noise)
    logits = _noisy_logits(model, x, config, 1)
    kl, entropy = _direct(logits.detach(), x.shape[0])
    ce = float(F.cross_entropy(logits.detach(), y.repeat_interleave(2)))
    assert float(loss.detach()) == pytest.approx(ce + 20.0 * sum(kl) / len(kl) + 0.5 * sum(entropy) / len(entropy), rel=1e-5)
    assert parts["ce"] == pytest.approx(ce, rel=1e-6)
    assert parts["consistency_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-3, abs=1e-8)  # float32: KL ≈ 6e-5 here
    assert parts["consistency_entropy"] == pytest.approx(sum(entropy) / len(entropy), rel=1e-5)


def test_at_split_1_the_paper_hinge_weighs_the_terms_with_the_cross_entropy():
    """Noise on f_L(x): the terms join the cross-entropy that (1 − λ) weighs; the hinge is unchanged."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=1)
    x, y = _batch()
    lam = 0.6
    plain = TrainConfig(sigma=0.5, noise_samples=2)
    config = TrainConfig(sigma=0.5, noise_samples=2, consistency_lambda=3.0, consistency_eta=0.5)
    # No warm start: the estimate's random start comes from the generator, the same seed in both losses.
    losses = [splitz_loss(model, x, y, c, lam, None, torch.Generator().manual_seed(1),
                          training_noise=torch_training_noise)[0] for c in (plain, config)]
    kl, entropy = _direct(_noisy_logits(model, x, config, 1).detach(), x.shape[0])
    extra = 3.0 * sum(kl) / len(kl) + 0.5 * sum(entropy) / len(entropy)
    assert float((losses[1] - losses[0]).detach()) == pytest.approx((1 - lam) * extra, rel=1e-4)
    losses[1].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.left.layers[0].weight.grad.abs().sum() > 0  # the terms reach f_L through the noisy latent


@pytest.mark.parametrize("split", [0, 1])
def test_training_steps_run_and_log_the_terms(tmp_path, split):
    x, y = _batch(n=48)
    torch.manual_seed(0)
    model = sz.lenet(split_index=split)
    before = copy.deepcopy(model.state_dict())
    config = TrainConfig(sigma=0.5, epochs=1, batch_size=16, val_fraction=0.25, lr_schedule="none", noise_samples=2,
                         consistency_lambda=20.0, consistency_eta=0.5,
                         lambda_start=0.8 if split else 0.0, lambda_end=0.4 if split else 0.0)
    result = train(model, TensorDataset(x, y), config, tmp_path, model_spec={"name": "lenet"})
    record = result.history[0]
    assert math.isfinite(record["train_loss"]) and record["train_consistency_kl"] > 0
    assert 0 < record["train_consistency_entropy"] <= math.log(10) + 1e-6
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    ckpt = load_checkpoint_file(tmp_path / "last.pt")
    assert ckpt["config"]["consistency_lambda"] == 20.0 and ckpt["config"]["consistency_eta"] == 0.5


def test_checkpoints_written_before_the_option_resume_without_it(tmp_path):
    x, y = _batch(n=32)
    config = TrainConfig(sigma=0.5, epochs=2, batch_size=16, val_fraction=0.25, lr_schedule="none")
    torch.manual_seed(0)
    train(sz.lenet(split_index=0), TensorDataset(x, y), config, tmp_path, model_spec={"name": "lenet"},
          stop_after_epochs=1)
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    for key in ("consistency_lambda", "consistency_eta"):
        del ckpt["config"][key]  # as written before these fields existed
    torch.save(ckpt, tmp_path / "last.pt")
    torch.manual_seed(0)
    result = train(sz.lenet(split_index=0), TensorDataset(x, y), config, tmp_path, model_spec={"name": "lenet"},
                   resume=True)
    assert [r["epoch"] for r in result.history] == [0, 1] and "train_consistency_kl" not in result.history[1]
    # A run with the terms on is another run: resuming it from that checkpoint is refused by name.
    with pytest.raises(ValueError, match="consistency_lambda"):
        train(sz.lenet(split_index=0), TensorDataset(x, y),
              TrainConfig(**{**config.__dict__, "noise_samples": 2, "consistency_lambda": 1.0}), tmp_path,
              model_spec={"name": "lenet"}, resume=True)


def test_the_recipe_holds_the_published_mnist_settings():
    config = recipe_config("consistency")
    assert (config.noise_samples, config.consistency_lambda, config.consistency_eta) == (2, 20.0, 0.5)
    assert config.lambda_start == config.lambda_end == 0.0
    assert recipe_config("consistency", consistency_lambda=5.0).consistency_lambda == 5.0


@pytest.mark.parametrize("fields, message", [
    ({"consistency_lambda": -1.0}, "consistency_lambda must be a finite number >= 0, got -1.0"),
    ({"consistency_eta": float("nan")}, "consistency_eta must be a finite number >= 0, got nan"),
    ({"consistency_lambda": 1.0}, "noise_samples must be >= 2 where the consistency terms are on"),
    ({"consistency_eta": 0.5}, "noise_samples must be >= 2 where the consistency terms are on"),
])
def test_bad_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        TrainConfig(sigma=0.5, **fields).validate()
    assert "\n" not in str(err.value)
