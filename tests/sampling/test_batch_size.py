"""The engine's batch size: measured once, never changing results, within its caps."""
from __future__ import annotations

import pytest
import torch

import splitz_fast as sz
from splitz_fast import Smoother
from _helpers import small_splitz as _small_splitz
from splitz_fast.sampling.engine import TUNE_MIN_BATCH, NoiseStream, SamplingEngine


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
