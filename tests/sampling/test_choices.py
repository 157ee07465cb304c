"""The engine's measured choices (splitz_fast/sampling/choices.py) as CUDA graphs, torch.compile and fused kernels use
them: one named Variant key, one Decision, and a candidate that fails (capture, compile, fused kernels, scores that
differ) reported once as a fallback, an error under SPLITZ_STRICT=1, while one measured slower is no warning at all.
Every step that needs a GPU is a stand-in here (a capture that fails, scripted timings, a compiler that raises)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import splitz_fast as sz
from splitz_fast.sampling import choices, graphs
from splitz_fast.sampling.choices import Variant
from splitz_fast.sampling.compiled import CompileChoice
from splitz_fast.sampling.epilogues import ConvReLU, FusionChoice
from splitz_fast.sampling.graphs import GraphCaptureError, GraphChoice
from _helpers import small_splitz

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
STRICT = "SPLITZ_STRICT=1 makes every fallback an error"
AT_64 = Variant(channels_last=True, pooled=False, rows=64)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("SPLITZ_STRICT", "1")


def _scripted_timings(monkeypatch, *seconds: float) -> None:
    """seconds_per_call answers ``seconds`` in turn (baseline, then candidate, per decision)."""
    answers = iter(seconds)
    monkeypatch.setattr(choices, "seconds_per_call", lambda call, device, rounds=None: next(answers))


def test_a_variant_is_a_named_frozen_key():
    compiled = dataclasses.replace(AT_64, compiled=True)
    assert compiled == Variant(channels_last=True, pooled=False, fused=False, compiled=True, rows=64)
    assert compiled != AT_64 and {AT_64: 1}[Variant(channels_last=True, pooled=False, rows=64)] == 1
    assert AT_64.layout == (True, False)
    with pytest.raises(TypeError):
        Variant(True, False, False, False, 64)  # keywords only: no positional tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        AT_64.rows = 128


@pytest.mark.parametrize("make", [GraphChoice, FusionChoice, CompileChoice])
@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_every_choice_refuses_a_setting_other_than_none_true_false(make, bad):
    with pytest.raises(ValueError, match=rf"{make.OPTION.setting} must be None \(measure\), True or False"):
        make(bad, CUDA)


def test_true_off_cuda_is_refused_for_graphs_and_fusion_and_allowed_for_compile():
    for make in (GraphChoice, FusionChoice):
        with pytest.raises(ValueError, match=f"{make.OPTION.setting}=True needs f_R on a CUDA device"):
            make(True, torch.device("cpu"))
    assert CompileChoice(True, torch.device("cpu")).considered
    assert not CompileChoice(None, torch.device("cpu")).considered and CompileChoice(None, CUDA).considered


# ---------------------------------------------------------------------------------------------------- CUDA graphs
def _failing_capture(monkeypatch):
    def capture(scores, example, tolerance):
        raise GraphCaptureError("RuntimeError: operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs, "capture_scores", capture)


def _choose_graph(choice: GraphChoice, variant: Variant = AT_64):
    return choice.choose(variant, lambda b: b, lambda: torch.zeros(64, 3), lambda: 1e-2)


def test_a_failed_capture_warns_once_and_keeps_eager(monkeypatch, lenient):
    _failing_capture(monkeypatch)
    choice = GraphChoice(None, CUDA)
    with pytest.warns(UserWarning, match=r"^f_R could not run as a CUDA graph \(capture failed: RuntimeError"):
        assert _choose_graph(choice) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per engine
        assert _choose_graph(choice, dataclasses.replace(AT_64, rows=128)) is None
    assert [d.reason.startswith("capture failed") and not d.used for d in choice.decisions.values()] == [True, True]


@pytest.mark.parametrize("setting", [None, True])
def test_a_failed_capture_raises_under_splitz_strict(monkeypatch, strict, setting):
    _failing_capture(monkeypatch)
    with pytest.raises(RuntimeError, match=f"compiled f_R could not run as a CUDA graph .*{STRICT}"):
        _choose_graph(GraphChoice(setting, CUDA), dataclasses.replace(AT_64, compiled=True))


class _StandInGraph:
    """What capture_scores returns, without a GPU: its input buffer and a replay."""

    def __init__(self, batch):
        self.input = batch

    def replay(self):
        return self.input


def test_a_graph_measured_slower_is_not_used_and_not_a_fallback(monkeypatch, strict):
    monkeypatch.setattr(graphs, "capture_scores", lambda scores, example, tolerance: _StandInGraph(example))
    _scripted_timings(monkeypatch, 1e-3, 2e-3, 2e-3, 1e-3)  # eager, graph: slower, then faster
    choice = GraphChoice(None, CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choose_graph(choice) is None
        faster = _choose_graph(choice, dataclasses.replace(AT_64, rows=128))
    assert isinstance(faster, _StandInGraph)
    slower = choice.decisions[AT_64]
    assert not slower.used and (slower.baseline_s, slower.candidate_s) == (1e-3, 2e-3)
    assert slower.reason == "measured at batch 64: eager 1.000 ms, graph 2.000 ms"
    assert choice.records()[0] == dict(channels_last=True, pooled=False, fused=False, compiled=False, batch=64,
                                       used=False, reason=slower.reason, eager_s=1e-3, graph_s=2e-3)


# ---------------------------------------------------------------------------------------------------- fused kernels
class _After(torch.nn.Module):
    """What a fused copy does after its one site: adds 1 to the scores, or fails as a kernel without an image."""

    def __init__(self, broken: bool):
        super().__init__()
        self.broken = broken

    def forward(self, h):
        if self.broken:
            raise RuntimeError("no kernel image is available for execution on the device")
        return h.flatten(1) + 1.0


def _one_site(after: torch.nn.Module | None = None):
    """A plain conv + ReLU f_R, its fused copy (one ConvReLU site, then ``after`` or a Flatten) and a batch."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1).eval()
    plain = torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.Flatten())
    return plain, torch.nn.Sequential(ConvReLU(conv), after or torch.nn.Flatten()), torch.randn(8, 2, 4, 4)


