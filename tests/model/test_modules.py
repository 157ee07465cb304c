"""Model pieces: ClippedReLU, Standardize, LeftHalf, SplitModel and split_sequential, and their input checks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz


def test_clipped_relu_scalar_channel_and_element_thresholds():
    z = torch.linspace(-2, 3, 2 * 3 * 2 * 2).view(2, 3, 2, 2)
    scalar = sz.ClippedReLU(1.0)
    assert torch.equal(scalar(z), z.clamp(0, 1))
    per_channel = sz.ClippedReLU(1.0, shape=(3,))
    per_channel.threshold.copy_(torch.tensor([0.5, 1.0, 2.0]))
    expected = torch.stack([z[:, c].clamp(0, t) for c, t in enumerate([0.5, 1.0, 2.0])], dim=1)
    assert torch.equal(per_channel(z), expected)
    per_element = sz.ClippedReLU(1.0, shape=(3, 2, 2))
    per_element.threshold.copy_(torch.rand(3, 2, 2))
    assert torch.equal(per_element(z), torch.minimum(z.clamp_min(0), per_element.threshold))
    relu = sz.ClippedReLU(math.inf)
    assert torch.equal(relu(z), torch.relu(z))


def test_clipped_relu_learnable_threshold_gets_gradient_and_projection():
    act = sz.ClippedReLU(0.5, shape=(2,), learnable=True)
    z = torch.tensor([[0.2, 3.0], [1.0, -1.0]])
    act(z).sum().backward()
    assert act.threshold.grad.tolist() == [1.0, 1.0]  # the clipped entries z=1.0 and z=3.0
    with torch.no_grad():
        act.threshold.sub_(1.0)
    with pytest.raises(ValueError, match="negative"):
        act.check_valid()
    act.project_()
    assert act.threshold.min() >= 0


@pytest.mark.parametrize("bad", [-0.1, float("nan")])
def test_clipped_relu_rejects_bad_threshold(bad):
    with pytest.raises(ValueError, match="threshold"):
        sz.ClippedReLU(bad)


def test_standardize_rejects_bad_std_and_length_mismatch():
    with pytest.raises(ValueError, match="std"):
        sz.Standardize([0.5, 0.5], [0.2, 0.0])
    with pytest.raises(ValueError, match="same length"):
        sz.Standardize([0.5], [0.2, 0.3])


def test_left_half_rejects_non_affine_layers_and_bad_activations():
    with pytest.raises(TypeError, match="Conv2d and nn.Linear"):
        sz.LeftHalf([nn.BatchNorm2d(3)], [None])
    with pytest.raises(TypeError, match="ClippedReLU"):
        sz.LeftHalf([nn.Linear(3, 3)], [nn.ReLU()])
    with pytest.raises(ValueError, match="activations"):
        sz.LeftHalf([nn.Linear(3, 3)], [None, None])
    with pytest.raises(ValueError, match="groups"):
        sz.LeftHalf([nn.Conv2d(4, 4, 3, groups=2)], [None])
    # string padding, in any layer (the bounds read the padding as numbers)
    for padding in ("same", "valid"):
        with pytest.raises(ValueError, match=f"integer padding, got padding='{padding}'"):
            sz.LeftHalf([nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(2, 3, 3, padding=padding)],
                        [sz.ClippedReLU(1.0), None], input_shape=(1, 6, 5))


def _net():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 6), nn.ReLU(), nn.Linear(6, 3),
    )


@pytest.mark.parametrize("split_index", [0, 1, 2, 3, 4])
def test_split_sequential_preserves_the_function_with_infinite_thresholds(split_index):
    torch.manual_seed(0)
    net = _net().eval()
    std = sz.Standardize([0.5], [0.25])
    model = sz.split_sequential(net, split_index, num_classes=3, input_shape=(1, 8, 8), standardize=std,
                                threshold=math.inf)
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), net(std(x)), atol=1e-6)
    assert model.split_index == split_index
    assert model.left.depth == split_index
    if split_index == 0:
        assert model.left.standardize is None  # RS: noise on the raw input, standardization inside f_R


class _ForwardNet(nn.Module):
    """The usual PyTorch style: the activation is written in forward, not a module."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _SequentialWithItsOwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) + self[0](x)[:, :3]


@pytest.mark.parametrize("network", [_ForwardNet, lambda: _SequentialWithItsOwnForward(
    nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))], ids=["module", "sequential-subclass"])
def test_split_sequential_refuses_a_network_whose_forward_it_cannot_see(network):
    """Before: split from children(), the ReLU in forward (or the extra term) silently dropped — a different
    classifier, certified."""
    with pytest.raises(TypeError, match="needs a plain nn.Sequential .* build the halves yourself"):
        sz.split_sequential(network(), 1, num_classes=3, input_shape=(6,), threshold=float("inf"))


