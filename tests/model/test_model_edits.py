"""Certifiers certify the model as it is *now*: after a half is replaced, a piece of ``f_L`` swapped, a
batch-dependent ``f_R`` or a float64 input, every certifier either gives the result a freshly built one gives or
refuses with one clear error. Each case here certified something that did not hold before the fix."""
from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.bounds import certificate
from splitz_fast.certify.margin import MarginCertifier
from splitz_fast.certify.sequential import SequentialCertifier
from splitz_fast.bounds.radius import BoundOptions
from splitz_fast.certify.smoothing import ABSTAIN, CertifyResult, Smoother, about_given_input

SIGMA = 0.5
COUNTS = dict(n0=20, n=300, alpha=0.01)


def _image_model(bias_class: int = 0, seed: int = 0) -> sz.SplitModel:
    """Split 2 of conv-ReLU-pool-conv-ReLU-linear on 1×8×8 inputs: f_L holds a pool between its two layers. f_R's
    bias makes ``bias_class`` win by a wide margin, so inputs certify with a radius set by L."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                        nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():
        net[-1].bias.copy_(torch.nn.functional.one_hot(torch.tensor(bias_class), 3) * 6.0)
    return sz.split_sequential(net, 2, num_classes=3, input_shape=(1, 8, 8), threshold=1.0)


def _margin_model(seed: int = 0) -> sz.SplitModel:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        net[-1].bias.copy_(torch.tensor([3.0, 0.0, 0.0]))
    return sz.split_sequential(net, 2, num_classes=3, input_shape=(4,), threshold=float("inf"))


def _x(shape=(1, 8, 8), seed: int = 1) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _outcome(r: CertifyResult) -> dict:
    fields = dataclasses.asdict(r)
    fields.pop("seconds")
    return fields


def _scaled_left(model: sz.SplitModel, factor: float) -> sz.LeftHalf:
    left = copy.deepcopy(model.left)
    with torch.no_grad():
        left.layers[0].weight.mul_(factor)
    return left


def _right_for_class(model: sz.SplitModel, cls: int) -> nn.Module:
    right = copy.deepcopy(model.right)
    with torch.no_grad():
        right[-1].bias.copy_(torch.nn.functional.one_hot(torch.tensor(cls), 3) * 6.0)
    return right


EXACT = BoundOptions(bound_method="exact")
SMOOTHERS = {
    "bisection": EXACT,
    "one-step": BoundOptions(bound_method="exact", gamma_search="one-step"),
    "global": BoundOptions(bound="global", bound_method="exact"),
}


# ====================================================================== replacing a half
@pytest.mark.parametrize("options", SMOOTHERS.values(), ids=SMOOTHERS.keys())
def test_replacing_left_changes_the_bound_like_a_fresh_smoother(options):
    model, x = _image_model(), _x()
    smoother = Smoother(model, SIGMA, bound_options=options)
    before = smoother.certify(x, **COUNTS, seed=0)
    model.left = _scaled_left(model, 10.0)
    after = smoother.certify(x, **COUNTS, seed=0)
    fresh = Smoother(model, SIGMA, bound_options=options).certify(x, **COUNTS, seed=0)
    assert _outcome(after) == _outcome(fresh)
    assert after.lipschitz > 5 * before.lipschitz  # the bound is of the new, 10x steeper f_L


def test_replacing_right_samples_the_new_f_r():
    model, x = _image_model(bias_class=0), _x()
    smoother = Smoother(model, SIGMA)
    assert smoother.certify(x, **COUNTS, seed=0).prediction == 0
    model.right = _right_for_class(model, 1)
    after = smoother.certify(x, **COUNTS, seed=0)
    assert after.prediction == 1
    assert _outcome(after) == _outcome(Smoother(model, SIGMA).certify(x, **COUNTS, seed=0))
    assert smoother.predict(x, n=200, alpha=0.01, seed=0).prediction == 1


def test_sequential_certifier_reads_the_halves_at_each_call():
    model, x = _image_model(), _x()
    sequential = SequentialCertifier(Smoother(model, SIGMA), radii=[0.05, 0.2])
    sequential.certify(x, n0=20, budget=400, alpha=0.01, seed=0)
    model.left = _scaled_left(model, 10.0)
    model.right = _right_for_class(model, 2)
    after = sequential.certify(x, n0=20, budget=400, alpha=0.01, seed=0)
    fresh = SequentialCertifier(Smoother(model, SIGMA), radii=[0.05, 0.2]).certify(x, n0=20, budget=400, alpha=0.01,
                                                                                   seed=0)
    assert after.prediction == 2
    assert _outcome(after) == _outcome(fresh)


def test_margin_certifier_reads_the_halves_at_each_call():
    model, x = _margin_model(), _x((4,))
    certifier = MarginCertifier(model, bound_options=EXACT)
    before = certifier.certify(x, seed=0)
    model.left = _scaled_left(model, 10.0)
    after = certifier.certify(x, seed=0)
    assert _outcome(after) == _outcome(MarginCertifier(model, bound_options=EXACT).certify(x, seed=0))
    assert after.lipschitz > 5 * before.lipschitz
    model.right = nn.Linear(3, 3)  # a fresh certifier refuses this: the bound would not cover f_R
    with pytest.raises(ValueError, match="whole classifier in f_L"):
        certifier.certify(x, seed=0)
    with pytest.raises(ValueError, match="whole classifier in f_L"):
        MarginCertifier(model)


def test_margin_certifier_refuses_a_glue_subclass_that_computes():
    class Scale(nn.Sequential):
        def forward(self, z):
            return 10 * z

    model = _margin_model()
    model.right = Scale()
    with pytest.raises(ValueError, match="whole classifier in f_L"):
        MarginCertifier(model)


def test_attacker_predicts_with_the_current_f_r():
    model, x = _image_model(bias_class=0), _x()
    attacker = sz.Attacker(Smoother(model, SIGMA), attack="smooth-fgsm", eps=0.1, samples=4)
    assert next(attacker.attack_many([(x, 0)], n=200, alpha=0.01, seeds=[0])).clean_prediction == 0
    model.right = _right_for_class(model, 1)
    result = next(attacker.attack_many([(x, 1)], n=200, alpha=0.01, seeds=[0]))
    assert result.clean_prediction == 1


def test_editing_the_model_during_a_lazy_call_stops_it():
    model = _image_model()
    xs = torch.stack([_x(seed=s) for s in range(3)])
    results = Smoother(model, SIGMA).certify_many(xs, **COUNTS, seeds=[0, 1, 2])
    next(results)
    model.left = _scaled_left(model, 10.0)
    with pytest.raises(RuntimeError, match="edited while a certify/predict call was running"):
        next(results)


# ====================================================================== structure checked where it is used
def _bound(left: sz.LeftHalf, x: torch.Tensor) -> float:
    return float(sz.lipschitz_bound(left, x.unsqueeze(0), 0.1, method="exact").value[0])


def test_an_overlapping_pool_swapped_in_is_refused_by_every_bound():
    model, x = _image_model(), _x()
    smoother = Smoother(model, SIGMA)
    _bound(model.left, x)
    model.left.pools[0] = nn.MaxPool2d(3, 1, 1)  # overlapping windows: up to 3x the l2 gain, which the bound omits
    with pytest.raises(ValueError, match="non-overlapping"):
        _bound(model.left, x)
    with pytest.raises(ValueError, match="non-overlapping"):
        sz.global_lipschitz_bound(model.left, (1, 8, 8))
    with pytest.raises(ValueError, match="non-overlapping"):
        smoother.certify(x, **COUNTS, seed=0)
    with pytest.raises(ValueError, match="non-overlapping"):
        Smoother(model, SIGMA)


@pytest.mark.parametrize("activation", [nn.ReLU(), nn.Tanh(), nn.LeakyReLU()], ids=lambda m: type(m).__name__)
def test_an_unknown_activation_is_refused_not_read_as_the_identity(activation):
    model, x = _image_model(), _x()
    model.left.activations[0] = activation
    with pytest.raises(TypeError, match="ClippedReLU"):
        model.left.activation(0)
    with pytest.raises(TypeError, match="ClippedReLU"):
        _bound(model.left, x)
    with pytest.raises(TypeError, match="ClippedReLU"):
        Smoother(model, SIGMA)


def test_a_clipped_relu_subclass_with_its_own_forward_is_refused():
    class Doubled(sz.ClippedReLU):
        def forward(self, z):
            return 2 * super().forward(z)

    model, x = _image_model(), _x()
    model.left.activations[0] = Doubled(1.0)
    with pytest.raises(TypeError, match="ClippedReLU"):
        _bound(model.left, x)


@pytest.mark.parametrize("layer,error,match", [
    (nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"), ValueError, "padding_mode"),
    (nn.Conv2d(1, 4, 3, padding=1), None, None),
    (nn.BatchNorm2d(1), TypeError, "Conv2d and nn.Linear"),
], ids=["reflect-padding", "plain-conv", "batchnorm"])
def test_a_layer_swapped_in_is_checked_when_bounded(layer, error, match):
    model, x = _image_model(), _x()
    if error is None:  # a layer the bounds can read: accepted, and bounded like a LeftHalf built with it
        with torch.no_grad():
            layer.weight.normal_(generator=torch.Generator().manual_seed(0))
        model.left.layers[0] = layer
        left = model.left
        fresh = sz.LeftHalf(list(left.layers), [left.activation(k) for k in range(left.depth)],
                            input_shape=left.input_shape, pools=[left.pool(k) for k in range(left.depth)])
        assert _bound(left, x) == _bound(fresh, x)
        return
    model.left.layers[0] = layer
    with pytest.raises(error, match=match):
        _bound(model.left, x)


def test_an_affine_subclass_with_its_own_forward_is_refused():
    class Tripled(nn.Conv2d):
        def forward(self, h):
            return 3 * super().forward(h)

    model, x = _image_model(), _x()
    old = model.left.layers[0]
    model.left.layers[0] = Tripled(1, 4, 3, padding=1)
    with pytest.raises(TypeError, match="overrides Conv2d.forward"):
        _bound(model.left, x)
    model.left.layers[0] = old
    assert _bound(model.left, x) > 0


def test_a_forward_hook_on_f_l_is_refused_until_removed():
    model, x = _image_model(), _x()
    handle = model.left.layers[0].register_forward_hook(lambda module, args, out: 10 * out)
    with pytest.raises(ValueError, match="forward hooks"):
        _bound(model.left, x)
    handle.remove()
    assert _bound(model.left, x) > 0


def test_a_standardization_edited_to_a_zero_std_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model = sz.split_sequential(net, 1, num_classes=2, input_shape=(4,),
                                standardize=sz.Standardize([0.5] * 4, [0.3] * 4))
    model.left.standardize.std[0] = 0.0
    with pytest.raises(ValueError, match="std"):
        _bound(model.left, _x((4,)))
    model.left.standardize = nn.Identity()
    with pytest.raises(TypeError, match="Standardize"):
        _bound(model.left, _x((4,)))


def test_replacing_left_by_something_else_is_refused():
    model, x = _image_model(), _x()
    smoother = Smoother(model, SIGMA)
    model.left = nn.Identity()
    with pytest.raises(TypeError, match="LeftHalf"):
        smoother.certify(x, **COUNTS, seed=0)


def test_lengths_edited_out_of_step_are_refused():
    model, x = _image_model(), _x()
    model.left.activations.append(sz.ClippedReLU(1.0))
    with pytest.raises(ValueError, match="activations"):
        _bound(model.left, x)


# ====================================================================== batch-dependent f_R
class _BatchCentred(nn.Module):
    """Subtracts the batch mean: each row's output depends on the other rows."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, z):
        out = self.inner(z)
        return out - out.mean(0, keepdim=True)


