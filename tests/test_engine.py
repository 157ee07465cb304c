"""The dataset-level engine (splitz_fast.sampling.engine / smoothing.certify_many / radius) and the soundness of its caches:
results of a stream equal one-by-one certification, the noise does not depend on batching, f_R is
prepared without changing the user's model, batched γ passes never lose radius, and no cached bound or prepared
copy survives a change of the model.
"""
from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast import LeftHalf, Smoother, SplitModel
from splitz_fast.bounds.radius import BoundOptions, bisection_reference
from _helpers import small_splitz as _small_splitz
from splitz_fast.certify.windows import WINDOW_BATCHES
from splitz_fast.sampling.engine import (NOISE_BLOCK, TUNE_MIN_BATCH, NoiseStream, SamplingEngine, fold_batchnorm,
                                         unfolded_batchnorms)


CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- noise streams
@pytest.mark.parametrize("backend", ["auto", "reference"])  # the Philox stream (native kernel), the fallback
@pytest.mark.parametrize("channels_last", [False, True])
def test_noise_stream_is_a_function_of_the_sample_index_only(channels_last, backend, monkeypatch):
    monkeypatch.setenv("SPLITZ_BACKEND", backend)
    latent = torch.rand(3, 4, 5, generator=_gen(1))
    whole = NoiseStream(7, torch.device("cpu")).noisy(latent, 300, 0.5, torch.float32, channels_last)
    for sizes in ([1, 63, 64, 65, 107], [300], [NOISE_BLOCK] * 4 + [44], [17] * 17 + [11]):
        stream = NoiseStream(7, torch.device("cpu"))
        parts = [stream.noisy(latent, k, 0.5, torch.float32, channels_last) for k in sizes]
        assert torch.equal(torch.cat(parts), whole), sizes
        assert stream.offset == 300
    other_seed = NoiseStream(8, torch.device("cpu")).noisy(latent, 300, 0.5, torch.float32, channels_last)
    assert not torch.equal(other_seed, whole)
    if channels_last:
        assert whole.is_contiguous(memory_format=torch.channels_last)


def test_noise_stream_writes_into_a_given_buffer_and_casts_after_the_float32_sum():
    latent = torch.rand(6, generator=_gen(2))
    ref = NoiseStream(3, torch.device("cpu")).noisy(latent, 40, 0.3, torch.float32, False)
    out = torch.full((40, 6), float("nan"), dtype=torch.bfloat16)
    got = NoiseStream(3, torch.device("cpu")).noisy(latent, 40, 0.3, torch.bfloat16, False, out=out)
    assert got is out and torch.equal(out, ref.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------- certify_many
@pytest.mark.parametrize("n0,n,batch", [  # ~20 s per case on 2 CPU cores: the odd batch size by default
    pytest.param(10, 50, 64, marks=pytest.mark.slow), pytest.param(20, 300, 128, marks=pytest.mark.slow),
    pytest.param(30, 1000, 4096, marks=pytest.mark.slow), (5, 40, 7)])
def test_certify_many_equals_one_by_one(n0, n, batch):
    """Packed batches (several inputs per f_R batch, one sync per group) give the one-by-one results."""
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.4)
    seeds = [11 * i + 3 for i in range(len(xs))]
    alone = [smoother.certify(x, n0, n, 0.01, batch_size=batch, seed=s) for x, s in zip(xs, seeds)]
    stream = list(smoother.certify_many(xs, n0, n, 0.01, batch_size=batch, seeds=seeds))
    other_batch = list(smoother.certify_many(iter(xs), n0, n, 0.01, batch_size=batch + 13, seeds=seeds))
    key = lambda r: (r.prediction, r.count_a, r.radius, r.lipschitz, r.gamma, r.seed)  # noqa: E731
    assert [key(r) for r in stream] == [key(r) for r in alone] == [key(r) for r in other_batch]
    assert len({r.prediction for r in alone}) >= 1 and all(r.n == n for r in alone)


def test_certify_many_with_overlapped_bounds_equals_inline():
    model, xs = _small_splitz(1)
    seeds = list(range(len(xs)))
    inline = list(Smoother(model, 0.4, overlap_bounds=False).certify_many(xs, 10, 200, 0.01, batch_size=64,
                                                                         seeds=seeds))
    overlapped = list(Smoother(model, 0.4, overlap_bounds=True).certify_many(xs, 10, 200, 0.01, batch_size=64,
                                                                            seeds=seeds))
    assert [(r.prediction, r.count_a, r.radius) for r in inline] == \
           [(r.prediction, r.count_a, r.radius) for r in overlapped]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bad_at", [0, 1, 5, 6])
def test_certify_many_gives_every_result_before_a_bad_input_then_its_error(bad_at, overlap):
    """Windows of 5 inputs here (4 batches of 64 samples, 60 per input): a bad input at the start, inside the first
    window, at the start of the second and inside it. The results before it come out (equal to a clean run's),
    then its error; none is lost with the unfinished window or with the overlapped searches of the previous one."""
    model, xs = _small_splitz(1)
    smoother = Smoother(model, 0.4, overlap_bounds=overlap)
    clean = list(smoother.certify_many(xs, 10, 50, 0.01, batch_size=64, seeds=range(len(xs))))
    inputs = [*xs[:bad_at], torch.full_like(xs[0], math.nan), *xs[bad_at:]]
    got = []
    with pytest.raises(ValueError, match="NaN"):
        for result in smoother.certify_many(iter(inputs), 10, 50, 0.01, batch_size=64, seeds=range(len(inputs))):
            got.append(result)
    key = lambda r: (r.prediction, r.count_a, r.radius, r.seed)  # noqa: E731
    assert [key(r) for r in got] == [key(r) for r in clean[:bad_at]]


def test_predict_many_and_a_seed_list_too_short_give_the_results_before_the_error():
    model, xs = _small_splitz(2)
    smoother = Smoother(model, 0.6)
    got = []
    with pytest.raises(ValueError, match="NaN"):
        for result in smoother.predict_many([*xs[:6], torch.full_like(xs[0], math.inf)], 60, 0.05, batch_size=64,
                                            seeds=range(7)):
            got.append(result)
    assert [r.seed for r in got] == list(range(6))
    short = []
    with pytest.raises(ValueError, match="seed"):
        for result in smoother.certify_many(iter(xs), 10, 50, 0.01, batch_size=64, seeds=range(6)):
            short.append(result)  # a lazy iterable: the missing seed shows at the seventh input
    assert [r.seed for r in short] == list(range(6))


