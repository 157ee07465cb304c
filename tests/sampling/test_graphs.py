"""CUDA graphs of f_R (splitz_fast/sampling/graphs.py and the engine's use of them): the options and their errors everywhere;
on a GPU, that a replayed graph scores whatever is in its input buffer exactly as the eager forward does, that
certificates through graphs are those of the eager path, that a capture that fails falls back with one warning, that
the default decides by measurement and records it, and that an edited f_R is captured again."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast import Smoother, SplitModel
from splitz_fast.sampling.choices import Variant
from splitz_fast.sampling.graphs import GraphCaptureError, capture_scores
from splitz_fast.sampling.score_checks import score_gap
from splitz_fast.sampling.engine import SamplingEngine
from _helpers import small_splitz



def _gpu(test):
    """A test that needs CUDA (marked ``gpu``; skipped elsewhere)."""
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)
    return pytest.mark.gpu(test)


def _small_splitz(device: str = "cpu") -> tuple[SplitModel, torch.Tensor]:
    """The engine tests' small conv model (BatchNorm in f_R, folded in the prepared copy) and 5 inputs, on ``device``."""
    model, xs = small_splitz()
    return model.to(device).eval(), xs[:5].to(device)


# ---------------------------------------------------------------------------------------------------- every machine
def test_cuda_graph_options_say_what_is_wrong():
    model, xs = _small_splitz()
    with pytest.raises(ValueError, match=r"cuda_graphs must be None \(measure\), True or False, got 'yes'"):
        Smoother(model, 0.5, cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs f_R on a CUDA device \(it is on cpu\)"):
        SamplingEngine(model.right, 5, 0.5, torch.device("cpu"), cuda_graphs=True)
    forced = Smoother(model, 0.5, cuda_graphs=True)  # the model may still move to a GPU: checked when sampling
    with pytest.raises(ValueError, match="cuda_graphs=True needs f_R on a CUDA device"):
        forced.certify(xs[0], 10, 100, 0.01, seed=0)


def test_on_a_cpu_the_default_samples_eagerly_and_decides_nothing():
    model, xs = _small_splitz()
    smoother = Smoother(model, 0.5)
    default = [r.count_a for r in smoother.certify_many(xs, 10, 300, 0.01, batch_size=64, seeds=range(5))]
    off = [r.count_a for r in Smoother(model, 0.5, cuda_graphs=False).certify_many(xs, 10, 300, 0.01, batch_size=64,
                                                                                     seeds=range(5))]
    assert default == off
    assert smoother.engine().graphs.decisions == {}


def test_graphs_are_dropped_with_the_prepared_copy_when_f_r_changes():
    """A graph holds the addresses of the prepared copy's tensors: the cache asks for a new capture after any edit of
    the user's f_R (weights in place, a replaced layer), and never between calls on an unchanged f_R."""
    from splitz_fast.sampling.prepared import PreparedClassifier

    model, _ = small_splitz()
    prepared = PreparedClassifier(model.right, torch.device("cpu"))
    captures = []

    def capture():
        captures.append(len(captures))
        return None  # "run eagerly": also a cached decision

    def ask():
        prepared.check_current()
        prepared.get(channels_last=True)
        prepared.graphed(Variant(channels_last=True, pooled=False, rows=64), capture)

    ask()
    ask()
    assert len(captures) == 1
    with torch.no_grad():
        model.right[0].weight.mul_(2.0)
    ask()
    assert len(captures) == 2
    model.right[4] = nn.Linear(64, 5)
    ask()
    assert len(captures) == 3
    prepared.graphed(Variant(channels_last=True, pooled=False, rows=128), capture)  # another batch size: its own capture
    assert len(captures) == 4


def test_capture_refuses_a_cpu_batch():
    with pytest.raises(GraphCaptureError, match="CUDA graphs need a CUDA device, f_R samples on cpu"):
        capture_scores(nn.Linear(3, 2), torch.zeros(4, 3), lambda: 1e-2)


# ---------------------------------------------------------------------------------------------------- on a GPU
@_gpu
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_replay_scores_what_is_in_the_input_buffer_like_eager(precision):
    """Rows written into the graph's input after the capture are what the replay scores, exactly as eager does."""
    model, _ = _small_splitz("cuda")
    engine = SamplingEngine(model.right, 5, 0.5, torch.device("cuda"), precision=precision, cuda_graphs=True)
    net = engine.prepared.get(channels_last=True)
    example = torch.randn(32, 3, 6, 6, device="cuda").to(engine.dtype).contiguous(memory_format=torch.channels_last)
    graphed = capture_scores(lambda b: engine._scores(net, b), example, lambda: 1e-2)
    for seed in range(3):
        rows = torch.randn(32, 3, 6, 6, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        graphed.input.copy_(rows.to(engine.dtype))
        replayed = graphed.replay().clone()
        eager = engine._scores(net, graphed.input.clone(memory_format=torch.channels_last))
        assert torch.equal(replayed, eager)


@_gpu
@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_certificates_through_graphs_are_those_of_the_eager_path(split, precision):
    """LeNet (advertorch architecture) at s = 0 and s = 1: the full batches scored by the replayed graph, the short
    ones eagerly; the graph replays the kernels that the eager forward runs at that batch shape, so the votes, and
    with them every certificate, are exactly those of eager sampling."""
    model = sz.build_model("lenet", split_index=split).cuda().eval()
    xs = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(1)).cuda()

    def run(graphs):
        smoother = Smoother(model, 0.5, precision=precision, cuda_graphs=graphs)
        out = list(smoother.certify_many(xs, 50, 3000, 0.01, batch_size=512, seeds=range(4)))
        return out, smoother.engine().graphs.decisions

    graphed, decisions = run(True)
    eager, none = run(False)
    assert none == {} and decisions and all(d.used for d in decisions.values())
    assert [(g.prediction, g.count_a, g.radius) for g in graphed] == [(e.prediction, e.count_a, e.radius)
                                                                         for e in eager]


class _SyncsInForward(nn.Module):
    """An f_R that asks the host for a value in its forward (``.item()``): not capturable as a CUDA graph."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3 * 6 * 6, 5)

    def forward(self, x):
        scale = 1.0 + 0.0 * float(x.flatten(1)[:1, :1].sum().item())
        return self.linear(x.flatten(1)) * scale


@_gpu
def test_a_capture_that_fails_warns_once_and_samples_eagerly():
    model, xs = _small_splitz("cuda")
    model.right = _SyncsInForward().cuda().eval()
    smoother = Smoother(model, 0.5, cuda_graphs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = [(r.prediction, r.count_a) for r in smoother.certify_many(xs, 10, 400, 0.01, batch_size=64,
                                                                            seeds=range(5))]
        again = [(r.prediction, r.count_a) for r in smoother.certify_many(xs, 10, 400, 0.01, batch_size=64,
                                                                           seeds=range(5))]
    messages = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(messages) == 1 and "sampling runs it without one" in messages[0]
    decisions = list(smoother.engine().graphs.decisions.values())
    assert decisions and not any(d.used for d in decisions) and decisions[0].reason.startswith("capture failed")
    eager = [(r.prediction, r.count_a) for r in Smoother(model, 0.5, cuda_graphs=False).certify_many(
        xs, 10, 400, 0.01, batch_size=64, seeds=range(5))]
    assert forced == again == eager


@_gpu
def test_a_failed_capture_leaves_the_default_generator_usable_where_it_was():
    """A capture that fails part-way must not leave the device's default generator marked as capturing (the user's
    next ``torch.rand(..., device="cuda")`` would raise), nor move it: the draws after it are those without it."""
    net = _SyncsInForward().cuda()
    example = torch.rand(8, 3, 6, 6, device="cuda")
    torch.cuda.manual_seed(123)
    expected = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(123)
    with pytest.raises(GraphCaptureError):
        capture_scores(net, example, lambda: 1e-3)
    assert torch.equal(torch.rand(5, device="cuda"), expected)


@_gpu
def test_the_default_decides_by_measurement_and_records_it():
    model, xs = _small_splitz("cuda")
    smoother = Smoother(model, 0.5)
    list(smoother.certify_many(xs, 10, 400, 0.01, batch_size=64, seeds=range(5)))
    (decision,) = smoother.engine().graphs.decisions.values()
    assert decision.baseline_s > 0 and decision.candidate_s > 0
    assert decision.used == (decision.candidate_s < decision.baseline_s)
    assert decision.reason.startswith("measured at batch 64: eager ")


@_gpu
def test_an_edited_f_r_is_captured_again():
    """The graph holds the prepared copy's tensors: after ``f_R`` changes, the next call captures the new copy, and
    its certificates are a fresh smoother's."""
    model, xs = _small_splitz("cuda")
    smoother = Smoother(model, 0.5, cuda_graphs=True)
    before = [r.count_a for r in smoother.certify_many(xs, 10, 400, 0.01, batch_size=64, seeds=range(5))]
    with torch.no_grad():
        model.right[0].weight.mul_(-1.0)
    after = [(r.prediction, r.count_a) for r in smoother.certify_many(xs, 10, 400, 0.01, batch_size=64,
                                                                       seeds=range(5))]
    fresh = [(r.prediction, r.count_a) for r in Smoother(model, 0.5, cuda_graphs=True).certify_many(
        xs, 10, 400, 0.01, batch_size=64, seeds=range(5))]
    assert after == fresh and [c for _, c in after] != before


def test_score_gap_scales_by_the_classes_that_are_not_constant():
    want = torch.tensor([[10.0, 5.0, -1e6, 0.0], [1.0, 2.0, -1e6, 0.0]])
    # a constant class (the same in every row of both scorings) does not widen the scale
    got = want.clone()
    got[0, 0] = 0.0
    assert score_gap(got, want) == (10.0, 11.0)
    # every class is compared: a change far below the winners counts, and so does a change among tied scores
    got = want.clone()
    got[:, 3] = -3.0
    assert score_gap(got, want) == (3.0, 11.0)
    ties = torch.zeros(1, 10)
    moved = ties.clone()
    moved[0, 0] = -5.0
    assert score_gap(moved, ties) == (5.0, 1.0)
    # a class that moves with the batch is not constant: its scores enter the scale
    got = want.clone()
    got[:, 2] = -2e6
    assert score_gap(got, want) == (1e6, 1e6 + 1)
    # NaN against a number is an infinite gap, the same infinity none
    got = want.clone()
    got[1, 1] = math.nan
    assert score_gap(got, want)[0] == math.inf
    masked = torch.tensor([[-math.inf, 1.0, 0.0]])
    assert score_gap(masked.clone(), masked) == (0.0, 2.0)
