"""certify_many on CUDA matches one by one, and the host reads per image do not grow with the model or the batches."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast import Smoother, SplitModel
from _helpers import small_splitz as _small_splitz
from splitz_fast.certify.windows import WINDOW_BATCHES


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