class _AlwaysTraining(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def train(self, mode: bool = True):
        super().train(mode)
        self.training = True  # refuses eval()
        return self

    def forward(self, z):
        return self.inner(z)


class _Noisy(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, z):
        return self.inner(z) + 3 * torch.rand(z.shape[0], 1)


class _BatchDependentBesideALoser(nn.Module):
    """A batch-dependent bonus in the first class, beside a constant class that never wins (−1e6): that constant
    must not widen the probe's tolerance (scores relative to the largest one) until the bonus passes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, z):
        out = self.inner(z).clone()
        out[:, 0] += 10.0 if z.shape[0] > 1 else 0.0
        out[:, -1] = -1e6
        return out


class _BonusWithTheBatchBelowTheWinner(nn.Module):
    """The last class gains 5 in batches of more than one row: far below the winner at one input, the winner at
    another (votes that depend on the batch there), however the probed input ranks it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, z):
        out = self.inner(z).clone()
        out[:, -1] += 5.0 if z.shape[0] > 1 else 0.0
        return out


class _TiedScores(nn.Module):
    """Every class ties at 0 but class 0, which drops to −1 in batches of more than one row: argmax moves from 0."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, z):
        out = 0 * self.inner(z)
        out[:, 0] = -1.0 if z.shape[0] > 1 else 0.0
        return out


class _CountsItsCalls(nn.Module):
    """State kept between calls: the first class gains a little with every call (each step far inside the probe's
    tolerance), so the same input and seed would certify differently from one call to the next."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, z):
        self.calls += 1
        out = self.inner(z).clone()
        out[:, 0] += 0.05 * self.calls
        return out


