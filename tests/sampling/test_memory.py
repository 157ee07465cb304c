"""Measured decisions are remembered per machine and model (splitz_fast/sampling/memory.py): the batch-size tuner's
(a second engine with the same key does not measure, another thread count or model does, a damaged file warns once)
and each measured choice's verdict (a later engine skips the timing; a candidate remembered as slower is not even
prepared, one remembered as faster is still checked; failures are not remembered)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast.sampling.choices as choices
import splitz_fast.sampling.memory as memory
import splitz_fast.sampling.engine as sampling
from splitz_fast.sampling.choices import CopyChoice, Option, Variant
from splitz_fast.sampling.engine import SamplingEngine

SHAPE = torch.Size((3, 6, 6))
BATCHES = memory.BATCH_SIZES.file_name


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A fresh process as far as the tuner sees (no in-process decisions), the memory in ``tmp_path``, and the
    tuner replaced by a counter that answers 64: returns the list of calls."""
    calls = []
    monkeypatch.setenv(memory.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv(memory.SWITCH_VARIABLE, raising=False)
    monkeypatch.setattr(sampling, "_TUNED_BATCH", {})
    monkeypatch.setattr(memory, "_warned", set())
    monkeypatch.setattr(sampling, "_measure_batch_size", lambda engine, shape, cap: calls.append(shape) or 64)
    return calls


def _engine(width: int = 4) -> SamplingEngine:
    right = nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.Flatten(), nn.Linear(width * 16, 5))
    return SamplingEngine(right.eval(), 5, 0.25, torch.device("cpu"))


def _new_process(monkeypatch) -> None:
    monkeypatch.setattr(sampling, "_TUNED_BATCH", {})


def test_a_second_run_with_the_same_key_does_not_measure(measured, monkeypatch, tmp_path):
    assert _engine().batch_size(SHAPE, 256) == 64 and len(measured) == 1
    _new_process(monkeypatch)
    assert _engine().batch_size(SHAPE, 256) == 64 and len(measured) == 1  # read back from the file
    assert list(json.loads((tmp_path / BATCHES).read_text()).values()) == [64]


def test_another_thread_count_model_or_cap_measures_again(measured, monkeypatch):
    _engine().batch_size(SHAPE, 256)
    threads = torch.get_num_threads()
    try:
        _new_process(monkeypatch)
        torch.set_num_threads(threads + 1)
        _engine().batch_size(SHAPE, 256)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 2
    _new_process(monkeypatch)
    _engine(width=8).batch_size(SHAPE, 256)  # another f_R structure
    _engine().batch_size(SHAPE, 128)  # another cap
    assert len(measured) == 4
    _new_process(monkeypatch)
    for engine, cap in ((_engine(), 256), (_engine(width=8), 256), (_engine(), 128)):
        engine.batch_size(SHAPE, cap)
    assert len(measured) == 4  # each of them remembered


def test_the_weights_values_are_not_part_of_the_key(measured, monkeypatch):
    first, second = _engine(), _engine()  # the same layers, other random weights
    assert not torch.equal(first.source[0].weight, second.source[0].weight)
    first.batch_size(SHAPE, 256)
    _new_process(monkeypatch)
    second.batch_size(SHAPE, 256)
    assert len(measured) == 1


@pytest.mark.parametrize("damage", ["{not json", "[64]", '{"k": -3}', '{"k": true}'])
def test_a_damaged_file_warns_once_and_the_batch_is_measured(measured, monkeypatch, tmp_path, damage):
    (tmp_path / BATCHES).write_text(damage)
    with pytest.warns(UserWarning, match="damaged") as caught:
        assert _engine().batch_size(SHAPE, 256) == 64
        (tmp_path / BATCHES).write_text(damage)
        _new_process(monkeypatch)
        _engine().batch_size(SHAPE, 256)
    assert len(measured) == 2 and len([w for w in caught if "damaged" in str(w.message)]) == 1
    assert list(json.loads((tmp_path / BATCHES).read_text()).values()) == [64]  # rewritten


def test_the_memory_can_be_turned_off(measured, monkeypatch, tmp_path):
    monkeypatch.setenv(memory.SWITCH_VARIABLE, "0")
    _engine().batch_size(SHAPE, 256)
    _new_process(monkeypatch)
    _engine().batch_size(SHAPE, 256)
    assert len(measured) == 2 and not (tmp_path / BATCHES).exists()


