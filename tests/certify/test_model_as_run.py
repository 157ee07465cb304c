"""The certified model is the model that runs: the latent noise is added to is the function the Lipschitz bound
describes, and the base classifier sampled is ``model.right(z)`` as the user's module computes it — hooks, methods
replaced on an instance and plain attributes included — as it was when the call started. Each case here printed a
radius that did not hold, or sampled another function than the user's, before the fix."""
from __future__ import annotations

import dataclasses
import threading
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

import splitz_fast as sz
from splitz_fast import cuda_math as cuda_math_module
from splitz_fast.cuda_math import convolutions_use_tf32, matmuls_use_tf32
from splitz_fast.sampling.choices import Variant
from splitz_fast.sampling.epilogues import ConvReLU, FusionChoice
from splitz_fast.bounds.radius import BoundOptions
from splitz_fast.sampling.engine import SamplingEngine
from splitz_fast.sampling.score_checks import ACCEPT_FACTOR, ROUNDING_UNIT, copy_tolerance, score_gap
from splitz_fast.certify.smoothing import Smoother
from splitz_fast.model.snapshot import ModuleSnapshot

EXACT = BoundOptions(bound_method="exact")
COUNTS = dict(n0=20, n=400, alpha=0.01)


def _outcome(result) -> dict:
    fields = dataclasses.asdict(result)
    fields.pop("seconds")
    return fields


def _toy_model() -> sz.SplitModel:
    """Two inputs: f_L the identity (Linear with identity weight, no clipping), f_R a linear classifier of 3 classes."""
    left = nn.Linear(2, 2)
    right = nn.Linear(2, 3)
    with torch.no_grad():
        left.weight.copy_(torch.eye(2))
        left.bias.zero_()
        right.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        right.bias.zero_()
    return sz.split_sequential(nn.Sequential(left, nn.ReLU(), right), 1, num_classes=3, input_shape=(2,),
                               threshold=float("inf"))


def _image_model(seed: int = 0) -> sz.SplitModel:
    """Split 1 of conv-ReLU-conv-ReLU-pool-flatten-linear on 1×8×8: f_R has a convolution (so it is sampled through a
    rewritten chain where that is allowed), a ReLU directly before a 2x2 pool, and a bias that favours class 2."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():
        net[2].bias.fill_(1.0)
        net[-1].weight.zero_()
        net[-1].weight[2].fill_(0.1)  # class 2 grows with the (positive) pooled activations
        net[-1].bias.copy_(torch.tensor([0.0, 1.0, 0.0]))
    return sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 8, 8), threshold=float("inf"))


def _x(shape=(1, 8, 8), seed: int = 1) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _sampled(smoother: Smoother, latent_shape) -> nn.Module:
    """The module the smoother's engine samples full batches through (eager, as on the CPU)."""
    engine = smoother.engine()
    layout = (len(latent_shape) == 3, engine.pools_in_noise(torch.Size(latent_shape)))
    return engine.prepared.get(*layout)


def _user_votes(model: sz.SplitModel, x: torch.Tensor, sigma: float, n: int = 4000) -> torch.Tensor:
    """Vote counts of the user's own ``model.right`` on noisy latents of ``x`` (an independent Monte Carlo)."""
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        z = model.left(x.unsqueeze(0))[0]
        noisy = z + sigma * torch.randn((n, *z.shape), generator=gen)
        return torch.bincount(model.right(noisy).argmax(1), minlength=model.num_classes)


# ====================================================================== 1. f_L is the function the bound describes
def test_a_forward_replaced_on_a_layer_of_f_l_is_refused():
    model = _toy_model()
    layer = model.left.layers[0]
    original = layer.forward
    layer.forward = lambda h: 20 * original(h)
    with pytest.raises(ValueError, match=r"replaced on the instance \(layers.0.forward\)"):
        Smoother(model, 0.5, bound_options=EXACT).certify(torch.tensor([0.3, 0.0]), **COUNTS, seed=0)
    del layer.forward
    assert Smoother(model, 0.5, bound_options=EXACT).certify(torch.tensor([0.3, 0.0]), **COUNTS, seed=0).lipschitz \
        == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("piece", ["activation", "standardize"])