def test_predict_many_equals_one_by_one_and_counts_every_sample():
    model, xs = _small_splitz(2)
    smoother = Smoother(model, 0.6)
    alone = [smoother.predict(x, 120, 0.05, batch_size=50, seed=i) for i, x in enumerate(xs)]
    many = list(smoother.predict_many(xs, 120, 0.05, batch_size=50, seeds=range(len(xs))))
    assert [(p.prediction, p.count_top, p.count_second) for p in many] == \
           [(p.prediction, p.count_top, p.count_second) for p in alone]


def test_certify_many_checks_arguments_before_sampling():
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.4)
    with pytest.raises(ValueError, match="n0"):
        smoother.certify_many(xs, 20, 10, 0.01)
    with pytest.raises(ValueError, match="alpha"):
        smoother.certify_many(xs, 10, 20, 1.5)
    with pytest.raises(ValueError, match="batch_size"):
        smoother.certify_many(xs, 10, 20, 0.01, batch_size=0)
    with pytest.raises(TypeError, match="one seed per input"):
        smoother.certify_many(xs, 10, 20, 0.01, seeds=3)


def _certifiers_of_many(model, xs):
    """Every lazy call that takes one seed per input, as ``call(inputs, seeds)``."""
    smoother = Smoother(model, 0.4)
    margin_model = SplitModel(LeftHalf([nn.Linear(36, 5)], [None], input_shape=(1, 6, 6)), nn.Identity(), 5)
    attacker = sz.Attacker(smoother, attack="smooth-fgsm", eps=0.1, samples=2)
    sequential = sz.SequentialCertifier(smoother, radii=[0.05])
    return {
        "certify_many": lambda inputs, seeds: smoother.certify_many(inputs, 10, 20, 0.01, batch_size=64, seeds=seeds),
        "predict_many": lambda inputs, seeds: smoother.predict_many(inputs, 20, 0.01, batch_size=64, seeds=seeds),
        "sequential": lambda inputs, seeds: sequential.certify_many(inputs, 10, 40, 0.01, batch_size=64, seeds=seeds),
        "margin": lambda inputs, seeds: sz.MarginCertifier(margin_model).certify_many(inputs, seeds=seeds),
        "attack": lambda inputs, seeds: attacker.attack_many(_labelled(inputs), 20, 0.01, batch_size=64, seeds=seeds),
    }


def _labelled(inputs):
    """``(x, 0)`` pairs: a list for a tensor or list of inputs, else as lazy as ``inputs``."""
    if isinstance(inputs, (list, torch.Tensor)):
        return [(x, 0) for x in inputs]
    return ((x, 0) for x in inputs)


CALLS = ["certify_many", "predict_many", "sequential", "margin", "attack"]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("seeds,count", [([0], "1 seed for 3 inputs"), (range(10), "10 seeds for 3 inputs")],
                         ids=["too-few", "too-many"])
def test_as_many_seeds_as_inputs_or_an_error_before_any_work(call, seeds, count):
    model, xs = _small_splitz()
    calls = _certifiers_of_many(model, xs[:3])
    with pytest.raises(ValueError, match=f"seeds: {count}; give one seed per input"):
        calls[call](xs[:3], seeds)  # raised by the call itself, before its first result is asked for
    with pytest.raises(ValueError, match=f"seeds: {count}"):
        calls[call](list(xs[:3]), seeds)


@pytest.mark.parametrize("call", CALLS)
def test_a_lazy_input_stream_with_too_few_seeds_stops_before_the_unseeded_input(call):
    model, xs = _small_splitz()
    calls = _certifiers_of_many(model, xs)
    fetched = []

    def stream():
        for i in range(3):
            fetched.append(i)
            yield xs[i]

    got = []
    with pytest.raises(ValueError, match="seeds: 1 seed for at least 2 inputs; give one seed per input"):
        for result in calls[call](stream(), [0]):
            got.append(result)
    assert fetched == [0, 1]  # stopped at the input without a seed, the third never read
    assert [r.seed for r in got] in ([], [0])  # certify_many samples inputs in groups: 0 is still in its group


