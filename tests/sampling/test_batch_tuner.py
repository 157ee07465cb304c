"""The batch-size tuner's time (splitz_fast/sampling/engine.py, _measure_batch_size) is bounded by what it can save:
no measurement starts that is projected to end past TUNE_BUDGET_S, on a stand-in f_R whose measurements take
scripted seconds on a stand-in clock (a deep f_R on the CPU spent minutes there before its first input)."""
from __future__ import annotations

import pytest
import torch

import splitz_fast.sampling.engine as sampling
from splitz_fast.sampling.engine import SamplingEngine
from _helpers import small_splitz


class _Clock:
    """time.perf_counter of the engine module: advanced only by the stand-in measurements."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scripted_sweep(monkeypatch, seconds_per_sample: float, rate_growth: float = 1.2):
    """Each measurement of a batch of b rows takes ``seconds_per_sample * b`` on the clock, and each doubling is
    ``rate_growth`` times faster (so the sweep never stops on a plateau); returns the clock and the sizes measured."""
    clock, measured = _Clock(), []

    def scripted(engine, net, job, *args):
        measured.append(job.num)
        clock.now += seconds_per_sample * job.num
        return rate_growth ** (job.num.bit_length())

    monkeypatch.setattr(sampling.time, "perf_counter", clock)
    monkeypatch.setattr(sampling, "_samples_per_second", scripted)
    return clock, measured


def _engine() -> SamplingEngine:
    model, _ = small_splitz()
    return SamplingEngine(model.right, model.num_classes, 0.25, torch.device("cpu"))


def test_the_tuner_starts_no_measurement_that_would_end_past_its_budget(monkeypatch):
    # 32 rows take 1 s: 32, 64 and 128 (1 + 2 + 4 s) fit in 8 s, 256 (projected 8 s more) does not; the second look
    # fits only what is left (128 again would end at 11 s, 64 at 9 s, 32 at 8 s).
    clock, measured = _scripted_sweep(monkeypatch, 1 / 32)
    chosen = sampling._measure_batch_size(_engine(), (3, 6, 6), 32768)
    assert measured == [32, 64, 128, 32] and chosen == 128
    assert clock.now <= sampling.TUNE_BUDGET_S


def test_a_first_size_over_the_budget_is_measured_alone(monkeypatch):
    clock, measured = _scripted_sweep(monkeypatch, 1.0)  # 32 rows: 32 s, four times the budget
    assert sampling._measure_batch_size(_engine(), (3, 6, 6), 32768) == 32
    assert measured == [32] and clock.now == pytest.approx(32.0)


def test_a_fast_f_r_is_swept_to_the_cap_and_its_leaders_looked_at_again(monkeypatch):
    clock, measured = _scripted_sweep(monkeypatch, 1e-7)
    assert sampling._measure_batch_size(_engine(), (3, 6, 6), 4096) == 4096
    assert measured == [32, 64, 128, 256, 512, 1024, 2048, 4096, 4096, 2048, 1024]