def _head(wrapper) -> sz.SplitModel:
    model = _image_model()
    model.right = wrapper(model.right)
    return model


@pytest.mark.parametrize("model,match", [
    (lambda: sz.SplitModel(sz.LeftHalf([]), nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False)),
                           3), "running statistics"),
    (lambda: _head(_AlwaysTraining), "training mode"),
    (lambda: _head(_BatchCentred), "change with the rest of its batch"),
    (lambda: _head(_Noisy), "change with the rest of its batch or between calls"),
    (lambda: _head(_BatchDependentBesideALoser), "max difference 10 against a batch of 1"),
    (lambda: _head(_CountsItsCalls), "against the same row 15 calls later"),
    (lambda: _head(_BonusWithTheBatchBelowTheWinner), "max difference 5 against a batch of 1"),
    (lambda: _head(_TiedScores), "max difference 1 against a batch of 1"),
], ids=["batchnorm-without-running-stats", "stuck-in-training", "batch-centred", "random", "beside-a-constant-loser",
        "counts-its-calls", "bonus-below-the-winner", "ties"])
def test_a_batch_dependent_f_r_is_refused(model, match):
    model = model()
    x = _x((3,)) if model.split_index == 0 else _x()
    smoother = Smoother(model, SIGMA)
    with pytest.raises(ValueError, match=match):
        smoother.certify(x, **COUNTS, batch_size=64, seed=0)
    with pytest.raises(ValueError, match=match):
        smoother.predict(x, n=100, alpha=0.01, batch_size=64, seed=0)


