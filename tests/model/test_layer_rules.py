"""The layer rules of f_L (splitz_fast.model.layers): each rule against torch's own module — the forward, the linear
part, the adjoint against autograd's vector-Jacobian product, the BatchNorm fold against bn(layer(x)) — the
registry's refusals, and the float64 fold."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from splitz_fast.model.layers import (AFFINE_KINDS, Conv2dRule, LinearBatchNorm1d, LinearRule, find_rule,
                                      fold_batchnorm_into, folding_rule, rule_for)
from splitz_fast.model.modules import check_affine
from splitz_fast.zoo.models import fold_batchnorm
from _helpers import kernel_devices

# (layer, one input [B, ...]) per rule: a strided, dilated, padded convolution; a linear layer on an image.
CASES = {
    "conv2d": (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=(1, 2), dilation=(1, 2)), (2, 3, 9, 8)),
    "linear": (lambda: nn.Linear(2 * 3 * 4, 7), (2, 2, 3, 4)),
}


def _case(name: str, dtype=torch.float64):
    torch.manual_seed(0)
    build, shape = CASES[name]
    return build().to(dtype), torch.randn(shape, dtype=dtype)


def _randomized(bn: nn.modules.batchnorm._BatchNorm):
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn.eval()


def test_the_registry_finds_one_rule_per_kind_and_refuses_the_rest_in_one_line():
    assert AFFINE_KINDS == (nn.Conv2d, nn.Linear)
    assert isinstance(rule_for(nn.Conv2d(1, 1, 1)), Conv2dRule) and isinstance(rule_for(nn.Linear(1, 1)), LinearRule)
    assert find_rule(nn.ReLU()) is None and folding_rule(nn.ReLU()) is None
    assert isinstance(folding_rule(nn.Conv3d(1, 1, 1)), Conv2dRule)  # f_R's other convolutions fold alike
    for layer in (nn.Conv1d(1, 1, 1), nn.Bilinear(2, 2, 2), nn.BatchNorm2d(3)):
        with pytest.raises(TypeError, match=r"^f_L may hold only nn.Conv2d and nn.Linear layers, got "
                                            rf"{type(layer).__name__}; move it into f_R") as err:
            rule_for(layer)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", CASES)
def test_apply_and_linear_part_are_the_modules_own_forward(name):
    layer, x = _case(name)
    rule = rule_for(layer)
    h = rule.layer_input(x)
    assert h.ndim == (2 if name == "linear" else 4)
    torch.testing.assert_close(rule.apply(layer, h), layer(h), rtol=0, atol=0)
    bias = layer.bias.view(1, -1, *([1] * (h.ndim - 2)))
    torch.testing.assert_close(rule.linear_part(layer, x, layer.weight) + bias, layer(h), rtol=1e-12, atol=1e-12)
    assert rule.out_features(layer) == layer(h).shape[1] == layer.weight.shape[0]


@pytest.mark.parametrize("name", CASES)
def test_the_adjoint_is_autograds_vector_jacobian_product(name):
    layer, x = _case(name)
    rule = rule_for(layer)
    x = x.requires_grad_()
    out = rule.linear_part(layer, x, layer.weight.detach())
    u = torch.randn_like(out)
    (vjp,) = torch.autograd.grad(out, x, u)
    adjoint = rule.adjoint(layer, u, layer.weight.detach(), tuple(x.shape[1:]))
    assert adjoint.shape == x.shape
    torch.testing.assert_close(adjoint, vjp, rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("name", CASES)
def test_the_fused_masked_products_are_the_masked_linear_part_and_adjoint(name, device):
    """``masked_apply`` = ``m_out ⊙ (W (f ⊙ v))`` and ``masked_adjoint`` = ``f ⊙ (Wᵀ (m_out ⊙ u))``, by the Triton op
    of the kind against the rule's own linear part and adjoint."""
    layer, x = _case(name)
    layer, x = layer.to(device), x.to(device)
    rule = rule_for(layer)
    in_shape = tuple(x.shape[1:])
    w = layer.weight.detach()
    out = rule.linear_part(layer, x, w)
    gen = torch.Generator().manual_seed(3)
    out_mask = (torch.rand(out.shape, generator=gen) > 0.4).double().to(device)
    in_factor = (torch.rand(x.shape, generator=gen) * (torch.rand(x.shape, generator=gen) > 0.3)).double().to(device)
    u = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    forward = rule.masked_apply(layer, x, w, out_mask=out_mask, in_factor=in_factor)
    torch.testing.assert_close(forward, out_mask * rule.linear_part(layer, in_factor * x, w), rtol=1e-12, atol=1e-12)
    back = rule.masked_adjoint(layer, u, w, out_mask=out_mask, in_factor=in_factor, in_shape=in_shape)
    torch.testing.assert_close(back, in_factor * rule.adjoint(layer, out_mask * u, w, in_shape), rtol=1e-12,
                               atol=1e-12)


