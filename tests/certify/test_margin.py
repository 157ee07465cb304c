"""The margin certificate of a classifier that lies entirely in f_L (the Lipschitz-only baseline): never above the
closed-form radius of a linear classifier, never broken by an attack inside it, and refused where it would not
hold (a non-empty f_R)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz


def test_linear_classifier_radius_is_sound_and_tight_in_the_binary_case():
    """For f(x) = Wx + b the exact l2 radius is min_j (z_y − z_j)/‖w_y − w_j‖. Ours, m/(√2‖W‖), never exceeds it, and
    with two classes and w_1 = −w_0 it is exact (‖w_0 − w_1‖ = 2‖w_0‖ = √2·‖W‖)."""
    torch.manual_seed(0)
    for classes, antisymmetric in ((2, True), (2, False), (5, False)):
        layer = nn.Linear(6, classes)
        if antisymmetric:
            with torch.no_grad():
                layer.weight[1] = -layer.weight[0]
                layer.bias[1] = -layer.bias[0]
        model = sz.SplitModel(sz.LeftHalf([layer], [None], input_shape=(6,)), nn.Sequential(), classes)
        certifier = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound_method="exact"))
        w, b = layer.weight.detach().double(), layer.bias.detach().double()
        for _ in range(10):
            x = torch.randn(6)
            result = certifier.certify(x, seed=0)
            z = w @ x.double() + b
            y = int(z.argmax())
            exact = min(float((z[y] - z[j]) / (w[y] - w[j]).norm()) for j in range(classes) if j != y)
            assert result.prediction == y and result.bound_kind == "local-exact" and result.failure_prob == 0.0
            assert 0 < result.radius <= exact * (1 + 1e-9)
            if antisymmetric:
                assert result.radius == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_no_attack_inside_the_certified_radius_changes_the_prediction(seed):
    torch.manual_seed(seed)
    model = sz.tabular_mlp(4, num_classes=3, hidden=(16, 16), split_index=3).eval()
    certifier = sz.MarginCertifier(model)
    for _ in range(5):
        x = torch.randn(4)
        result = certifier.certify(x, seed=0)
        if result.prediction < 0 or result.radius == 0:
            continue
        # Projected gradient ascent on the best other logit minus the predicted one, inside the certified ball.
        delta = torch.zeros(4, requires_grad=True)
        for _ in range(100):
            logits = model.left((x + delta).unsqueeze(0))[0]
            others = torch.cat([logits[:result.prediction], logits[result.prediction + 1:]])
            gap = others.max() - logits[result.prediction]
            (grad,) = torch.autograd.grad(gap, delta)
            with torch.no_grad():
                delta += 0.05 * result.radius * grad / grad.norm().clamp_min(1e-12)
                delta *= min(1.0, result.radius / float(delta.norm().clamp_min(1e-12)))
        with torch.no_grad():
            assert int(model.left((x + delta).unsqueeze(0))[0].argmax()) == result.prediction


def test_margin_certifier_refuses_models_it_cannot_certify():
    with pytest.raises(ValueError, match="whole classifier in f_L"):
        sz.MarginCertifier(sz.tabular_mlp(4, hidden=(8,), split_index=1))
    with pytest.raises(ValueError, match="whole classifier in f_L"):
        sz.MarginCertifier(sz.tabular_mlp(4, hidden=(8,), split_index=0))
    whole = sz.tabular_mlp(4, hidden=(8,), split_index=2)
    with pytest.raises(TypeError, match="sigma"):
        sz.MarginCertifier(whole, sigma=0.5)
    assert not hasattr(sz.MarginCertifier(whole), "predict")  # it certifies the network itself: model(x).argmax
    # A tie at the top logit abstains.
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    tied = sz.SplitModel(sz.LeftHalf([layer], [None], input_shape=(3,)), nn.Sequential(), 2)
    result = sz.MarginCertifier(tied).certify(torch.randn(3), seed=0)
    assert result.prediction == sz.ABSTAIN and result.radius == 0.0 and math.isnan(result.p_a_lower)


def test_the_float64_copy_follows_weight_changes():
    """The certifier caches a float64 copy of f_L; a changed weight must change the certificate, never reuse it."""
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
        layer.bias.zero_()
    model = sz.SplitModel(sz.LeftHalf([layer], [None], input_shape=(2,)), nn.Sequential(), 2)
    certifier = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound_method="exact"))
    x = torch.tensor([1.0, 0.0])
    first = certifier.certify(x, seed=0)
    assert first.prediction == 0 and first.radius == pytest.approx(1.0, rel=1e-6)  # (1 − (−1)) / ‖w_0 − w_1‖ = 1
    with torch.no_grad():
        layer.weight.mul_(-1)  # the prediction flips
    second = certifier.certify(x, seed=0)
    assert second.prediction == 1 and second.radius == pytest.approx(1.0, rel=1e-6)