class _MaskedScores(nn.Module):
    """Scores with a fixed value in the last class (−inf for a masked class, +inf, or NaN): the same on every call,
    whatever the batch (``inf − inf`` is NaN, which must not read as a batch dependence)."""

    def __init__(self, inner: nn.Module, fill: float):
        super().__init__()
        self.inner, self.fill = inner, fill

    def forward(self, z):
        out = self.inner(z).clone()
        out[:, -1] = self.fill
        return out


@pytest.mark.parametrize("fill", [-math.inf, math.inf])
def test_infinite_scores_that_do_not_depend_on_the_batch_are_accepted(fill):
    model = _head(lambda inner: _MaskedScores(inner, fill))
    r = Smoother(model, SIGMA).certify(_x(), **COUNTS, batch_size=64, seed=0)
    assert r.n == COUNTS["n"]
    # votes as torch.argmax counts them: +inf in the last class wins every row, −inf never does
    last = model.num_classes - 1
    assert (r.prediction == last) == (fill == math.inf)


def test_nan_scores_are_refused_by_certify_and_predict():
    """argmax reads a NaN as the maximum: without the check, NaN weights in f_R "certify" a class with a radius."""
    model = _head(lambda inner: _MaskedScores(inner, math.nan))
    with pytest.raises(ValueError, match="NaN scores"):
        Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0)
    with pytest.raises(ValueError, match="NaN scores"):
        Smoother(model, SIGMA).predict(_x(), COUNTS["n"], COUNTS["alpha"], seed=0)
    broken = _head(lambda inner: inner)
    smoother = Smoother(broken, SIGMA)
    assert smoother.certify(_x(), **COUNTS, seed=0).n == COUNTS["n"]  # probed and prepared: then edited in place
    with torch.no_grad():
        next(broken.right.parameters()).fill_(math.nan)
    with pytest.raises(ValueError, match="NaN scores"):
        smoother.certify(_x(), **COUNTS, seed=0)