def test_the_conv2d_rule_refuses_what_the_bounds_do_not_model():
    with pytest.raises(ValueError, match="groups=1 and padding_mode='zeros'"):
        check_affine(nn.Conv2d(2, 2, 3, groups=2))
    with pytest.raises(ValueError, match="groups=1 and padding_mode='zeros'"):
        check_affine(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="integer padding, got padding='same'"):
        check_affine(nn.Conv2d(2, 2, 3, padding="same"))

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    class OwnConvForward(nn.Conv2d):
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, 2 * weight, bias)

    for layer, base in ((OwnForward(2, 2), "Linear"), (OwnConvForward(1, 1, 1), "Conv2d")):
        with pytest.raises(TypeError, match=f"overrides {base}.forward"):
            check_affine(layer)
    assert isinstance(check_affine(nn.Conv2d(1, 2, 3, padding=1)), Conv2dRule)


@pytest.mark.parametrize("layer, bn, shape", [
    (nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), (2, 3, 7, 7)),
    (nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), (2, 3, 6, 6)),
    (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), (2, 3, 8)),
    (nn.Linear(5, 4), nn.BatchNorm1d(4), (3, 5)),
    (nn.Linear(5, 4), nn.BatchNorm1d(4), (3, 4, 5)),  # 3-D: the BatchNorm normalizes dim 1, not the features
], ids=["conv2d", "conv2d-no-bias", "conv1d", "linear", "linear-3d"])
def test_the_fold_is_bn_after_the_layer(layer, bn, shape):
    torch.manual_seed(1)
    layer, bn = layer.double(), _randomized(bn).double()
    x = torch.randn(shape, dtype=torch.float64)
    folded = fold_batchnorm_into(layer, bn)
    torch.testing.assert_close(folded(x), bn(layer(x)), rtol=1e-12, atol=1e-12)
    assert type(folded) is (LinearBatchNorm1d if isinstance(layer, nn.Linear) else type(layer))
    assert not folded.training


def test_the_fold_computes_in_float64_and_rounds_once_to_the_layers_dtype():
    torch.manual_seed(2)
    conv, bn = nn.Conv2d(2, 3, 3), _randomized(nn.BatchNorm2d(3))
    folded = fold_batchnorm(conv, bn)
    scale = (bn.weight.double() / (bn.running_var.double() + bn.eps).sqrt())
    weight = (conv.weight.double() * scale.view(-1, 1, 1, 1)).float()
    bias = ((conv.bias.double() - bn.running_mean.double()) * scale + bn.bias.double()).float()
    assert folded.weight.dtype == torch.float32 and type(folded) is nn.Conv2d
    torch.testing.assert_close(folded.weight, weight, rtol=0, atol=0)
    torch.testing.assert_close(folded.bias, bias, rtol=0, atol=1e-7)


def test_the_fold_refuses_a_pair_it_cannot_fold_in_one_line():
    with pytest.raises(ValueError, match="running statistics"):
        fold_batchnorm(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, track_running_stats=False))
    with pytest.raises(ValueError, match="BatchNorm has 3 features but the convolution has 2 outputs"):
        fold_batchnorm(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(3))
    with pytest.raises(TypeError, match="folds into a convolution or nn.Linear, got ReLU"):
        fold_batchnorm_into(nn.ReLU(), nn.BatchNorm2d(3))