def test_an_unwritable_folder_warns_and_the_run_goes_on(measured, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(memory.CACHE_DIR_VARIABLE, str(blocker / "cache"))  # a folder under a file
    with pytest.warns(UserWarning, match="cannot be remembered"):
        assert _engine().batch_size(SHAPE, 256) == 64


def test_every_test_has_a_memory_of_its_own_never_the_home_cache(request):
    """One test's remembered verdicts must not decide another's measurement (tests/conftest.py)."""
    assert memory.cache_dir().parent.name.startswith("splitz-test-cache-")
    assert memory.cache_dir().name == request.node.nodeid.replace("/", "_").replace(":", "_")[-120:]


def test_the_memory_is_written_atomically(measured, monkeypatch, tmp_path):
    """A failure while the new file is written leaves the old one whole and no temporary file behind."""
    _engine().batch_size(SHAPE, 256)
    before = (tmp_path / BATCHES).read_text()

    def failing_dump(obj, out, **kwargs):
        out.write("{partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memory.json, "dump", failing_dump)
    _new_process(monkeypatch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _engine(width=8).batch_size(SHAPE, 256)
    assert (tmp_path / BATCHES).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [BATCHES]


# ------------------------------------------------------------------------------------------- measured choices' verdicts

class _StandIn(CopyChoice):
    """A measured choice decided on the CPU (as the cast copy is), with a stand-in option."""

    OPTION = Option("stand_in", "baseline", "candidate")
    AUTO_DEVICES = ("cpu",)
    FORCED_DEVICES = None


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """The memory in ``tmp_path``, warnings as the environment gives them (not strict), and every timing counted
    (the candidate is always measured twice as fast): returns the list of timed calls."""
    monkeypatch.setenv(memory.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv(memory.SWITCH_VARIABLE, raising=False)
    monkeypatch.delenv("SPLITZ_STRICT", raising=False)
    timed = []

    def seconds(call, device, rounds=3):
        timed.append(call)
        return 1e-3 * (2 if len(timed) % 2 else 1)  # baseline first: 2 ms, candidate 1 ms

    monkeypatch.setattr(choices, "seconds_per_call", seconds)
    return timed


def _decide(choice, candidate, key=("f_R structure", "bfloat16"), rows=64):
    """``choice`` at a batch of ``rows`` with ``candidate`` against the identity baseline; the engine's key ``key``."""
    choice.memory_key = lambda: key
    batch = torch.ones(rows, 3)
    used = choice.choose(Variant(channels_last=False, pooled=False, rows=rows), lambda b: b, candidate,
                         lambda: batch, lambda: 1e-3)
    return used, choice.decisions[Variant(channels_last=False, pooled=False, rows=rows)]


def test_a_remembered_verdict_replaces_the_timing_and_the_candidate_is_still_checked(verdicts):
    used, first = _decide(_StandIn(None, "cpu"), lambda b: b)
    assert used and first.reason.startswith("measured at batch 64") and len(verdicts) == 2
    used, second = _decide(_StandIn(None, "cpu"), lambda b: b)  # a later engine, same key: no timing
    assert used and len(verdicts) == 2
    assert second.reason == f"remembered ({first.reason})" and second.candidate_s == first.candidate_s
    with pytest.warns(UserWarning, match="scores differ"):  # remembered faster, scoring differently now: not used
        used, third = _decide(_StandIn(None, "cpu"), lambda b: b + 1)
    assert not used and "differ" in third.reason and len(verdicts) == 2


def test_a_candidate_remembered_slower_is_not_prepared(verdicts, monkeypatch):
    monkeypatch.setattr(choices, "seconds_per_call", lambda call, device, rounds=3: verdicts.append(call) or (
        1e-3 if len(verdicts) % 2 else 2e-3))  # the candidate measured slower
    calls = []
    used, first = _decide(_StandIn(None, "cpu"), lambda b: calls.append(b) or b)
    assert not used and len(calls) == 1 and len(verdicts) == 2
    used, second = _decide(_StandIn(None, "cpu"), lambda b: calls.append(b) or b)
    assert not used and len(calls) == 1 and len(verdicts) == 2  # neither run nor timed
    assert second.reason == f"remembered ({first.reason})"


def test_failures_settings_and_other_models_are_not_taken_from_memory(verdicts, tmp_path):
    with pytest.warns(UserWarning, match="scores differ"):
        _decide(_StandIn(None, "cpu"), lambda b: b + 1)
    assert not (tmp_path / memory.VERDICTS.file_name).exists()  # a failure is reported in every run, not remembered
    _decide(_StandIn(None, "cpu"), lambda b: b)
    _decide(_StandIn(None, "cpu"), lambda b: b, key=("another f_R", "bfloat16"))
    _decide(_StandIn(None, "cpu"), lambda b: b, rows=128)
    assert len(verdicts) == 6  # another structure, another batch: measured
    used, forced = _decide(_StandIn(True, "cpu"), lambda b: b)
    assert used and forced.reason == "stand_in=True" and len(verdicts) == 6
    assert len(json.loads((tmp_path / memory.VERDICTS.file_name).read_text())) == 3


def test_an_engine_gives_its_choices_the_structure_and_precision_as_their_key():
    engine = SamplingEngine(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)).eval(), 3, 0.25, torch.device("cpu"),
                            precision="bfloat16")
    for choice in (engine.graphs, engine.fusion, engine.compiling, engine.casting):
        assert choice.memory_key() == (repr(engine.source), "bfloat16")
    engine.source[1] = nn.Linear(4, 5)  # an edit of f_R: another key from then on
    assert "out_features=5" in engine.casting.memory_key()[0]


def test_a_long_structure_is_kept_as_its_hash_and_the_rest_of_the_key_stays_readable(verdicts, tmp_path):
    long_repr = "Sequential(" + "Conv2d(64, 64), " * 40 + ")"
    _decide(_StandIn(None, "cpu"), lambda b: b, key=(long_repr, "bfloat16"))
    (key,) = json.loads((tmp_path / memory.VERDICTS.file_name).read_text())
    assert long_repr not in key and "sha256:" in key and '"bfloat16"' in key and "stand_in" in key
    used, again = _decide(_StandIn(None, "cpu"), lambda b: b, key=(long_repr, "bfloat16"))
    assert again.reason.startswith("remembered") and len(verdicts) == 2