def test_batchnorm_with_running_statistics_is_accepted():
    right = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model = sz.SplitModel(sz.LeftHalf([]), right, 3)
    r = Smoother(model, SIGMA).certify(_x((3,)), **COUNTS, seed=0)
    assert r.n == COUNTS["n"]
    assert model.training  # the caller's mode is restored


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_model_in_another_dtype_is_told_to_use_precision_instead(dtype):
    model = _image_model().to(dtype)
    with pytest.raises(TypeError, match=f"must be float32, found {str(dtype)[6:]}.*precision="):
        Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0)


def test_a_float64_constant_buffer_in_f_r_is_not_a_model_dtype():
    model = _image_model()
    model.right.register_buffer("temperature", torch.tensor(1.0, dtype=torch.float64))
    assert Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0).n == COUNTS["n"]


def test_a_hook_on_the_split_model_itself_is_refused():
    """Certifiers never call model(x): a pre-hook there (e.g. an input transform) would not be certified."""
    model = _image_model()
    handle = model.register_forward_pre_hook(lambda module, args: (args[0].flip(-1),))
    with pytest.raises(ValueError, match="SplitModel has forward hooks"):
        Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0)
    handle.remove()
    assert Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0).n == COUNTS["n"]


def test_nan_weights_in_f_l_are_named_before_any_solver_runs():
    model = _image_model()
    with torch.no_grad():
        model.left.layers[1].bias[0] = math.inf
    with pytest.raises(ValueError, match=r"NaN or Inf values in layers\[1\]\.bias"):
        Smoother(model, SIGMA).certify(_x(), **COUNTS, seed=0)
    with pytest.raises(ValueError, match=r"NaN or Inf values in layers\[1\]\.bias"):
        sz.lipschitz_bound(model.left, _x()[None], 0.1, method="exact")


@pytest.mark.parametrize("kwargs,match", [(dict(delta=0.0), "delta"), (dict(delta=2.0), "delta"),
                                          (dict(power_iters=0), "power_iters"), (dict(exact_max_dim=-1), "exact_max_dim")])
def test_lipschitz_bound_checks_its_settings_as_bound_options_does(kwargs, match):
    model = _image_model()
    with pytest.raises(ValueError, match=match):
        sz.lipschitz_bound(model.left, _x()[None], 0.1, method="probabilistic", **kwargs)


@pytest.mark.parametrize("count", [np.int64(300), torch.tensor(300)])
def test_numpy_and_tensor_counts_come_back_as_python_ints(count):
    r = Smoother(_image_model(), SIGMA).certify(_x(), 20, count, 0.01, seed=0)
    assert type(r.n) is int and r.n == 300


# ====================================================================== float64 inputs
def test_a_float64_input_is_certified_about_itself():
    model = _image_model()
    x64 = _x().double() + 1e-9  # not representable in float32
    smoother = Smoother(model, SIGMA, bound_options=EXACT)
    wide = smoother.certify(x64, **COUNTS, seed=0)
    rounded = smoother.certify(x64.float(), **COUNTS, seed=0)
    distance = float((x64 - x64.float().double()).norm())
    assert rounded.input_rounding == 0.0
    assert distance <= wide.input_rounding <= distance * (1 + 1e-9)
    assert wide.prediction == rounded.prediction != ABSTAIN
    assert wide.radius < rounded.radius
    assert wide.radius == pytest.approx(rounded.radius - distance, rel=0, abs=1e-12)
    exact = _x().double()  # float32 values held in float64: nothing is rounded
    assert smoother.certify(exact, **COUNTS, seed=0).input_rounding == 0.0


