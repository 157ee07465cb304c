"""split_sequential refuses a split that would leave f_L's last layer without the module of its block (it would move
behind the noise), and a num_classes the network's logits do not have."""
import pytest
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.zoo.models import fold_batchnorm


def _conv_net(*block: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 2, 3), *block, nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


@pytest.mark.parametrize("block, fix", [
    ((nn.BatchNorm2d(2), nn.ReLU()), r"fold it into the layer before it \(splitz_fast\.zoo\.models\.fold_batchnorm"),
    ((nn.Sigmoid(),), r"split before that layer \(a smaller split_index\)$"),
    ((nn.MaxPool2d(1), nn.ReLU()), r"put the ReLU before the pool"),
], ids=["batchnorm", "sigmoid", "pool-then-relu"])
def test_a_split_inside_a_layers_block_is_refused_in_one_line(block, fix):
    name = type(block[0]).__name__
    with pytest.raises(ValueError, match=rf"^module 1 \({name}\) follows f_L's last affine layer.*only by a ReLU or "
                                         rf"ClippedReLU .*{fix}") as refused:
        sz.split_sequential(_conv_net(*block), 1, num_classes=3, input_shape=(1, 6, 6))
    assert "\n" not in str(refused.value)


def test_a_split_at_a_layer_boundary_is_still_accepted():
    relu = sz.split_sequential(_conv_net(nn.ReLU(), nn.BatchNorm2d(2)), 1, num_classes=3, input_shape=(1, 6, 6))
    assert relu.left.activation(0) is not None and isinstance(relu.right[0], nn.BatchNorm2d)
    affine = sz.split_sequential(_conv_net(), 1, num_classes=3, input_shape=(1, 6, 6))  # Flatten, then a Linear
    assert affine.left.activation(0) is None
    whole = sz.split_sequential(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), 2, num_classes=2,
                                input_shape=(4,))
    assert whole.split_index == 2 and len(whole.right) == 0
    folded = nn.Sequential(fold_batchnorm(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2).eval()), nn.ReLU(),
                           nn.Flatten(), nn.Linear(32, 3))
    assert sz.split_sequential(folded, 1, num_classes=3, input_shape=(1, 6, 6)).left.activation(0) is not None


@pytest.mark.parametrize("split_index", [0, 1, 2])
def test_a_num_classes_the_logits_do_not_have_is_refused_at_the_split(split_index):
    mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"^num_classes=10 does not match the network: its output for one input has "
                                         r"shape \(1, 2\); pass num_classes=2$"):
        sz.split_sequential(mlp, split_index, num_classes=10, input_shape=(4,))
    assert sz.split_sequential(mlp, split_index, num_classes=2, input_shape=(4,)).num_classes == 2


def test_an_output_that_is_not_logits_is_refused_at_the_split():
    images = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 3, 1))
    with pytest.raises(ValueError, match=r"num_classes=3 .* shape \(1, 3, 4, 4\) \(logits \[batch, classes\]"):
        sz.split_sequential(images, 1, num_classes=3, input_shape=(1, 6, 6))
