"""The prepared f_R folds BatchNorm without changing the user's model, and never traces away a hook."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from _helpers import small_splitz as _small_splitz
from splitz_fast.sampling.engine import SamplingEngine, fold_batchnorm, unfolded_batchnorms


CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- prepared f_R
def test_prepared_f_r_folds_batchnorm_and_leaves_the_user_model_unchanged():
    model, xs = _small_splitz()
    before = copy.deepcopy(model.state_dict())
    model.train()
    engine = SamplingEngine(model.right, 5, 0.4, torch.device("cpu"))
    engine.prepared.check_current()
    prepared = engine.prepared.get(channels_last=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in prepared.modules())
    assert model.training and all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
    assert model.right[0].weight.is_contiguous()  # the user's layout is untouched too
    latents = torch.rand(9, 3, 6, 6, generator=_gen(5))
    with torch.no_grad():
        expected = copy.deepcopy(model.right).eval()(latents)
        got = prepared(latents.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert fold_batchnorm(nn.Linear(3, 2)).weight is not None  # nothing to fold: still a working copy


def _randomize_batchnorms(module: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics and affine parameters away from their initial values, so that a fold that drops or
    misplaces a BatchNorm changes the function; γ < 1 keeps 54 residual blocks from blowing up."""
    gen = _gen(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                c = m.num_features
                m.running_mean.copy_(torch.rand(c, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(c, generator=gen) * 1.5 + 0.5)
                m.weight.copy_(torch.rand(c, generator=gen) * 0.4 + 0.2)
                m.bias.copy_((torch.rand(c, generator=gen) - 0.5) * 0.4)
    return module.eval()


def _batchnorms(module: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


@pytest.mark.parametrize("name,shape,split", [("cifar_resnet110", (3, 32, 32), 0), ("cifar_resnet110", (3, 32, 32), 1),
                                              ("imagenet_resnet50", (3, 64, 64), 0),
                                              ("imagenet_resnet50", (3, 64, 64), 1)])
def test_prepared_resnets_fold_every_batchnorm_at_both_splits(name, shape, split):
    """The project's ResNets keep no BatchNorm in the prepared f_R, at split 0 too (there f_R is
    Sequential(Standardize, network), which torch.fx cannot trace as a whole: the fold goes module by module),
    residual blocks and downsample branches included; the prepared copy computes the eval model's function."""
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = sz.build_model(name, split_index=split)
    right = _randomize_batchnorms(model.right)
    assert _batchnorms(right) > 50
    engine = SamplingEngine(right, model.num_classes, 0.25, CPU)
    engine.prepared.check_current()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unfolded: no warning
        prepared = engine.prepared.get(channels_last=True)
    assert _batchnorms(prepared) == 0 and engine.prepared.batchnorm_folded and engine.prepared.unfolded_batchnorms == {}
    folded = fold_batchnorm(right)
    assert _batchnorms(folded) == 0
    with torch.no_grad():
        latents = model.left(torch.rand(2, *shape, generator=_gen(1)))
        want = right(latents)
        for got in (folded(latents), prepared(latents.contiguous(memory_format=torch.channels_last))):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("split,pooled", [(0, False), (1, False), (1, True)])
def test_lenet_is_prepared_on_the_cpu_as_before(split, pooled):
    """LeNet has no BatchNorm: folding changes nothing, and on the CPU its prepared chain is the same as ever (2x2
    pools as strided maxima, ReLUs after them and in place, the Flatten read in storage order by the first linear)."""
    model = sz.build_model("lenet", split_index=split)
    assert unfolded_batchnorms(model.right) == {}
    folded = fold_batchnorm(model.right)
    assert [type(m) for m in folded] == [type(m) for m in model.right] and folded is not model.right
    engine = SamplingEngine(model.right, 10, 0.25, CPU)
    engine.prepared.check_current()
    prepared = engine.prepared.get(channels_last=True, pooled=pooled)
    chain = ["Conv2d", "MaxPool2x2", "ReLU", "_FlattenLinear", "ReLU", "Linear"]
    want = {0: ["Conv2d", "MaxPool2x2", "ReLU"] + chain, 1: ["MaxPool2x2"] + chain}[split][int(pooled):]
    assert [type(m).__name__ for m in prepared] == want and engine.prepared.batchnorm_folded
    assert all(m.inplace for m in prepared if isinstance(m, nn.ReLU))
    with torch.no_grad():
        latents = model.left(torch.rand(3, 1, 28, 28, generator=_gen(2)))
        torch.testing.assert_close(folded(latents), model.right(latents), rtol=0, atol=0)


class _Untraceable(nn.Module):
    """An f_R that torch.fx cannot trace (control flow on a tensor), with foldable pairs in its children: a
    Sequential, a traced custom block (a convolution called twice, one call feeding a BatchNorm; a convolution whose
    output is read twice), a Linear -> BatchNorm1d head; and a conv -> BatchNorm pair in its own forward."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
            self.shared, self.bn_shared = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(self.conv(x)) + self.conv(x)  # the second call reads the unfolded convolution
            z = self.shared(y)
            return torch.relu(self.bn_shared(z) + z)  # z is read twice: bn_shared cannot fold

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))
        self.block = self.Block()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5))

    def forward(self, x):
        if x.sum() > -1e9:  # a tensor in control flow: symbolic tracing fails
            x = self.bn(self.conv(x))
        return self.head(self.block(self.body(x)))


def test_fold_batchnorm_where_fx_cannot_trace_and_warn_once_about_the_rest(recwarn):
    torch.manual_seed(0)
    right = _randomize_batchnorms(_Untraceable())
    assert _batchnorms(right) == 6
    unfolded = unfolded_batchnorms(right)
    assert set(unfolded) == {"bn", "block.bn_shared", "body.3"}
    assert "cannot trace" in unfolded["bn"] and "read elsewhere" in unfolded["block.bn_shared"]
    assert "not directly after" in unfolded["body.3"]
    folded = fold_batchnorm(right)
    assert _batchnorms(folded) == 3
    assert _batchnorms(right) == 6 and isinstance(right.body[1], nn.BatchNorm2d)  # the user's model is untouched
    x = torch.randn(5, 3, 4, 4, generator=_gen(3))
    with torch.no_grad():
        torch.testing.assert_close(folded(x), right(x), rtol=1e-5, atol=1e-5)
    engine = SamplingEngine(right, 5, 0.25, CPU)
    engine.prepared.check_current()
    assert not engine.prepared.batchnorm_folded and engine.prepared.unfolded_batchnorms == unfolded
    for channels_last in (True, False, True):
        prepared = engine.prepared.get(channels_last)
        with torch.no_grad():
            torch.testing.assert_close(prepared(x), right(x), rtol=1e-5, atol=1e-5)
    messages = [str(w.message) for w in recwarn if "BatchNorm" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("f_R keeps 3 BatchNorm layers unfolded: ")
    assert "block.bn_shared" in messages[0]


def test_fold_batchnorm_never_traces_away_a_hook():
    """A traced module would lose its forward hooks: a module with hooks in it is folded inside its children only."""
    block = _randomize_batchnorms(_Untraceable.Block())
    seen = []
    block.shared.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert set(unfolded_batchnorms(block)) == {"bn", "bn_shared"} and "hooks" in unfolded_batchnorms(block)["bn"]
    folded = fold_batchnorm(block)
    x = torch.randn(2, 4, 4, 4, generator=_gen(5))
    with torch.no_grad():
        torch.testing.assert_close(folded(x), block(x))
    assert len(seen) == 2  # the hook ran in the copy too


def test_linear_batchnorm1d_folds_for_feature_vectors_only():
    """Linear -> BatchNorm1d folds into one linear layer on [B, F] inputs; on [B, C, F] inputs BatchNorm1d
    normalizes dim 1 (C), not the linear layer's outputs, and the folded copy still computes that."""
    torch.manual_seed(0)
    net = _randomize_batchnorms(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)))
    folded = fold_batchnorm(net)
    assert _batchnorms(folded) == 0 and len(folded) == 1
    with torch.no_grad():
        for shape in ((7, 5), (7, 4, 5)):
            x = torch.randn(*shape, generator=_gen(4))
            torch.testing.assert_close(folded(x), net(x), rtol=1e-5, atol=1e-6)