def test_a_float64_input_to_the_margin_certifier_is_certified_about_itself():
    model = _margin_model()
    x64 = _x((4,)).double() + 1e-9
    certifier = MarginCertifier(model, bound_options=EXACT)
    wide, rounded = certifier.certify(x64, seed=0), certifier.certify(x64.float(), seed=0)
    assert wide.input_rounding > 0 and wide.radius < rounded.radius


def test_a_rounding_as_large_as_the_radius_abstains():
    r = CertifyResult(1, 0.25, 0.99, 0.3, 1.2, 0.25, "local-exact", 0.001, 990, 1000, 3, 0, 0.1)
    assert about_given_input(r, 0.1).radius == pytest.approx(0.15)
    gone = about_given_input(r, 0.25)
    assert (gone.prediction, gone.radius, gone.input_rounding) == (ABSTAIN, 0.0, 0.25)


# ====================================================================== trace fallback of the exact bound
def test_trace_fallback_covers_the_rounding_of_the_trace_sum(monkeypatch):
    """A rank-one Gram ``a aᵀ`` whose diagonal is 1 followed by many entries just below half an ulp of 1: adding them
    to a running sum of 1 rounds each away, so the float64 trace undershoots ``λ_max = ‖a‖²`` by more than the old
    ``(1 + 8u)`` margin. Forcing the trace fallback (a useless eigen-estimate), the bound must still be above a
    Rayleigh quotient of the float64 matrix computed exactly."""
    from fractions import Fraction

    d = 550  # 20 ulps of 1 lost in the float64 sum on the project's x86-64 CPUs (vectorized lanes of torch.sum)
    b = math.sqrt(0.999 * 2.0 ** -53)
    a = torch.full((d,), b, dtype=torch.float64)
    a[0] = 1.0
    gram = torch.outer(a, a)
    monkeypatch.setattr(certificate, "_eigen_estimate", lambda g: 0.0)  # every Cholesky shift then fails
    bound = certificate.certified_lambda_max(gram, terms=1)
    # Exact Rayleigh quotient aᵀGa / aᵀa of the float64 matrix (entries: 1, b, and c = fl(b·b) everywhere else).
    fb, fc, m = Fraction(b), Fraction(float(gram[1, 1])), d - 1
    rayleigh = (1 + 2 * m * fb * fb + m * m * fb * fc * fb) / (1 + m * fb * fb)
    assert Fraction(bound) >= rayleigh
    assert bound <= float(rayleigh) * (1 + 1e-12)


# ====================================================================== property: edits, then a fresh certifier
def _edit(model: sz.SplitModel, rng: random.Random) -> str:
    """One random edit a notebook user makes, applied to ``model``; returns its name."""
    kind = rng.choice(["replace-left", "replace-right", "left-data", "right-state", "new-pool", "new-activation"])
    if kind == "replace-left":
        model.left = _scaled_left(model, rng.uniform(0.3, 4.0))
    elif kind == "replace-right":
        model.right = _right_for_class(model, rng.randrange(3))
    elif kind == "left-data":
        model.left.layers[1].weight.data.mul_(rng.uniform(0.3, 4.0))  # .data: no version-counter bump
    elif kind == "right-state":
        state = {k: v * rng.uniform(0.5, 2.0) for k, v in model.right.state_dict().items()}
        model.right.load_state_dict(state)
    elif kind == "new-pool":
        model.left.pools[0] = nn.MaxPool2d(2)
    else:
        model.left.activations[0] = sz.ClippedReLU(rng.uniform(0.05, 2.0))
    return kind