def _choose_fused(choice, plain, fused, batch):
    def scores(net, b):
        with torch.no_grad():
            return net(b)
    return choice.choose(AT_64, lambda b: scores(plain, b), fused, scores, lambda: batch, lambda: 1e-3)


@pytest.mark.parametrize("broken, why", [(False, "its scores differ from the plain f_R's"),
                                         (True, "failed: RuntimeError: no kernel image")])
def test_a_fused_copy_that_fails_or_differs_raises_under_splitz_strict(strict, broken, why):
    """Each site computes alike here; the copy as a whole must too (the check of the whole copy stays)."""
    choice = FusionChoice(True, CUDA)
    with pytest.raises(RuntimeError, match=f"fused kernels are not used \\({why}.*{STRICT}"):
        _choose_fused(choice, *_one_site(_After(broken)))
    assert not choice.decisions[AT_64].used


def test_a_fused_copy_measured_slower_is_not_a_fallback(monkeypatch, strict):
    _scripted_timings(monkeypatch, 1e-3, 3e-3)
    choice = FusionChoice(None, CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choose_fused(choice, *_one_site()) is None
    site = dict(used=False, reason="measured on 8x2x4x4: plain 1.000 ms, fused 3.000 ms", plain_s=1e-3, fused_s=3e-3)
    assert choice.records() == [dict(channels_last=True, pooled=False, fused=False, compiled=False, batch=64,
                                     used=False, reason="0 of 1 sites fused at batch 64: plain 1.000 ms, chosen 1.000 ms",
                                     plain_s=1e-3, fused_s=1e-3, sites={"0": site})]


# ---------------------------------------------------------------------------------------------------- torch.compile
def _compiler(monkeypatch, run):
    """torch.compile replaced: the "compiled" entry calls ``run(net, batch)``."""
    monkeypatch.setattr(torch, "compile", lambda entry, **kwargs: run)


def test_a_compile_that_fails_raises_under_splitz_strict(monkeypatch, strict):
    def failing(net, batch):
        raise RuntimeError("inductor: LoweringException\nview(...) of a channels_last tensor\n  File ...")

    _compiler(monkeypatch, failing)
    model, xs = small_splitz()
    with pytest.raises(RuntimeError, match=f"^torch.compile failed \\(RuntimeError: inductor: LoweringException\\); "
                                           f"sampling runs f_R eagerly \\({STRICT}\\)$"):
        sz.Smoother(model, 0.4, compile=True).predict(xs[0], 200, 0.05, batch_size=64, seed=0)


@pytest.mark.parametrize("error, cause", [
    ("inductor: LoweringException\n" + "dump line\n" * 13, "inductor: LoweringException"),
    ("backend='inductor' raised:\nValueError: Cannot view a tensor\n\nWhile executing ...",
     "backend='inductor' raised: ValueError: Cannot view a tensor")])
def test_a_compile_failure_warns_once_in_one_line_with_its_cause(monkeypatch, lenient, error, cause):
    def failing(net, batch):
        raise RuntimeError(error)

    _compiler(monkeypatch, failing)
    model, xs = small_splitz()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sz.Smoother(model, 0.4, compile=True).predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert messages == [f"torch.compile failed (RuntimeError: {cause}); sampling runs f_R eagerly"]


def test_a_compiled_copy_that_scores_differently_raises_under_splitz_strict(monkeypatch, strict):
    _compiler(monkeypatch, lambda net, batch: net(batch) + 1.0)
    model, xs = small_splitz()
    with pytest.raises(RuntimeError, match=f"compiled f_R is not used \\(its scores differ .*{STRICT}"):
        sz.Smoother(model, 0.4, compile=True).predict(xs[0], 200, 0.05, batch_size=64, seed=0)


def test_a_compile_decision_records_its_compile_time_under_its_name(monkeypatch, lenient):
    _compiler(monkeypatch, lambda net, batch: net(batch))
    model, xs = small_splitz()
    smoother = sz.Smoother(model, 0.4, compile=True)
    smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    record, = smoother.engine().compiling.records()
    assert record["used"] and record["reason"] == "compile=True" and record["batch"] == 64
    assert record["compile_s"] >= 0 and record["eager_s"] is None and record["compiled_s"] is None