def test_a_forward_replaced_on_a_clipped_relu_or_standardize_is_refused(piece):
    model = sz.split_sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)), 1, num_classes=3,
                                input_shape=(2,), standardize=sz.Standardize([0.5, 0.5], [0.25, 0.25]))
    module = model.left.activations[0] if piece == "activation" else model.left.standardize
    module.forward = types.MethodType(lambda self, h: 20 * h, module)
    with pytest.raises(ValueError, match="replaced on the instance"):
        Smoother(model, 0.5).certify(torch.tensor([0.3, 0.0]), **COUNTS, seed=0)


def test_the_latent_is_computed_from_the_weights_the_bound_reads():
    """LeftHalf.forward applies the layers' weights with functional ops: the same values as calling the modules."""
    model = _image_model()
    x = _x()
    with torch.no_grad():
        by_modules = model.left.layers[0](x.unsqueeze(0)).clamp(min=0)
        assert torch.equal(model.left(x.unsqueeze(0)), by_modules)
        assert torch.equal(Smoother(model, 0.5).latent(x), by_modules[0])


def test_global_forward_hooks_are_refused_and_never_reach_the_latent():
    model = _toy_model()
    calls = []

    def times_twenty(module, args, out):
        calls.append(type(module).__name__)
        return 20 * out

    handle = torch_module.register_module_forward_hook(times_twenty)
    try:
        smoother = Smoother(model, 0.5, bound_options=EXACT)
        assert torch.equal(smoother.latent(torch.tensor([0.3, 0.0])), torch.tensor([0.3, 0.0]))
        assert calls == []  # f_L is not computed through module calls
        with pytest.raises(ValueError, match="global module forward hooks"):
            smoother.certify(torch.tensor([0.3, 0.0]), **COUNTS, seed=0)
    finally:
        handle.remove()
    pre = torch_module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        with pytest.raises(ValueError, match="global module forward hooks"):
            Smoother(model, 0.5).predict(torch.tensor([0.3, 0.0]), n=100, alpha=0.01, seed=0)
    finally:
        pre.remove()


def test_a_global_hook_registered_during_a_lazy_call_stops_it():
    model = _toy_model()
    results = Smoother(model, 0.5).certify_many(torch.tensor([[0.3, 0.0], [0.0, 0.3], [0.2, 0.1]]), **COUNTS,
                                                batch_size=64, seeds=[0, 1, 2])
    next(results)
    handle = torch_module.register_module_forward_hook(lambda module, args, out: out)
    try:
        with pytest.raises(ValueError, match="global module forward hooks"):
            next(results)
    finally:
        handle.remove()


# ====================================================================== 2. hooks inside f_R are kept where they are
def _boost_class_1(module, args, out):
    return out + torch.tensor([0.0, 10.0, 0.0])


def _zero_out(module, args, out):
    return torch.zeros_like(out)


def _negate(module, args, out):
    return -out


HOOKS = {
    "on model.right": (lambda right: right, _boost_class_1),
    "on the pool": (lambda right: right[2], _zero_out),
    "on the ReLU before the pool": (lambda right: right[1], _negate),
}