CERTIFIERS = {
    "smoother": lambda m: Smoother(m, SIGMA, bound_options=EXACT),
    "smoother-global": lambda m: Smoother(m, SIGMA, bound_options=SMOOTHERS["global"]),
    "sequential": lambda m: SequentialCertifier(Smoother(m, SIGMA, bound_options=EXACT), radii=[0.05]),
}


@pytest.mark.parametrize("seed", range(4))
def test_after_any_edits_every_certifier_gives_a_fresh_certifiers_result(seed):
    rng = random.Random(seed)
    model, x = _image_model(seed=seed), _x(seed=seed)
    certifiers = {name: build(model) for name, build in CERTIFIERS.items()}
    margin_model, margin_x = _margin_model(seed), _x((4,), seed)
    margin = MarginCertifier(margin_model, bound_options=EXACT)
    for step in range(3):
        for name, certifier in certifiers.items():
            got = certifier.certify(x, 20, 300, 0.01, seed=step)
            fresh = CERTIFIERS[name](model).certify(x, 20, 300, 0.01, seed=step)
            assert _outcome(got) == _outcome(fresh), (name, step)
        got = margin.certify(margin_x, seed=step)
        fresh = MarginCertifier(margin_model, bound_options=EXACT).certify(margin_x, seed=step)
        assert _outcome(got) == _outcome(fresh)
        _edit(model, rng)
        margin_model.left = _scaled_left(margin_model, rng.uniform(0.3, 4.0))


# ====================================================================== edits during a lazy call, in either half
def _edit_right_data(model):
    model.right[-1].weight.data.add_(1.0)  # .data: no version-counter bump


def _edit_right_no_grad(model):
    with torch.no_grad():
        model.right[-1].bias.copy_(torch.tensor([0.0, 6.0, 0.0]))


def _edit_right_layer(model):
    model.right[1] = nn.Linear(64, 3)  # a layer of f_R replaced: same repr and names, other values


def _edit_left_data(model):
    model.left.layers[1].weight.data.mul_(2.0)


RIGHT_EDITS = {"data": _edit_right_data, "no-grad-copy": _edit_right_no_grad, "layer-replaced": _edit_right_layer}
XS = torch.stack([_x(seed=s) for s in range(3)])


def _edit_after_the_first_result(results, edit, model) -> None:
    """The call ``results`` yields one result, ``edit(model)`` runs, and the next ``next`` raises."""
    next(results)
    edit(model)
    with pytest.raises(RuntimeError, match="edited while a certify/predict call was running"):
        next(results)


@pytest.mark.parametrize("batch_size", [64, 2048], ids=["window-per-input", "one-window"])
@pytest.mark.parametrize("edit", RIGHT_EDITS.values(), ids=RIGHT_EDITS.keys())
def test_editing_f_r_during_certify_many_stops_it(edit, batch_size):
    model = _image_model()
    results = Smoother(model, SIGMA).certify_many(XS, **COUNTS, batch_size=batch_size, seeds=[0, 1, 2])
    _edit_after_the_first_result(results, edit, model)


@pytest.mark.parametrize("edit", [_edit_left_data, _edit_right_data], ids=["f_L", "f_R"])
def test_editing_the_model_during_predict_many_yields_no_stale_prediction(edit):
    model = _image_model()
    results = Smoother(model, SIGMA).predict_many(XS, n=100, alpha=0.01, batch_size=2048, seeds=[0, 1, 2])
    _edit_after_the_first_result(results, edit, model)


@pytest.mark.parametrize("edit", [_edit_left_data, *RIGHT_EDITS.values()], ids=["f_L", *RIGHT_EDITS.keys()])
def test_editing_the_model_during_a_sequential_certify_many_stops_it(edit):
    model = _image_model()
    sequential = SequentialCertifier(Smoother(model, SIGMA), radii=[0.05])
    results = sequential.certify_many(XS, n0=20, budget=200, alpha=0.01, seeds=[0, 1, 2])
    _edit_after_the_first_result(results, edit, model)


def test_editing_the_model_during_margin_certify_many_stops_it():
    model = _margin_model()
    results = MarginCertifier(model, bound_options=EXACT).certify_many(torch.stack([_x((4,), s) for s in range(3)]),
                                                                       seeds=[0, 1, 2])
    _edit_after_the_first_result(results, lambda m: m.left.layers[0].weight.data.mul_(2.0), model)


