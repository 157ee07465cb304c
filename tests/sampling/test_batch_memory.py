"""The batch-size tuner's decision is remembered per machine and model (splitz_fast/sampling/batch_memory.py): a second
engine with the same key does not measure, another thread count or model does, a damaged file warns once."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast.sampling.batch_memory as batch_memory
import splitz_fast.sampling.engine as sampling
from splitz_fast.sampling.engine import SamplingEngine

SHAPE = torch.Size((3, 6, 6))


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A fresh process as far as the tuner sees (no in-process decisions), the memory in ``tmp_path``, and the
    tuner replaced by a counter that answers 64: returns the list of calls."""
    calls = []
    monkeypatch.setenv(batch_memory.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv(batch_memory.SWITCH_VARIABLE, raising=False)
    monkeypatch.setattr(sampling, "_TUNED_BATCH", {})
    monkeypatch.setattr(batch_memory, "_warned", set())
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
    assert list(json.loads((tmp_path / batch_memory.FILE_NAME).read_text()).values()) == [64]


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
    (tmp_path / batch_memory.FILE_NAME).write_text(damage)
    with pytest.warns(UserWarning, match="damaged") as caught:
        assert _engine().batch_size(SHAPE, 256) == 64
        (tmp_path / batch_memory.FILE_NAME).write_text(damage)
        _new_process(monkeypatch)
        _engine().batch_size(SHAPE, 256)
    assert len(measured) == 2 and len([w for w in caught if "damaged" in str(w.message)]) == 1
    assert list(json.loads((tmp_path / batch_memory.FILE_NAME).read_text()).values()) == [64]  # rewritten


def test_the_memory_can_be_turned_off(measured, monkeypatch, tmp_path):
    monkeypatch.setenv(batch_memory.SWITCH_VARIABLE, "0")
    _engine().batch_size(SHAPE, 256)
    _new_process(monkeypatch)
    _engine().batch_size(SHAPE, 256)
    assert len(measured) == 2 and not (tmp_path / batch_memory.FILE_NAME).exists()


def test_an_unwritable_folder_warns_and_the_run_goes_on(measured, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(batch_memory.CACHE_DIR_VARIABLE, str(blocker / "cache"))  # a folder under a file
    with pytest.warns(UserWarning, match="cannot be remembered"):
        assert _engine().batch_size(SHAPE, 256) == 64


def test_the_test_session_never_writes_to_the_home_cache():
    assert batch_memory.cache_dir().name.startswith("splitz-test-cache-")


def test_the_memory_is_written_atomically(measured, monkeypatch, tmp_path):
    """A failure while the new file is written leaves the old one whole and no temporary file behind."""
    _engine().batch_size(SHAPE, 256)
    before = (tmp_path / batch_memory.FILE_NAME).read_text()

    def failing_dump(obj, out, **kwargs):
        out.write("{partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(batch_memory.json, "dump", failing_dump)
    _new_process(monkeypatch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _engine(width=8).batch_size(SHAPE, 256)
    assert (tmp_path / batch_memory.FILE_NAME).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [batch_memory.FILE_NAME]