@pytest.mark.parametrize("where, hook", HOOKS.values(), ids=HOOKS.keys())
def test_f_r_is_sampled_with_its_hooks_where_the_user_put_them(lenient, where, hook):
    model, x = _image_model(), _x()
    handle = where(model.right).register_forward_hook(hook)
    smoother = Smoother(model, 0.25)
    latent = smoother.latent(x)
    batch = latent + 0.25 * torch.randn((64, *latent.shape), generator=torch.Generator().manual_seed(5))
    batch = batch.contiguous(memory_format=torch.channels_last)  # as the engine feeds image latents
    with torch.no_grad():
        want = model.right(batch)
        got = _sampled(smoother, latent.shape)(batch)
    assert torch.equal(got, want)
    votes = _user_votes(model, x, 0.25)
    result = smoother.certify(x, **COUNTS, seed=0)
    assert result.prediction == int(votes.argmax())
    handle.remove()
    unhooked = Smoother(model, 0.25).certify(x, **COUNTS, seed=0)
    assert unhooked.prediction == int(_user_votes(model, x, 0.25).argmax()) != result.prediction


def test_sampling_f_r_as_it_is_warns_once_and_is_an_error_under_strict(lenient, monkeypatch):
    """Hooks keep f_R from its rewrites: a slower path, so it says so once per engine (and raises under
    SPLITZ_STRICT=1); an f_R without hooks says nothing."""
    model, x = _image_model(), _x()
    smoother = Smoother(model, 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smoother.certify(x, **COUNTS, seed=0)
    model.right[2].register_forward_hook(_zero_out)
    with pytest.warns(UserWarning, match=r"a hook on 2: it is sampled as it is, without BatchNorm folding"):
        smoother.certify(x, **COUNTS, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smoother.certify(x, **COUNTS, seed=1)  # the same hooks: no second warning
    monkeypatch.setenv("SPLITZ_STRICT", "1")
    with pytest.raises(RuntimeError, match="SPLITZ_STRICT=1 makes every fallback an error"):
        Smoother(model, 0.25).certify(x, **COUNTS, seed=0)


def test_a_forward_replaced_on_a_layer_of_f_r_is_sampled(lenient):
    model, x = _image_model(), _x()
    pool = model.right[2]
    pool.forward = types.MethodType(lambda self, h: torch.zeros_like(F.max_pool2d(h, 2)), pool)
    result = Smoother(model, 0.25).certify(x, **COUNTS, seed=0)
    assert result.prediction == int(_user_votes(model, x, 0.25).argmax()) == 1


# ====================================================================== 3. edits the snapshot must see
class _Scaled(nn.Module):
    """A custom module whose forward reads a plain attribute."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, h):
        return self.factor * h


def _scaled_model() -> sz.SplitModel:
    model = _image_model()
    model.right = nn.Sequential(*model.right[:-1], _Scaled(1.0), model.right[-1])
    return model


def _add_hook(model):
    model.right[-1].register_forward_hook(_boost_class_1)


def _replace_forward(model):
    linear = model.right[-1]
    linear.forward = types.MethodType(lambda self, h: F.linear(h, self.weight, self.bias) + torch.tensor(
        [0.0, 10.0, 0.0]), linear)


def _change_attribute(model):
    model.right[-2].factor = -1.0  # class 2's evidence becomes negative: class 1 wins


EDITS = {"hook added": _add_hook, "forward replaced": _replace_forward, "plain attribute": _change_attribute}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_an_edit_after_a_call_is_sampled_by_the_next_call(lenient, edit):
    model, x = _scaled_model(), _x()
    smoother = Smoother(model, 0.25)
    before = smoother.certify(x, **COUNTS, seed=0)
    edit(model)
    after = smoother.certify(x, **COUNTS, seed=0)
    fresh = Smoother(model, 0.25).certify(x, **COUNTS, seed=0)
    assert _outcome(after) == _outcome(fresh)
    assert after.prediction == int(_user_votes(model, x, 0.25).argmax()) != before.prediction


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_an_edit_during_a_lazy_call_stops_it(edit):
    model = _scaled_model()
    results = Smoother(model, 0.25).certify_many(torch.stack([_x(seed=s) for s in range(3)]), **COUNTS,
                                                  batch_size=64, seeds=[0, 1, 2])
    next(results)
    edit(model)
    with pytest.raises(RuntimeError, match="edited while a certify/predict call was running"):
        next(results)


def test_a_snapshot_of_a_deep_copy_matches_the_module():
    model = _scaled_model()
    model.right[-1].register_forward_hook(_boost_class_1)
    model.right.extra = {"weights": [1.0, float("nan")], "mode": "fast", "table": torch.arange(3.0)}
    import copy

    assert ModuleSnapshot(copy.deepcopy(model.right)).matches(model.right)
    snapshot = ModuleSnapshot(model.right)
    model.right.extra["weights"].append(2.0)  # a list mutated in place
    assert not snapshot.matches(model.right)
    snapshot = ModuleSnapshot(model.right)
    model.right.extra["table"][1] = 5.0  # an unregistered tensor edited in place
    assert not snapshot.matches(model.right)


# ====================================================================== 4. another thread's edit cannot mix votes
def _mlp_model() -> sz.SplitModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return sz.split_sequential(net, 1, num_classes=3, input_shape=(4,), threshold=float("inf"))


def test_an_edit_made_and_undone_while_an_input_samples_changes_no_vote(monkeypatch):
    """The user's f_R is edited after the first batch of one input's draws and restored after the second (as another
    thread would): the votes are those of f_R as the call started, the same as without the edit."""
    model, x = _mlp_model(), torch.tensor([0.2, -0.1, 0.4, 0.3])
    clean = Smoother(model, 0.5).certify(x, n0=20, n=2000, alpha=0.01, batch_size=64, seed=3)
    original = SamplingEngine._count_segments
    batches, saved = [], model.right[-1].weight.detach().clone()

    def count_while_edited(self, net, segments, *args, **kwargs):
        batches.append(len(batches))
        with torch.no_grad():
            if len(batches) == 2:
                model.right[-1].weight.mul_(-20.0)
            elif len(batches) == 4:
                model.right[-1].weight.copy_(saved)
        return original(self, net, segments, *args, **kwargs)

    monkeypatch.setattr(SamplingEngine, "_count_segments", count_while_edited)
    edited = Smoother(model, 0.5).certify(x, n0=20, n=2000, alpha=0.01, batch_size=64, seed=3)
    assert len(batches) > 4 and _outcome(edited) == _outcome(clean)


def test_f_r_is_never_sampled_through_the_users_modules():
    model = _mlp_model()
    smoother = Smoother(model, 0.5)
    net = _sampled(smoother, (8,))
    user = {id(p) for p in model.right.parameters()}
    assert not any(id(p) in user for p in net.parameters()) and not any(m is model.right for m in net.modules())


# ====================================================================== 5. copies accepted to rounding, not a percent
def _conv_scorer():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10)).eval()
    batch = torch.randn(32, 4, 6, 6)

    def scores(module, b):
        with torch.no_grad():
            return module(b)
    return net, batch, scores


def test_a_copy_off_by_a_fraction_of_a_percent_is_refused_in_float32(lenient):
    net, batch, scores = _conv_scorer()
    tolerance, how = copy_tolerance(net, scores, batch, "float32")
    assert ROUNDING_UNIT["float32"] * ACCEPT_FACTOR <= tolerance < 1e-4 and "float64" in how
    want = scores(net, batch)
    shifted = want * 1.009  # a stand-in copy 0.9 % off
    gap, scale = score_gap(shifted, want)
    assert gap > tolerance * scale
    reordered = scores(net.double(), batch.double()).float()  # the same function, rounded another way
    gap, scale = score_gap(reordered, want)
    assert gap <= tolerance * scale
    choice = FusionChoice(True, torch.device("cuda"))  # a device object only: the check needs no GPU
    net, _, _ = _conv_scorer()  # float32 again (the reordered scores above made it float64)
    fused = nn.Sequential(ConvReLU(net[0]), net[2], net[3], _Scaled(1.009))  # its one site alike, the copy 0.9 % off
    with pytest.warns(UserWarning, match="differ from the plain"):
        assert choice.choose(Variant(channels_last=False, pooled=False, rows=32), lambda b: want, fused, scores,
                             lambda: batch, lambda: tolerance) is None


def test_the_tolerance_follows_the_precision():
    net, batch, scores = _conv_scorer()

    def bf16_scores(module, b):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return module(b)

    fp32, _ = copy_tolerance(net, scores, batch, "float32")
    bf16, _ = copy_tolerance(net, bf16_scores, batch, "bfloat16")
    assert bf16 > 100 * fp32 and bf16 >= ACCEPT_FACTOR * ROUNDING_UNIT["bfloat16"]


def test_a_net_without_a_float64_form_gets_the_floor(lenient):
    class Float32Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.offset = torch.ones(3)  # not a buffer: .double() leaves it float32

        def forward(self, h):
            return torch.addmm(self.offset, h, torch.ones(h.shape[1], 3, dtype=h.dtype))

    with pytest.warns(UserWarning, match="does not run in float64"):
        tolerance, how = copy_tolerance(Float32Constant(), lambda m, b: m(b), torch.randn(4, 2), "float32")
    assert tolerance == ACCEPT_FACTOR * ROUNDING_UNIT["float32"] and "no float64 reference" in how


# ====================================================================== 6. f_L in IEEE float32 on CUDA
def test_the_latent_runs_with_tf32_off(monkeypatch):
    entered = []
    original = cuda_math_module.ieee_float32

    def recording(device):
        entered.append(torch.device(device))
        return original(device)

    monkeypatch.setattr("splitz_fast.certify.smoothing.ieee_float32", recording)
    Smoother(_toy_model(), 0.5).latent(torch.tensor([0.3, 0.0]))
    assert entered == [torch.device("cpu")]
    cuda, cudnn = torch.device("cuda"), torch.backends.cudnn
    with cuda_math_module.cuda_math(cuda, tf32=True, benchmark=False):  # a user's settings: TF32 on, no autotuning
        with original(cuda):
            assert (convolutions_use_tf32(), matmuls_use_tf32(), cudnn.benchmark) == (False, False, False)
        assert (convolutions_use_tf32(), matmuls_use_tf32(), cudnn.benchmark) == (True, True, False)


def test_math_settings_of_two_threads_never_interleave():
    """A thread sampling in TF32 and a thread computing a latent in IEEE float32 each see only their own settings."""
    cuda = torch.device("cuda")
    inside, release, seen = threading.Event(), threading.Event(), []

    def sampling():
        with cuda_math_module.cuda_math(cuda, tf32=True):
            inside.set()
            release.wait(5)
            seen.append(("sampling", convolutions_use_tf32()))

    def latent():
        inside.wait(5)
        with cuda_math_module.ieee_float32(cuda):
            seen.append(("latent", convolutions_use_tf32()))

    threads = [threading.Thread(target=sampling), threading.Thread(target=latent)]
    for t in threads:
        t.start()
    inside.wait(5)
    threading.Timer(0.2, release.set).start()
    for t in threads:
        t.join(10)
    assert seen == [("sampling", True), ("latent", False)]


@pytest.mark.gpu
def test_the_latent_on_cuda_is_ieee_float32_even_with_tf32_enabled():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 64, 5, padding=2), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 32 * 32, 10))
    model = sz.split_sequential(net, 1, num_classes=10, input_shape=(3, 32, 32), threshold=float("inf")).cuda()
    x = torch.rand(3, 32, 32, device="cuda")
    with cuda_math_module.cuda_math(torch.device("cuda"), tf32=True):  # a user who enabled TF32
        got = Smoother(model, 0.5).latent(x).double()
    conv = model.left.layers[0]
    exact = F.conv2d(x.double().unsqueeze(0), conv.weight.double(), conv.bias.double(), padding=2).clamp(min=0)[0]
    assert float((got - exact).abs().max()) <= 1e-5 * float(exact.abs().max())  # TF32 would be ~1e-3