def test_editing_f_r_during_attack_many_yields_no_stale_result():
    model = _image_model()
    attacker = sz.Attacker(Smoother(model, SIGMA), attack="smooth-fgsm", eps=0.1, samples=4, group=3)
    results = attacker.attack_many([(x, 0) for x in XS], n=100, alpha=0.01, seeds=[0, 1, 2])
    _edit_after_the_first_result(results, _edit_right_data, model)


def test_an_unedited_model_runs_a_lazy_call_to_the_end():
    model = _image_model()
    smoother = Smoother(model, SIGMA)
    assert len(list(smoother.certify_many(XS, **COUNTS, batch_size=64, seeds=[0, 1, 2]))) == 3
    assert len(list(smoother.predict_many(XS, n=100, alpha=0.01, seeds=[0, 1, 2]))) == 3


# ====================================================================== ModuleSnapshot: by bits, one sync per group
def test_snapshot_compares_bits_and_every_buffer():
    module = nn.Linear(3, 2)
    module.register_buffer("scale", torch.ones(2), persistent=False)  # not in the state dict
    with torch.no_grad():
        module.weight[0, 0] = float("nan")
    snapshot = sz.ModuleSnapshot(module)
    assert snapshot.matches(module)  # a NaN is the same bits as itself
    module.scale.data.fill_(2.0)
    assert not snapshot.matches(module)
    module.scale.data.fill_(1.0)
    assert snapshot.matches(module)
    module.bias.data[0] = 0.0
    snapshot = sz.ModuleSnapshot(module)
    module.bias.data[0] = -0.0  # equal as floats, another bit pattern (and another result of 1/x)
    assert not snapshot.matches(module)
    module.bias.data[0] = 0.0
    assert snapshot.matches(module)
    module.scale = module.scale.double()
    assert not snapshot.matches(module)


def _deep_right(layers: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), *[nn.Linear(64, 64) for _ in range(layers)], nn.BatchNorm1d(64),
                         nn.Linear(64, 3))


@pytest.mark.parametrize("layers", [1, 30])
def test_a_guard_check_costs_one_device_comparison_per_group(layers, monkeypatch):
    """However many tensors the model has: f_L is float32 (one group); f_R float32 and BatchNorm's int64 counter."""
    model = _image_model()
    model.right = _deep_right(layers)
    guard = sz.certify.inputs.CallGuard(model)
    calls = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(a.dtype) or equal(a, b))
    guard.check()
    assert sorted(map(str, calls)) == ["torch.int32", "torch.int32", "torch.int64"]
    for k, tensor in [*model.left.named_parameters(), *model.right.named_buffers(), *model.right.named_parameters()]:
        was = tensor.data.clone()
        tensor.data.view(-1)[-1] += 1
        with pytest.raises(RuntimeError, match="edited while"):
            guard.check()
        tensor.data.copy_(was)
    guard.check()


# ====================================================================== PREDICT on a float64 input
def test_predict_reports_the_rounding_of_a_float64_input():
    model = _image_model()
    x64 = _x().double() + 1e-9  # not representable in float32
    smoother = Smoother(model, SIGMA)
    wide = smoother.predict(x64, n=100, alpha=0.01, seed=0)
    rounded = smoother.predict(x64.float(), n=100, alpha=0.01, seed=0)
    distance = float((x64 - x64.float().double()).norm())
    assert rounded.input_rounding == 0.0
    assert distance <= wide.input_rounding <= distance * (1 + 1e-9)
    assert wide.input_rounding == smoother.certify(x64, **COUNTS, seed=0).input_rounding
    assert dataclasses.replace(wide, input_rounding=0.0) == rounded  # the answer is x̃'s
    many = list(smoother.predict_many([x64, x64.float()], n=100, alpha=0.01, seeds=[0, 0]))
    assert [p.input_rounding for p in many] == [wide.input_rounding, 0.0]
