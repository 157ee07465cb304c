"""The prepared f_R's rewrites (chain, max pool, flatten, pooled noise, worker threads, compile) compute the user's
f_R: the same votes, bitwise where the rewrite is exact."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast import LeftHalf, Smoother, SplitModel
from _helpers import small_splitz as _small_splitz
from splitz_fast.sampling.engine import NoiseStream, SamplingEngine


CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_prepared_chain_keeps_the_max_pool_kernel_on_cuda(monkeypatch):
    """The 2x2 max pool runs as two strided maxima (MaxPool2x2) on the CPU only; a copy prepared for CUDA keeps
    nn.MaxPool2d (decided from the device; nothing is allocated on it here)."""
    from splitz_fast.sampling import prepared as preparing

    right = sz.build_model("lenet", split_index=0).right
    cuda, cpu = torch.device("cuda"), CPU
    assert preparing._pools_as_strided_maxima(cpu) and not preparing._pools_as_strided_maxima(cuda)
    on_cpu = preparing._cheaper_chain(copy.deepcopy(right), True, device=cpu)
    on_cuda = preparing._cheaper_chain(copy.deepcopy(right), True, device=cuda)
    assert [type(m).__name__ for m in on_cpu][:6] == ["Conv2d", "MaxPool2x2", "ReLU", "Conv2d", "MaxPool2x2", "ReLU"]
    assert [type(m).__name__ for m in on_cuda][:8] == ["Conv2d", "MaxPool2d", "_ChannelBias", "ReLU", "Conv2d",
                                                       "MaxPool2d", "_ChannelBias", "ReLU"]
    # the engine passes its own device: with moves to the device stubbed out, a CUDA engine prepares MaxPool2d
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)
    engine = SamplingEngine(right, 10, 0.25, cuda)
    prepared = engine.prepared.get(channels_last=True)
    assert sum(type(m) is nn.MaxPool2d for m in prepared) == 2
    assert not any(isinstance(m, preparing.MaxPool2x2) for m in prepared)


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


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_channels_last_chain_flattens_in_storage_order(device):
    """A channels_last chain prepared for CUDA or the CPU replaces Flatten + Linear with _FlattenLinear (the Linear's
    parameters shared, the channels those of the last convolution), and the pool before it writes channels_last (on
    the CPU: MaxPool2x2); an NCHW chain keeps both; the function is the same."""
    from splitz_fast.sampling import prepared as preparing

    right = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 2 * 2, 3), nn.ReLU(),
                          nn.Linear(3, 2)).double().eval()
    target, source = torch.device(device), copy.deepcopy(right)
    chain = preparing._cheaper_chain(source, True, device=target)
    names = [type(m).__name__ for m in chain]
    assert names[-3:] == ["_FlattenLinear", "ReLU", "Linear"] and chain[-3].channels == 6
    assert chain[-3].linear is source[7] and "Flatten" not in names
    if device == "cpu":
        assert [m.channels_last for m in chain if isinstance(m, preparing.MaxPool2x2)] == [True, True]
    kept = [type(m).__name__ for m in preparing._cheaper_chain(copy.deepcopy(right), False, device=target)]
    assert "_FlattenLinear" not in kept and kept[-4:] == ["Flatten", "Linear", "ReLU", "Linear"]
    x = torch.randn(5, 2, 12, 12, generator=_gen(32), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(chain(x.contiguous(memory_format=torch.channels_last)), right(x), rtol=1e-12,
                                   atol=1e-12)


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
    assert [type(m).__name__ for m in prepared][:6] == ["Conv2d", "MaxPool2x2", "ReLU", "Conv2d", "MaxPool2d", "ReLU"]
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
    """The prepared chain's 2x2 max pool (MaxPool2x2: two maxima of strided views) gives bitwise F.max_pool2d's
    values, NaN and infinities included, odd sizes floored, for contiguous and channels_last inputs (1-channel ones
    too); its 4-D output is channels_last when the chain runs channels_last."""
    from splitz_fast.sampling.pooling import MaxPool2x2

    x = torch.randn(*shape, generator=_gen(5))
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("inf")
    x.view(-1)[5::13] = -float("inf")
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    want, got = nn.functional.max_pool2d(x, 2), MaxPool2x2(channels_last)(x)
    assert got.shape == want.shape
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())
    if channels_last and x.ndim == 4:
        assert got.is_contiguous(memory_format=torch.channels_last)
    from splitz_fast.sampling import prepared as preparing

    chain = preparing._cheaper_chain(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.MaxPool2d(2, 1),
                                                  nn.MaxPool2d(2, ceil_mode=True)), channels_last, device=CPU)
    assert [type(m).__name__ for m in chain] == ["Conv2d", "MaxPool2x2", "MaxPool2d", "MaxPool2d", "ReLU"]
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


def test_compile_falls_back_to_eager_with_one_warning(lenient, monkeypatch):
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