@pytest.mark.parametrize("call", CALLS)
def test_seeds_left_over_at_the_end_of_a_lazy_input_stream_are_an_error(call):
    model, xs = _small_splitz()
    calls = _certifiers_of_many(model, xs)
    with pytest.raises(ValueError, match="seeds: 3 seeds for 2 inputs"):
        list(calls[call](iter(xs[:2]), [0, 1, 2]))
    with pytest.raises(ValueError, match="seeds: more than 2 seeds for 2 inputs"):
        list(calls[call](iter(xs[:2]), iter(range(5))))
    assert len(list(calls[call](iter(xs[:2]), iter(range(2))))) == 2


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
    pools as strided maxima, ReLUs after them and in place)."""
    model = sz.build_model("lenet", split_index=split)
    assert unfolded_batchnorms(model.right) == {}
    folded = fold_batchnorm(model.right)
    assert [type(m) for m in folded] == [type(m) for m in model.right] and folded is not model.right
    engine = SamplingEngine(model.right, 10, 0.25, CPU)
    engine.prepared.check_current()
    prepared = engine.prepared.get(channels_last=True, pooled=pooled)
    chain = ["Conv2d", "_MaxPool2x2", "ReLU", "Flatten", "Linear", "ReLU", "Linear"]
    want = {0: ["Conv2d", "_MaxPool2x2", "ReLU"] + chain, 1: ["_MaxPool2x2"] + chain}[split][int(pooled):]
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


def test_prepared_chain_keeps_the_max_pool_kernel_on_cuda(monkeypatch):
    """The 2x2 max pool runs as two strided maxima (_MaxPool2x2) on the CPU only; a copy prepared for CUDA keeps
    nn.MaxPool2d (decided from the device; nothing is allocated on it here)."""
    from splitz_fast.sampling import prepared as preparing

    right = sz.build_model("lenet", split_index=0).right
    cuda, cpu = torch.device("cuda"), CPU
    assert preparing._pools_as_strided_maxima(cpu) and not preparing._pools_as_strided_maxima(cuda)
    on_cpu = preparing._cheaper_chain(copy.deepcopy(right), True, device=cpu)
    on_cuda = preparing._cheaper_chain(copy.deepcopy(right), True, device=cuda)
    assert [type(m).__name__ for m in on_cpu][:6] == ["Conv2d", "_MaxPool2x2", "ReLU", "Conv2d", "_MaxPool2x2", "ReLU"]
    assert [type(m).__name__ for m in on_cuda][:8] == ["Conv2d", "MaxPool2d", "_ChannelBias", "ReLU", "Conv2d",
                                                       "MaxPool2d", "_ChannelBias", "ReLU"]
    # the engine passes its own device: with moves to the device stubbed out, a CUDA engine prepares MaxPool2d
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)
    engine = SamplingEngine(right, 10, 0.25, cuda)
    prepared = engine.prepared.get(channels_last=True)
    assert sum(type(m) is nn.MaxPool2d for m in prepared) == 2
    assert not any(isinstance(m, preparing._MaxPool2x2) for m in prepared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, 2, padding=1), nn.MaxPool2d(2, ceil_mode=True)])
def test_a_per_channel_bias_added_after_a_max_pool_is_bitwise_the_same(dtype, pool):
    """The identity behind adding a convolution's bias after its pool on CUDA: rounding fl(v + b) is monotone in v,
    so maxpool(v + b) equals maxpool(v) + b bit for bit in every float type, with padding (-inf) and NaN."""
    from splitz_fast.sampling.prepared import _ChannelBias

    gen = _gen(21)
    v = (torch.randn(3, 4, 7, 7, generator=gen) * 100).to(dtype)
    v[0, 1, 2, 3] = float("nan")
    v[1, 2] = v[1, 2, 0, 0]  # ties across a whole channel
    bias = nn.Parameter(torch.randn(4, generator=gen) * 50)
    want = pool(v + bias.to(dtype).view(1, -1, 1, 1))
    with torch.no_grad():
        got = _ChannelBias(bias)(pool(v))
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_conv_bias_moves_after_its_max_pool_on_cuda_only():
    """A CUDA chain adds a convolution's bias after the max pool that follows it (the same parameter, shared); a CPU
    chain keeps it in the convolution (oneDNN adds it there). Convolutions not followed by a pool keep theirs. The
    function is the same (float64, where only the summation order of the bias differs)."""
    from splitz_fast.sampling import prepared as preparing

    right = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 2 * 2, 3)).double().eval()
    source = copy.deepcopy(right)
    on_cuda = preparing._cheaper_chain(source, device=torch.device("cuda"))
    assert [type(m).__name__ for m in on_cuda] == ["Conv2d", "MaxPool2d", "_ChannelBias", "ReLU", "Conv2d", "ReLU",
                                                   "Flatten", "Linear"]
    assert on_cuda[0].bias is None and on_cuda[4].bias is source[3].bias
    assert on_cuda[2].bias is source[0].bias and on_cuda[0].weight is source[0].weight
    on_cpu = preparing._cheaper_chain(copy.deepcopy(right), device=CPU)
    assert not any(type(m).__name__ == "_ChannelBias" for m in on_cpu) and on_cpu[0].bias is not None
    x = torch.randn(5, 2, 8, 8, generator=_gen(22), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(on_cuda(x), right(x), rtol=1e-13, atol=1e-13)


def _dispatched(fn, *args) -> list[str]:
    """The ATen ops ``fn(*args)`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn(*args)
    return record.ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flatten_linear_reads_a_channels_last_activation_without_copying_it(dtype):
    """_FlattenLinear computes linear(flatten(x)) for channels_last, NCHW and odd inputs (a permutation of each
    output's summands: equal in float64 to rounding, float32 within its own); on a channels_last activation it
    dispatches no copy, where Flatten + Linear copies the activation into NCHW order."""
    from splitz_fast.sampling.prepared import _FlattenLinear

    linear = nn.Linear(6 * 3 * 5, 4).to(dtype)
    fused = _FlattenLinear(linear, 6)
    assert fused.linear is linear
    x = torch.randn(7, 6, 3, 5, generator=_gen(31), dtype=dtype)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        want = linear(x.flatten(1))
        channels_last = x.contiguous(memory_format=torch.channels_last)
        for view in (x, channels_last, x[:, :, :, ::1].transpose(2, 3).contiguous().transpose(2, 3)):
            torch.testing.assert_close(fused(view), want, **tolerance)
        copies = ("clone", "copy_", "contiguous", "_unsafe_view", "_reshape_copy")
        assert not set(_dispatched(fused, channels_last)) & set(copies)
        assert set(_dispatched(nn.Sequential(nn.Flatten(), linear), channels_last)) & set(copies)
        torch.testing.assert_close(fused(x.flatten(1)), want, **tolerance)  # already flat: as the Linear


def test_chain_flattens_in_storage_order_on_cuda_only():
    """A channels_last chain prepared for CUDA replaces Flatten + Linear with _FlattenLinear (the Linear's parameters
    shared, the channels those of the last convolution); CPU and NCHW chains keep both; the function is the same."""
    from splitz_fast.sampling import prepared as preparing

    right = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(6 * 2 * 2, 3), nn.ReLU(), nn.Linear(3, 2)).double().eval()
    cuda, source = torch.device("cuda"), copy.deepcopy(right)
    chain = preparing._cheaper_chain(source, True, device=cuda)
    names = [type(m).__name__ for m in chain]
    assert names[-3:] == ["_FlattenLinear", "ReLU", "Linear"] and chain[-3].channels == 6
    assert chain[-3].linear is source[6] and "Flatten" not in names
    for channels_last, device in ((False, cuda), (True, CPU)):
        kept = [type(m).__name__ for m in preparing._cheaper_chain(copy.deepcopy(right), channels_last, device=device)]
        assert "_FlattenLinear" not in kept and kept[-4:] == ["Flatten", "Linear", "ReLU", "Linear"]
    x = torch.randn(5, 2, 8, 8, generator=_gen(32), dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(chain(x), right(x), rtol=1e-12, atol=1e-12)


def test_flatten_linear_of_a_cuda_copy_follows_edits_of_the_users_linear(monkeypatch):
    """The permuted weight of a CUDA-prepared chain is made from f_R as it is: after an in-place edit of the user's
    Linear, check_current rebuilds the copy, whose scores (float64) then equal the edited f_R's, not the old ones."""
    from splitz_fast.sampling.prepared import PreparedClassifier, _FlattenLinear

    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)  # a CUDA copy, built on the CPU
    right = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 3)).double().eval()
    prepared = PreparedClassifier(right, torch.device("cuda"))
    x = torch.randn(5, 2, 6, 6, generator=_gen(33), dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    for edit in range(2):
        prepared.check_current()
        copy_ = prepared.get(channels_last=True)
        assert any(isinstance(m, _FlattenLinear) for m in copy_)
        with torch.no_grad():
            torch.testing.assert_close(copy_(x), right(x), rtol=1e-12, atol=1e-12)
            right[4].weight.mul_(-2.0)  # edited in place between calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_prepared_lenet_on_cuda_scores_like_the_users_f_r(precision):
    """On CUDA the prepared LeNet (bias after the pools, ReLU after the pools, channels_last) scores a noisy batch
    as the user's module does under the engine's precision (float32: to 1e-5 of the largest score; bf16: to its
    rounding)."""
    model = sz.build_model("lenet", split_index=0).cuda().eval()
    engine = SamplingEngine(model.right, 10, 0.25, torch.device("cuda"), precision=precision, cuda_graphs=False)
    prepared = engine.prepared.get(channels_last=True)
    assert sum(type(m).__name__ == "_ChannelBias" for m in prepared) == 2
    x = torch.rand(256, 1, 28, 28, device="cuda")
    got = engine._scores(prepared, x.to(engine.dtype).contiguous(memory_format=torch.channels_last)).float()
    want = engine._scores(model.right, x.to(engine.dtype)).float()
    scale = float(want.abs().max()) + 1
    assert float((got - want).abs().max()) <= (1e-5 if precision == "float32" else 5e-2) * scale


def test_certify_sidecar_records_whether_batchnorm_is_folded():
    """`bn_folded` enters every certify sidecar: false only for an f_R that keeps a BatchNorm unfolded, so a resume
    never mixes rows sampled through the folded and the unfolded f_R."""
    from splitz_fast.runs.tasks import CertifyRun

    small, pooling = _small_splitz()[0], _pooling_splitz()[0]
    unfoldable = SplitModel(copy.deepcopy(small.left), nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4),
                                                                     nn.Flatten(), nn.Linear(64, 5)), 5)
    for model, folded in ((small, True), (pooling, True), (unfoldable, False)):
        settings = CertifyRun(sz.Smoother(model, 0.5), 10, 100, 0.001).settings()
        assert settings["bn_folded"] is folded


def _pooling_splitz(seed: int = 0) -> tuple[SplitModel, torch.Tensor]:
    """LeNet's shape in miniature: f_R starts with MaxPool2d(2), so the engine draws the pooled noise in one pass."""
    torch.manual_seed(seed)
    left = LeftHalf([nn.Conv2d(1, 4, 3, padding=1)], [sz.ClippedReLU(1.0)], input_shape=(1, 8, 8))
    right = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(24, 12), nn.ReLU(), nn.Linear(12, 5))
    return SplitModel(left, right, 5), torch.rand(4, 1, 8, 8, generator=_gen(seed + 7))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_pool_fused_into_the_noise_gives_the_same_votes(precision, monkeypatch):
    """The fused draw max_pool2d(latent + σz, 2) followed by f_R[1:] is the same base classifier as f_R on the
    full-size noisy batch: the same counts for every input (the pooled values are bitwise equal, tested in
    test_kernels_noise_votes), and the user's f_R keeps its layers and ReLU flags."""
    model, xs = _pooling_splitz()
    smoother = Smoother(model, 0.6, precision=precision)
    engine = smoother.engine()
    if not engine.pools_in_noise(torch.Size((4, 8, 8))):
        pytest.skip("the fused pool needs the native noise kernel")
    fused = list(smoother.certify_many(xs, 20, 400, 0.01, batch_size=96, seeds=range(4)))
    monkeypatch.setattr(SamplingEngine, "pools_in_noise", lambda self, shape: False)
    plain = list(Smoother(model, 0.6, precision=precision).certify_many(xs, 20, 400, 0.01, batch_size=96,
                                                                        seeds=range(4)))
    assert [(r.prediction, r.count_a) for r in fused] == [(r.prediction, r.count_a) for r in plain]
    assert isinstance(model.right[0], nn.MaxPool2d) and len(model.right) == 8
    assert not any(m.inplace for m in model.right if isinstance(m, nn.ReLU))


def test_prepared_chain_pools_before_its_relus_with_the_same_function_and_votes(monkeypatch):
    """ReLU -> MaxPool2d pairs of a plain chain run as MaxPool2d -> ReLU (in place) in the prepared copy: the same
    outputs (max commutes with the monotone ReLU; NaN propagates), and the same votes as the unchanged chain."""
    from splitz_fast.sampling import prepared as preparing

    torch.manual_seed(3)
    right = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1),
                          nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), nn.Flatten(),
                          nn.Linear(54, 5))
    prepared = preparing._cheaper_chain(copy.deepcopy(right), device=CPU)
    assert [type(m).__name__ for m in prepared][:6] == ["Conv2d", "_MaxPool2x2", "ReLU", "Conv2d", "MaxPool2d", "ReLU"]
    assert all(m.inplace for m in prepared if isinstance(m, nn.ReLU))
    assert not any(m.inplace for m in right if isinstance(m, nn.ReLU))  # the user's chain is untouched
    x = torch.randn(16, 1, 8, 8)
    x[3, 0, 2, 2] = float("nan")
    with torch.no_grad():
        want, got = right(x), prepared(x.clone())
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())
    model = SplitModel(LeftHalf([], [], input_shape=(1, 8, 8)), right, 5)
    xs = torch.rand(3, 1, 8, 8, generator=_gen(4))
    fast = list(Smoother(model, 0.5).predict_many(xs, 300, 0.05, batch_size=64, seeds=range(3)))
    monkeypatch.setattr(preparing, "_cheaper_chain",
                        lambda module, channels_last=False, device=None, fused=False: module)
    plain = list(Smoother(model, 0.5).predict_many(xs, 300, 0.05, batch_size=64, seeds=range(3)))
    assert [(p.count_top, p.count_second) for p in fast] == [(p.count_top, p.count_second) for p in plain]
    chain = nn.Sequential(nn.ReLU(), sz.ClippedReLU(1.0), nn.MaxPool2d(2))
    assert preparing._cheaper_chain(chain, device=CPU)[0].inplace is False


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(5, 3, 8, 8), (4, 6, 7, 9), (3, 1, 28, 28), (2, 5, 6)])
def test_prepared_2x2_max_pool_is_bitwise_max_pool2d(shape, channels_last):
    """The prepared chain's 2x2 max pool (_MaxPool2x2: two maxima of strided views) gives bitwise F.max_pool2d's
    values, NaN and infinities included, odd sizes floored, for contiguous and channels_last inputs (1-channel ones
    too); its 4-D output is channels_last when the chain runs channels_last."""
    from splitz_fast.sampling.prepared import _MaxPool2x2

    x = torch.randn(*shape, generator=_gen(5))
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("inf")
    x.view(-1)[5::13] = -float("inf")
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    want, got = nn.functional.max_pool2d(x, 2), _MaxPool2x2(channels_last)(x)
    assert got.shape == want.shape
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())
    if channels_last and x.ndim == 4:
        assert got.is_contiguous(memory_format=torch.channels_last)
    from splitz_fast.sampling import prepared as preparing

    chain = preparing._cheaper_chain(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.MaxPool2d(2, 1),
                                                  nn.MaxPool2d(2, ceil_mode=True)), channels_last, device=CPU)
    assert [type(m).__name__ for m in chain] == ["Conv2d", "_MaxPool2x2", "MaxPool2d", "MaxPool2d", "ReLU"]
    flat = preparing._cheaper_chain(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()), True,
                                   device=CPU)
    assert flat[1].channels_last is False  # feeds a Flatten (through the ReLU): NCHW, so the Flatten is a view
    with torch.no_grad():
        y = flat[:3](torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last))
    assert y.is_contiguous() and flat[3](y).data_ptr() == y.data_ptr()
    assert flat(torch.randn(2, 3, 8, 8)).requires_grad  # with autograd on it still runs (no out=)


@pytest.mark.parametrize("split", ["small", "pooling"])
def test_worker_threads_give_the_same_votes_and_restore_the_thread_count(split, monkeypatch):
    """With 2 torch threads the CPU engine runs its batches on 2 worker threads (one intra-op thread each): the
    same counts as one thread running them in order (the same batches of the same reserved samples; votes are sums),
    and the caller's thread count is unchanged afterwards. A fallback (non-Philox) stream stays sequential."""
    model, xs = _small_splitz() if split == "small" else _pooling_splitz()
    used = []
    execute = SamplingEngine._execute

    def spy(self, net, plan, channels_last, pooled, batch_size, parallel, *rest):
        args = (channels_last, pooled, batch_size, parallel, *rest)
        used.append(parallel and len(plan) > 1 and all(first is not None for seg in plan for _, _, first in seg))
        return execute(self, net, plan, *args)

    monkeypatch.setattr(SamplingEngine, "_execute", spy)
    threads = torch.get_num_threads()

    def certify(num_threads):
        torch.set_num_threads(num_threads)
        try:
            return [(r.prediction, r.count_a, r.p_a_lower) for r in Smoother(model, 0.5).certify_many(
                xs, 30, 500, 0.01, batch_size=64, seeds=range(len(xs)))], torch.get_num_threads()
        finally:
            torch.set_num_threads(threads)

    parallel, after = certify(2)
    assert after == 2 and any(used)
    sequential, _ = certify(1)
    assert parallel == sequential
    stream = NoiseStream(0, torch.device("cpu"))
    if stream.addressable:
        first = stream.reserve(5)
        assert (first, stream.offset) == (0, 5)
        latent = torch.rand(4, 8, 8)
        torch.testing.assert_close(stream.noisy(latent, 5, 0.5, torch.float32, True, at=first),
                                   NoiseStream(0, torch.device("cpu")).noisy(latent, 5, 0.5, torch.float32, True),
                                   rtol=0, atol=0)
        assert stream.offset == 5
    monkeypatch.setenv("SPLITZ_BACKEND", "reference")
    assert not NoiseStream(0, torch.device("cpu")).addressable


def test_only_a_plain_leading_2x2_max_pool_is_fused():
    from splitz_fast.sampling.prepared import starts_with_maxpool2

    rest = [nn.Flatten(), nn.Linear(4, 2)]
    assert starts_with_maxpool2(nn.Sequential(nn.MaxPool2d(2), *rest))
    assert starts_with_maxpool2(nn.Sequential(nn.MaxPool2d((2, 2), stride=2), *rest))
    for pool in (nn.MaxPool2d(3), nn.MaxPool2d(2, stride=1), nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, ceil_mode=True),
                 nn.MaxPool2d(2, dilation=2), nn.AvgPool2d(2)):
        assert not starts_with_maxpool2(nn.Sequential(pool, *rest)), pool
    assert not starts_with_maxpool2(nn.MaxPool2d(2))  # not a Sequential: nothing to run after it
    model, _ = _pooling_splitz()
    assert not model.right is None and not SamplingEngine(model.right, 5, 0.5, torch.device("cpu")).pools_in_noise(
        torch.Size((4, 7, 8)))  # odd H


def test_engine_rebuilds_the_prepared_copy_when_f_r_changes():
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.4)
    first = smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    with torch.no_grad():
        model.right[4].bias.data += torch.tensor([0.0, 0.0, 0.0, 0.0, 100.0])  # .data: no version bump
    after = smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    assert after.prediction == 4 and after.count_top == 200
    assert first.count_top != 200 or first.prediction != 4


def test_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    model, xs = _small_splitz()

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")  # torch.compile itself fails

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        got = Smoother(model, 0.4, compile=True).certify(xs[0], 10, 100, 0.01, batch_size=64, seed=1)
    eager = Smoother(model, 0.4).certify(xs[0], 10, 100, 0.01, batch_size=64, seed=1)
    assert (got.prediction, got.count_a) == (eager.prediction, eager.count_a)


def test_the_compiled_f_r_sees_only_full_batches_and_short_ones_run_eagerly(monkeypatch):
    """With compile on, every batch the compiled f_R scores has the full (static) size: the short ones at the end of
    each window run the eager copy, unpadded, so a compiled f_R costs no padded rows and never recompiles."""
    model, xs = _small_splitz()
    seen = []

    def recording_compiler(entry, **kwargs):
        def run(net, batch):
            seen.append(batch.shape[0])
            return entry(net, batch)
        return run

    monkeypatch.setattr(torch, "compile", recording_compiler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(Smoother(model, 0.4, compile=True).predict_many(xs[:3], 100, 0.05, batch_size=64, seeds=[0, 1, 2]))
    # full batches only, and no padding: the compiled f_R scored at most the 300 draws plus the compile check's batch
    # (padded short batches would add up to more)
    assert set(seen) == {64} and sum(seen) <= 3 * 100 + 64
    eager = list(Smoother(model, 0.4).predict_many(xs[:3], 100, 0.05, batch_size=64, seeds=[0, 1, 2]))
    assert [(p.count_top, p.count_second) for p in got] == [(p.count_top, p.count_second) for p in eager]


def test_batch_size_is_measured_once_and_never_changes_results():
    model, xs = _small_splitz(3)
    smoother = Smoother(model, 0.4, max_batch_size=256)
    auto = smoother.certify(xs[0], 10, 300, 0.01, seed=4)
    fixed = smoother.certify(xs[0], 10, 300, 0.01, batch_size=33, seed=4)
    assert (auto.prediction, auto.count_a, auto.radius) == (fixed.prediction, fixed.count_a, fixed.radius)
    engine = smoother.engine()
    chosen = engine.batch_size(torch.Size((3, 6, 6)), 256)
    assert 32 <= chosen <= 256 and chosen == engine.batch_size(torch.Size((3, 6, 6)), 256)


def test_the_tuner_cap_is_the_given_one_or_the_default_of_the_device():
    model, _ = _small_splitz(3)
    assert Smoother(model, 0.4).max_batch_size == sz.sampling.engine.DEFAULT_MAX_BATCH == 4096
    assert Smoother(model, 0.4, max_batch_size=100).max_batch_size == 100
    with pytest.raises(ValueError, match="max_batch_size"):
        Smoother(model, 0.4, max_batch_size=0)
    if torch.cuda.is_available():
        assert Smoother(model.cuda(), 0.4).max_batch_size == sz.sampling.engine.DEFAULT_MAX_BATCH_CUDA == 32768


@pytest.mark.parametrize("rates, tried, chosen", [
    # a plateau from 1024 on: 2048 and 4096 gain < 5 % each, so 8192 and up are never tried
    ({32: 1, 64: 2, 128: 4, 256: 8, 512: 12, 1024: 15, 2048: 15.5, 4096: 15.6}, 8, 4096),
    # throughput still growing by >= 5 % per doubling: every size up to the cap
    ({b: 1.1 ** i for i, b in enumerate(2 ** k for k in range(5, 16))}, 11, 32768),
    # cache-sized optimum, then slower: two sizes below the best after it, and the sweep ends
    ({32: 5, 64: 9, 128: 10, 256: 11, 512: 8, 1024: 6, 2048: 20}, 6, 256),
    # below TUNE_MIN_SEARCH a dip does not end the sweep
    ({32: 5, 64: 4, 128: 4.5, 256: 9, 512: 12, 1024: 11, 2048: 10, 4096: 30}, 7, 512),
])
def test_the_tuner_stops_where_throughput_levels_off_or_falls(monkeypatch, rates, tried, chosen):
    """The batch sweep (scripted rates per size): stops after two sizes in a row that gain under TUNE_MIN_GAIN over
    the best (a plateau or past the optimum), once past TUNE_MIN_SEARCH; returns the fastest size it measured."""
    import splitz_fast.sampling.engine as sampling

    calls = []

    def scripted(engine, net, job, *args):
        calls.append(job.num)
        return rates[job.num]

    monkeypatch.setattr(sampling, "_samples_per_second", scripted)
    model, _ = _small_splitz()
    engine = SamplingEngine(model.right, model.num_classes, 0.25, torch.device("cpu"))
    assert sampling._measure_batch_size(engine, (3, 6, 6), 32768) == chosen
    sweep = sorted(set(calls))
    assert len(sweep) == tried and sweep == sorted(rates)[:tried]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_tuner_keeps_the_batch_working_memory_within_its_share_of_the_card(monkeypatch):
    """With the share set to 64 MiB, LeNet's measured batch (whose throughput would still grow) stops where its
    working memory would pass it, and a batch of that size indeed stays within it."""
    import splitz_fast.sampling.engine as sampling

    total = torch.cuda.get_device_properties(0).total_memory
    limit = 64 * 2 ** 20
    monkeypatch.setattr(sampling, "TUNE_MEMORY_FRACTION", limit / total)
    model = sz.build_model("lenet", split_index=0).cuda().eval()
    engine = Smoother(model, 0.25).engine()
    shape = torch.Size((1, 28, 28))
    chosen = engine.batch_size(shape, 1 << 20)
    assert TUNE_MIN_BATCH <= chosen < 1 << 20
    memory = sampling._BatchMemory(torch.device("cuda"))
    job = sampling.SamplingJob(torch.zeros(shape, device="cuda"), NoiseStream(0, torch.device("cuda")), chosen,
                               torch.zeros(10, dtype=torch.int64, device="cuda"))
    net = engine.prepared.get(True, False)
    with memory.measuring(chosen), torch.inference_mode():  # as the engine samples (its prepared copy's tensors)
        engine._execute(net, [[sampling._segment(job, chosen)]], True, False, chosen, False)
    assert chosen * memory.per_sample <= limit


# ---------------------------------------------------------------------------------------------------- γ search
@pytest.mark.parametrize("name", [pytest.param("lenet", marks=pytest.mark.slow), "lenet-splitz"])  # ~9 s each, 2 cores
def test_batched_gamma_passes_never_lose_radius_against_bisection(name):
    """gamma_batch = 4 (8) evaluates a superset of the bisection's points (in half (a third of) the passes): never a
    smaller radius with exact bounds, and every reported radius is min(R/L(x, γ), γ) at its γ."""
    torch.manual_seed(0)
    model = sz.build_model(name, split_index=1).eval()
    xs = torch.rand(2, 1, 28, 28, generator=_gen(len(name)))
    for i, x in enumerate(xs):
        for radius_latent in (0.2, 0.8):
            two, four, eight = (
                Smoother(model, 0.5, bound_options=BoundOptions(gamma_batch=batch, bound_method="exact"))
                .radius_search.search(x, radius_latent, None) for batch in (2, 4, 8))
            assert four.radius >= two.radius - 1e-15 and eight.radius >= two.radius - 1e-15, (i, radius_latent)
            assert eight.passes <= 4
            # At most the bisection's passes and points (points covered by a larger bounded ball are not re-bounded).
            assert two.passes <= 9 and four.passes <= 5
            assert two.evaluations <= 10 and four.evaluations <= 14
            lip = float(sz.lipschitz_bound(model.left, x.unsqueeze(0), four.gamma, method="exact").value[0])
            assert four.lipschitz >= lip * (1 - 1e-12)  # L(x, γ) itself or a larger ball's: a bound at γ either way
            assert four.radius == pytest.approx(min(radius_latent / four.lipschitz, four.gamma), rel=1e-12)


@pytest.mark.parametrize("radius_latent", [0.2, 0.8, 1.5])
def test_skipping_covered_gammas_keeps_the_bisection_radius(radius_latent):
    """The search does not re-bound a γ that a larger bounded ball already certifies: same radius as a bisection that
    bounds every point, with fewer bound evaluations."""
    torch.manual_seed(0)
    model = sz.build_model("lenet-splitz", split_index=1).eval()
    x = torch.rand(1, 28, 28, generator=_gen(3))
    options = BoundOptions(bound_method="exact")
    found = Smoother(model, 0.5, bound_options=options).radius_search.search(x, radius_latent, None)
    reference = bisection_reference(model.left, x, radius_latent, options)
    assert found.radius == pytest.approx(reference, rel=1e-9)
    assert found.evaluations <= 10


# ---------------------------------------------------------------------------------------------------- stale caches
def _edits():
    """Ways users change f_L's first layer without bumping what a version counter sees, or at all in place."""

    def data_write(left):
        left.layers[0].weight.data *= 3.0

    def copy_under_no_grad(left):
        with torch.no_grad():
            left.layers[0].weight.copy_(left.layers[0].weight * 3.0)

    def load_state_dict(left):
        state = copy.deepcopy(left.state_dict())
        state["layers.0.weight"] = state["layers.0.weight"] * 3.0
        left.load_state_dict(state)

    def swap_module(left):
        old = left.layers[0]
        new = copy.deepcopy(old)
        with torch.no_grad():
            new.weight.mul_(3.0)
        left.layers[0] = new

    return [data_write, copy_under_no_grad, load_state_dict, swap_module]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_global_bound_follows_every_change_of_f_l(edit):
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.4, bound_options=BoundOptions(bound="global"))
    before = smoother.certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    edit(model.left)
    after = smoother.certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    fresh = Smoother(model, 0.4, bound_options=smoother.options).certify(xs[0], 10, 200, 0.01, batch_size=64, seed=0)
    # 3x the weights, 3x the norm (up to the certificate's own slack: the Cholesky shift sits ~1e-8 above λ_max) ...
    assert after.lipschitz == pytest.approx(3.0 * before.lipschitz, rel=1e-6)
    # ... and exactly what a fresh smoother computes: nothing of the old weights survives.
    assert (after.lipschitz, after.radius) == (fresh.lipschitz, fresh.radius)


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_margin_certifier_follows_every_change_of_f_l(edit):
    model = sz.tabular_mlp(4, hidden=(6,), split_index=2)
    x = torch.randn(4, generator=_gen(9))
    certifier = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound="global"))
    certifier.certify(x, seed=0)
    edit(model.left)
    after = certifier.certify(x, seed=0)
    fresh = sz.MarginCertifier(model, bound_options=sz.BoundOptions(bound="global")).certify(x, seed=0)
    assert (after.prediction, after.latent_radius, after.lipschitz, after.radius) == \
           (fresh.prediction, fresh.latent_radius, fresh.lipschitz, fresh.radius)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_certify_many_on_cuda_matches_one_by_one_up_to_batch_rounding():
    """On CUDA the noise is the Triton Philox stream (a function of seed and sample index); only f_R's
    batch-dependent rounding can move a vote between packed and one-by-one runs."""
    model, xs = _small_splitz()
    model = model.cuda()
    smoother = Smoother(model, 0.4)
    seeds = list(range(len(xs)))
    alone = [smoother.certify(x.cuda(), 20, 500, 0.01, batch_size=128, seed=s) for x, s in zip(xs, seeds)]
    many = list(smoother.certify_many(xs.cuda(), 20, 500, 0.01, batch_size=96, seeds=seeds))
    assert all(r.noise_source == "philox4x32-10" for r in many)
    for a, m in zip(alone, many):
        assert a.prediction == m.prediction and abs(a.count_a - m.count_a) <= 2


def _deepened(depth: int, split_index: int) -> SplitModel:
    """A small conv net with ``depth`` extra identity conv + ReLU layers before its classifier: the same function, so
    the same votes and radius searches, at every depth; only the number of f_R's layers (and tensors) changes."""
    torch.manual_seed(0)
    first, last = nn.Conv2d(1, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 3)  # drawn first: the same at every depth
    layers = [first, nn.ReLU()]
    for _ in range(depth):
        conv = nn.Conv2d(8, 8, 3, padding=1)
        nn.init.dirac_(conv.weight)
        nn.init.zeros_(conv.bias)
        layers += [conv, nn.ReLU()]
    return sz.split_sequential(nn.Sequential(*layers, nn.Flatten(), last), split_index, num_classes=3,
                               input_shape=(1, 8, 8))


# n0 + n of the host-sync tests: above WINDOW_BATCHES batches at both batch sizes, so every image is a window of its own
# either way (a window's syncs are per window, and smaller batches would otherwise mean more, smaller windows).
_SYNC_N = 5000

# The tensor methods that copy a value to the host, and so wait for the device when the tensor is on CUDA.
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _certify_stream(smoother: Smoother, xs: torch.Tensor, batch_size: int) -> list:
    assert 10 + _SYNC_N >= WINDOW_BATCHES * batch_size  # one window per image
    return list(smoother.certify_many(xs, 10, _SYNC_N, 0.01, batch_size=batch_size, seeds=range(len(xs))))


@pytest.mark.parametrize("split_index", [0, 1], ids=["rs", "splitz"])
def test_host_reads_per_image_on_cpu_do_not_grow_with_the_model_or_the_batches(monkeypatch, split_index):
    """On the CPU, after a warm-up call, the calls of certify_many that would synchronise with a GPU (a tensor's value
    read on the host, torch.equal) stay the same per image whatever the number of layers of f_R and the number of
    f_R batches per image: none per batch, none per tensor of f_R. RS and SPLITZ (whose radius search reads its
    bounds on the host once per step, independent of f_R)."""
    xs = torch.rand(4, 1, 8, 8, generator=_gen(1))

    def host_reads(depth: int, batch_size: int) -> tuple[list, float]:
        smoother = Smoother(_deepened(depth, split_index), 0.25)
        _certify_stream(smoother, xs[:2], batch_size)  # warm-up
        calls = []  # list.append is atomic: the engine's worker threads may read too

        def counted(name, original):
            @functools.wraps(original)
            def call(*args, **kwargs):
                calls.append(name)
                return original(*args, **kwargs)
            return call

        with monkeypatch.context() as patched:
            for name in _HOST_READS:
                patched.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
            patched.setattr(torch, "equal", counted("equal", torch.equal))
            results = _certify_stream(smoother, xs, batch_size)
        return [(r.prediction, r.count_a, r.radius) for r in results], len(calls) / len(xs)

    results, few = host_reads(depth=1, batch_size=1024)
    assert any(radius > 0 for _, _, radius in results)  # certified images: SPLITZ's radius searches ran
    deep_results, deep = host_reads(depth=12, batch_size=1024)
    assert deep_results == results
    assert deep <= few, (deep, few)  # 11 more conv layers: no read per tensor
    small_results, small = host_reads(depth=1, batch_size=128)
    assert small_results == results
    assert small <= few, (small, few)  # 8x the f_R batches: no read per batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_syncs_per_image_do_not_grow_with_the_model_or_the_batches():
    """RS (s = 0, no radius search) over a stream of images on CUDA: after a warm-up call, the host synchronisations
    counted by torch's sync debug mode stay a few per image — the votes read once per window, the edit guard one
    comparison per dtype group of each half — whatever the number of layers of f_R and the number of f_R batches
    per image (no sync per batch, none per tensor)."""

    def syncs(depth: int, batch_size: int) -> float:
        smoother = Smoother(_deepened(depth, 0).cuda(), 0.25)
        xs = torch.rand(8, 1, 8, 8, device="cuda")
        _certify_stream(smoother, xs[:2], batch_size)  # warm-up
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _certify_stream(smoother, xs, batch_size)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught) / len(xs)

    few = syncs(depth=1, batch_size=1024)
    assert few <= 10, few
    assert syncs(depth=12, batch_size=1024) <= few + 1  # 11 more conv layers: no sync per tensor
    assert syncs(depth=1, batch_size=128) <= few + 1  # 8x the f_R batches: no sync per batch


def test_bound_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="gamma_batch"):
        BoundOptions(gamma_batch=1)
    for batch in (3, 6, 12):  # only powers of two evaluate a superset of the bisection's points
        with pytest.raises(ValueError, match=rf"gamma_batch must be a power of two \(2, 4, 8, ...\), got {batch}"):
            BoundOptions(gamma_batch=batch)
    assert BoundOptions(gamma_batch=8).passes == 3
    with pytest.raises(ValueError, match="gamma_search"):
        BoundOptions(gamma_search="grid")
    with pytest.raises(TypeError, match="gamma_stpes"):
        BoundOptions(gamma_stpes=3)
    with pytest.raises(TypeError, match="'method'"):  # one name per setting: the CLI's --bound-method
        BoundOptions(method="exact")
    # The certifiers take the options as one object, and nothing else in its place.
    model = sz.tabular_mlp(4, hidden=(8,), split_index=2)  # the whole classifier in f_L: both certifiers take it
    for build in (functools.partial(Smoother, model, 0.5), functools.partial(sz.MarginCertifier, model)):
        with pytest.raises(TypeError, match="bound_options must be a splitz_fast.BoundOptions or None, got dict"):
            build(bound_options={"bound_method": "exact"})
        assert build(bound_options=None).options == BoundOptions()
    assert BoundOptions(gamma_steps=8, gamma_batch=2).max_evaluations == 10  # L(x, 0), the ceiling, 8 midpoints
    assert BoundOptions(gamma_steps=8, gamma_batch=4).passes == 4
    assert BoundOptions(gamma_search="one-step").max_evaluations == 3


@pytest.mark.parametrize("method,search", [("exact", "bisection"), ("exact", "one-step"),
                                           ("probabilistic", "bisection")])
def test_batched_searches_of_a_window_equal_each_inputs_own_search(method, search):
    """RadiusSearch.search_many advances several inputs' searches in lockstep with one ball-bound pass per round; every
    result (radius, γ, L, kind, failure, evaluations) equals the input's own search, random starts included."""
    torch.manual_seed(0)
    model = sz.build_model("lenet-splitz", split_index=1).eval()
    xs = list(torch.rand(3, 1, 28, 28, generator=_gen(5)))
    radii = [0.3, 0.8, 1.4]
    smoother = Smoother(model, 0.5, bound_options=BoundOptions(bound_method=method, gamma_search=search, power_iters=8))

    def generators():
        return [torch.Generator().manual_seed(100 + i) for i in range(len(xs))]

    together = smoother.radius_search.search_many(xs, radii, generators())
    alone = [smoother.radius_search.search(x, r, g) for x, r, g in zip(xs, radii, generators())]
    assert together == alone


def test_batched_certificates_of_a_window_match_each_inputs_own_search(monkeypatch):
    """Where the shift is placed by squaring (CUDA's default, forced here on CPU tensors), the exact factors of all the
    inputs of a round are certified in one batch (several Grams per batched step): every result matches the input's
    own search up to the last bits of its bound, and the radius is min(R/L, γ) with L the host solver's certificate at
    that γ (to the shift's slack)."""
    import splitz_fast.bounds.certificate as certificate

    monkeypatch.setattr(certificate, "_takes_squaring", lambda gram, estimator: gram.layout != torch.sparse_csr)
    batch_sizes = []
    squared = certificate._squared_certificates
    monkeypatch.setattr(certificate, "_squared_certificates",
                        lambda grams, terms: batch_sizes.append(len(grams)) or squared(grams, terms))
    model, xs = _small_splitz()
    xs, radii = list(xs[:4]), [0.2, 0.5, 0.9, 1.6]
    search = Smoother(model, 0.5, bound_options=BoundOptions(bound_method="exact")).radius_search
    together = search.search_many(xs, radii, [None] * len(xs))
    assert batch_sizes and max(batch_sizes) >= 2
    alone = [search.search(x, r, None) for x, r in zip(xs, radii)]
    for t, a, x, r in zip(together, alone, xs, radii):
        # (γ itself may be another point of the same radius: where R/L(γ) < γ, last-bit ties pick among them)
        assert (t.evaluations, t.kind) == (a.evaluations, a.kind) and t.radius == pytest.approx(a.radius, rel=1e-12)
        monkeypatch.undo()  # the host solver's certificate at the same γ: both are proven bounds
        host = float(sz.lipschitz_bound(model.left, x.unsqueeze(0), t.gamma, method="exact").value[0])
        assert t.lipschitz == pytest.approx(host, rel=1e-8) and t.radius == pytest.approx(min(r / t.lipschitz, t.gamma))
        monkeypatch.setattr(certificate, "_takes_squaring", lambda gram, estimator: gram.layout != torch.sparse_csr)


def test_tf32_is_a_labelled_precision_that_computes_float32_on_the_cpu():
    """``tf32`` is float32 storage (on CUDA its convolutions and matmuls run in TF32: tests/test_cuda_math.py); on the
    CPU it computes what ``float32`` does."""
    from splitz_fast.sampling.engine import PRECISIONS

    assert PRECISIONS["tf32"] is torch.float32
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
    model = sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 6, 6), threshold=1.0)
    x = torch.rand(1, 6, 6, generator=torch.Generator().manual_seed(1))
    fp32, tf32 = (sz.Smoother(model, 0.5, precision=p).certify(x, 10, 200, 0.01, seed=3) for p in ("float32", "tf32"))
    assert fp32.count_a == tf32.count_a and fp32.radius == tf32.radius