def test_split_sequential_uses_clipped_relu_threshold_and_rejects_other_modules_inside_f_l():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(2, 2, 4), nn.ReLU(), nn.Flatten())
    model = sz.split_sequential(net, 1, num_classes=2, input_shape=(1, 10, 10), threshold=0.7)
    assert float(model.left.activation(0).threshold) == pytest.approx(0.7)
    assert isinstance(model.right[0], nn.MaxPool2d)  # a pool after the last layer of f_L stays in f_R
    model = sz.split_sequential(net, 2, num_classes=2, input_shape=(1, 10, 10))
    assert model.left.pool(0) is not None and [type(m) for m in model.right] == [nn.Flatten]  # the ReLU joined f_L
    for other in (nn.AvgPool2d(2), nn.BatchNorm2d(2), nn.Dropout()):
        bad = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), other, nn.Conv2d(2, 2, 3), nn.ReLU())
        with pytest.raises(ValueError, match=type(other).__name__):
            sz.split_sequential(bad, 2, num_classes=2, input_shape=(1, 10, 10))
    with pytest.raises(ValueError, match="split_index"):
        sz.split_sequential(net, 3, num_classes=2, input_shape=(1, 10, 10))


def test_split_sequential_says_what_to_do_with_nested_blocks_and_a_normalisation_in_front():
    import torchvision.transforms as T

    nested = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 3)))
    with pytest.raises(ValueError, match=r"\[0, 0\] .*0 affine layers at its top level.*modules \[0, 1\] hold "
                                         r"layers of their own.*flatten nested blocks"):
        sz.split_sequential(nested, 1, num_classes=3, input_shape=(6,))
    partly = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.ReLU()), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"module 1 \(Sequential\).*flatten nested blocks"):
        sz.split_sequential(partly, 2, num_classes=3, input_shape=(6,))
    for front in (T.Normalize((0.1,), (0.3,)), sz.Standardize((0.1,), (0.3,))):
        net = nn.Sequential(front, nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
        with pytest.raises(ValueError, match=r"module 0 \(\w+\).*standardize=Standardize\(mean, std\)"):
            sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 6, 6))
    with pytest.raises(ValueError) as plain:  # no hint where none applies
        sz.split_sequential(nn.Sequential(nn.Linear(6, 8), nn.Dropout(), nn.Linear(8, 3)), 2, num_classes=3,
                            input_shape=(6,))
    assert "standardize" not in str(plain.value) and "nested" not in str(plain.value)


@pytest.mark.parametrize("split_index", [0, 1])
def test_split_sequential_refuses_an_input_shape_the_network_cannot_take(split_index):
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 32 * 32, 3))
    with pytest.raises(ValueError, match=r"input_shape=\(3, 32, 32\) does not fit the network \(its first layer, "
                                         r"Conv2d\(1, 4, .*\), takes 1-channel images"):
        sz.split_sequential(net, split_index, num_classes=3, input_shape=(3, 32, 32))
    with pytest.raises(ValueError, match=r"input_shape=\(1, 28, 28\) does not fit"):  # f_R's Linear: another size
        sz.split_sequential(net, split_index, num_classes=3, input_shape=(1, 28, 28))
    mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"input_shape=\(5,\) .* takes 4 features"):
        sz.split_sequential(mlp, split_index, num_classes=2, input_shape=(5,))


def test_split_sequential_checks_the_input_shape_without_changing_the_network():
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(4 * 8 * 8),
                        nn.Dropout(0.5), nn.Linear(4 * 8 * 8, 3))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    model = sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 8, 8))
    assert net.training and model.training  # modes restored
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())  # BatchNorm statistics untouched


def test_split_model_never_adds_noise():
    torch.manual_seed(0)
    model = sz.split_sequential(_net(), 1, num_classes=3, input_shape=(1, 8, 8)).eval()
    x = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_ball_bounds_and_lipschitz_bound_check_gamma_and_method():
    left = sz.LeftHalf([nn.Linear(3, 2)], [sz.ClippedReLU(1.0)], input_shape=(3,))
    x = torch.rand(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        sz.ball_bounds(left, x, -0.1)
    with pytest.raises(ValueError, match="gamma"):
        sz.ball_bounds(left, x, float("nan"))
    with pytest.raises(ValueError, match="one value per input"):
        sz.ball_bounds(left, x, torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="method"):
        sz.lipschitz_bound(left, x, 0.1, method="power")
    per_input = sz.lipschitz_bound(left, x, torch.tensor([0.0, 10.0]))
    assert per_input.gamma.tolist() == [0.0, 10.0]


def test_bounds_reject_bad_inputs():
    left = sz.LeftHalf([nn.Linear(3, 2)], [sz.ClippedReLU(1.0)], input_shape=(3,))
    with pytest.raises(ValueError, match="NaN or Inf"):
        sz.lipschitz_bound(left, torch.tensor([[0.0, float("nan"), 1.0]]), 0.1)
    with pytest.raises(ValueError, match="expects inputs of shape"):
        sz.lipschitz_bound(left, torch.rand(2, 4), 0.1)
    with pytest.raises(ValueError, match="dimensions"):
        sz.lipschitz_bound(left, torch.rand(3), 0.1)
    with pytest.raises(TypeError, match="floating-point"):
        sz.lipschitz_bound(left, torch.ones(1, 3, dtype=torch.long), 0.1)
