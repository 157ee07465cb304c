"""When the sampling engine samples through ``torch.compile(f_R)`` (splitz_fast.sampling.compiled): never on the CPU by default,
on CUDA only after COMPILE_AFTER_S seconds of eager sampling (the ski-rental rule), and then only where the compiled
f_R scores like the eager one and measures faster. The compiler is replaced by stand-ins that are faster, slower or
wrong on purpose (a real compile on the CPU is in the slow test at the end, on CUDA in the gpu test)."""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.sampling import choices, compiled as compiled_module
from splitz_fast.sampling.choices import Variant, check_setting
from splitz_fast.sampling.compiled import COMPILE_AFTER_S, CompileChoice
from _helpers import small_splitz

CPU = torch.device("cpu")


class Pause(nn.Module):
    """The identity, taking ``seconds`` per call: an eager f_R that a stand-in compiler can beat."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def _paused_splitz(seconds: float = 0.004):
    model, xs = small_splitz()
    right = nn.Sequential(Pause(seconds), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    return sz.SplitModel(model.left, right, 5), xs


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """compile=None considered on the CPU too, with a threshold no test reaches by sampling: a test makes the choice
    due by lowering it (:func:`_due_now`), so when it compiles does not depend on this machine's speed."""
    monkeypatch.setattr(CompileChoice, "AUTO_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_S", 1e9)


def _due_now(monkeypatch):
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_S", 0.0)


def _stand_in_compiler(monkeypatch, make):
    """torch.compile replaced: ``make(net)`` is the "compiled" function of the prepared ``net``; returns the list of
    batch sizes it scored, and records the entry functions it was given in ``calls.entries``."""
    calls = _CompilerCalls()
    entries = calls.entries

    def compile_(entry, **kwargs):
        entries.append(entry)

        def run(net, batch):
            calls.append(batch.shape[0])
            return make(net)(batch)
        return run

    monkeypatch.setattr(torch, "compile", compile_)
    return calls


class _CompilerCalls(list):
    """The batch sizes a stand-in compiled function scored, and (``entries``) the functions it was asked to compile."""

    def __init__(self):
        super().__init__()
        self.entries: list = []


def _eager(rows: int, compiled: bool = False) -> Variant:
    """The plain channels_last variant of a batch of ``rows`` (what a compile decision is keyed by), or with
    ``compiled`` the same through the compiled copy."""
    return Variant(channels_last=True, pooled=False, compiled=compiled, rows=rows)


KEY = _eager(64)


def test_compile_none_waits_for_a_minute_of_sampling_per_batch_on_cuda_and_never_compiles_on_the_cpu():
    cuda = CompileChoice(None, torch.device("cuda"))  # a device object only: nothing runs on it
    assert not cuda.due(KEY)
    cuda.record_eager(KEY, COMPILE_AFTER_S / 2)
    cuda.record_eager(_eager(128), COMPILE_AFTER_S / 2)  # another batch size: its own clock
    assert not cuda.due(KEY)
    cuda.record_eager(KEY, COMPILE_AFTER_S / 2)
    assert cuda.due(KEY) and not cuda.due(_eager(128))
    cpu = CompileChoice(None, CPU)
    cpu.record_eager(KEY, 1e6)
    assert not cpu.due(KEY)
    assert CompileChoice(True, CPU).due(KEY) and not CompileChoice(False, torch.device("cuda")).due(KEY)
    assert 10 <= COMPILE_AFTER_S <= 600


@pytest.mark.parametrize("bad", ["auto", 1, 0, "yes"])
def test_compile_settings_other_than_none_true_false_are_refused(bad):
    model, _ = small_splitz()
    with pytest.raises(ValueError, match="compile must be None"):
        check_setting("compile", bad)
    with pytest.raises(ValueError, match="compile must be None"):
        sz.Smoother(model, 0.4, compile=bad)


def test_default_smoother_on_the_cpu_never_compiles(monkeypatch):
    model, xs = small_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net)
    _due_now(monkeypatch)  # however long it has sampled
    smoother = sz.Smoother(model, 0.4)
    smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    smoother.predict(xs[1], 200, 0.05, batch_size=64, seed=1)
    assert calls == [] and calls.entries == [] and smoother.engine().compiling.decisions == {}


def test_compile_none_compiles_once_due_and_keeps_a_faster_compiled_f_r(monkeypatch, auto_on_cpu):
    model, xs = _paused_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net[1:])  # the same function without the pause
    smoother = sz.Smoother(model, 0.4)
    eager = [smoother.predict(x, 300, 0.05, batch_size=64, seed=i) for i, x in enumerate(xs[:2])]
    engine = smoother.engine()
    (key, seconds), = engine.compiling.eager_seconds.items()
    assert calls == [] and key == _eager(64) and seconds > 0  # not due yet: eager, time counted
    _due_now(monkeypatch)
    got = [smoother.predict(x, 300, 0.05, batch_size=64, seed=i) for i, x in enumerate(xs[:2])]
    decision, = engine.compiling.decisions.values()
    assert decision.used and decision.candidate_s < decision.baseline_s and decision.setup_s >= 0, decision
    assert "measured at batch 64" in decision.reason
    assert set(calls) == {64} and len(calls) > 10  # sampled through it, full batches only
    assert [(p.prediction, p.count_top, p.count_second) for p in got] == \
           [(p.prediction, p.count_top, p.count_second) for p in eager]
    smoother.predict(xs[2], 300, 0.05, batch_size=64, seed=2)
    assert engine.compiling.eager_seconds[key] == 0  # reset at the decision; compiled sampling is not eager time


def test_compile_none_keeps_eager_where_the_compiled_f_r_measures_slower(monkeypatch, auto_on_cpu):
    model, xs = small_splitz()

    def slower(net):
        def run(batch):
            time.sleep(0.004)
            return net(batch)
        return run

    calls = _stand_in_compiler(monkeypatch, slower)
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4)
    eager = sz.Smoother(model, 0.4, compile=False).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a slower compiled f_R is a measured choice, not a warning
        got = smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    decision, = smoother.engine().compiling.decisions.values()
    assert not decision.used and decision.candidate_s > decision.baseline_s
    timing_calls = len(calls)
    smoother.predict(xs[1], 300, 0.05, batch_size=64, seed=1)  # due again (threshold 0), but decided already
    assert len(calls) == timing_calls  # decided once: no batch ran through it afterwards
    assert (got.prediction, got.count_top) == (eager.prediction, eager.count_top)


@pytest.mark.parametrize("setting", [None, True])
def test_a_compiled_f_r_that_scores_differently_is_not_used(lenient, monkeypatch, auto_on_cpu, setting):
    model, xs = small_splitz()
    _stand_in_compiler(monkeypatch, lambda net: (lambda batch: net(batch) + torch.tensor([0.0, 0, 0, 0, 50.0])))
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4, compile=setting)
    with pytest.warns(UserWarning, match="compiled f_R is not used .*scores differ"):
        got = smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    eager = sz.Smoother(model, 0.4, compile=False).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    assert (got.prediction, got.count_top) == (eager.prediction, eager.count_top) and got.prediction != 4
    assert not any(d.used for d in smoother.engine().compiling.decisions.values())


def test_a_compiled_f_r_that_fails_at_its_first_call_falls_back_to_eager_with_one_warning(lenient, monkeypatch, auto_on_cpu):
    model, xs = small_splitz()

    def failing(net):
        def run(batch):
            raise RuntimeError("inductor: no C++ compiler")
        return run

    _stand_in_compiler(monkeypatch, failing)
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4)
    with pytest.warns(UserWarning, match="torch.compile failed .*no C\\+\\+ compiler"):
        got = smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    decision, = smoother.engine().compiling.decisions.values()
    assert not decision.used and decision.reason == "torch.compile failed"
    eager = sz.Smoother(model, 0.4, compile=False).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    assert (got.prediction, got.count_top) == (eager.prediction, eager.count_top)


def test_compile_true_uses_the_compiled_f_r_from_the_first_batch_without_timing(monkeypatch):
    model, xs = small_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net)
    smoother = sz.Smoother(model, 0.4, compile=True)
    smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    decision, = smoother.engine().compiling.decisions.values()
    assert decision.used and decision.reason == "compile=True" and decision.baseline_s is None
    assert not any(smoother.engine().compiling.eager_seconds.values()) and set(calls) == {64}


def test_every_compiled_copy_compiles_its_own_entry_function(monkeypatch):
    """dynamo keeps compiled code and its recompile limit (8) per code object: compiling nn.Sequential.forward would
    share one budget with every Sequential of the process, and past it would run eagerly without a word."""
    model, xs = small_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net)
    for batch in (64, 32):
        sz.Smoother(model, 0.4, compile=True).predict(xs[0], 300, 0.05, batch_size=batch, seed=0)
    codes = [entry.__code__ for entry in calls.entries]
    assert len(codes) == 2 and codes[0] is not codes[1]
    assert all(code is not nn.Sequential.forward.__code__ and code is not compiled_module._forward.__code__
               for code in codes)


def test_one_engine_compiles_a_copy_per_batch_size_and_a_failure_at_one_size_leaves_the_others(lenient, monkeypatch):
    """Past dynamo's recompile limit (8 shapes of one code object) a shared compiled copy would run eagerly without a
    word: each batch size has its own entry function, and its own decision."""
    model, xs = small_splitz()

    def failing_at_24(net):
        def run(batch):
            if batch.shape[0] == 24:
                raise RuntimeError("inductor: unsupported at this shape")
            return net(batch)
        return run

    calls = _stand_in_compiler(monkeypatch, failing_at_24)
    smoother = sz.Smoother(model, 0.4, compile=True)
    sizes = [16, 24, 32, 40, 48, 56, 64, 72, 80, 88]  # ten batch sizes, one engine
    with pytest.warns(UserWarning, match="torch.compile failed .*unsupported at this shape"):
        for size in sizes:
            smoother.predict(xs[0], 200, 0.05, batch_size=size, seed=0)
    decisions = smoother.engine().compiling.decisions
    assert sorted(key.rows for key in decisions) == sizes
    assert [key.rows for key, d in decisions.items() if not d.used] == [24]
    codes = {id(entry.__code__) for entry in calls.entries}  # equal code objects compare equal: identity counts
    assert len(calls.entries) == len(codes) == len(sizes)  # a fresh entry code object per batch size
    assert set(calls) == set(sizes)  # every size scored through its compiled copy (24 at its failed first call)
    for size in (16, 88):  # sampled through the compiled copy after the decision: full batches of that size
        before = calls.count(size)
        smoother.predict(xs[1], 200, 0.05, batch_size=size, seed=1)
        assert calls.count(size) - before == 200 // size


def test_only_full_batches_count_as_eager_sampling_towards_compiling(monkeypatch, auto_on_cpu):
    """A short batch never runs compiled: a run made only of short batches (a sequential test's few draws) must not
    bring a compile for a shape it never samples at closer."""
    model, xs = _paused_splitz(0.01)
    _stand_in_compiler(monkeypatch, lambda net: net)
    smoother = sz.Smoother(model, 0.4)
    smoother.predict(xs[0], 50, 0.05, batch_size=64, seed=0)  # one short batch
    assert not any(smoother.engine().compiling.eager_seconds.values())
    smoother.predict(xs[0], 128 + 64, 0.05, batch_size=64, seed=0)  # three full batches
    (key, seconds), = smoother.engine().compiling.eager_seconds.items()
    assert key.rows == 64 and seconds >= 0.01  # (batches may run on worker threads at once)


def test_share_of_a_timed_block_counts_as_eager_time():
    choice = CompileChoice(None, CPU)
    choice.AUTO_DEVICES = ("cpu",)
    began = time.perf_counter()
    with choice.timed(KEY, 0.5):
        time.sleep(0.05)
    elapsed = time.perf_counter() - began
    with choice.timed(KEY, 0.0):  # a compiled block, or only short batches
        time.sleep(0.05)
    assert 0.025 <= choice.eager_seconds[KEY] <= elapsed / 2


def test_running_out_of_memory_at_the_compiled_first_call_keeps_eager_sampling(lenient, monkeypatch, auto_on_cpu):
    model, xs = small_splitz()

    def out_of_memory(net):
        def run(batch):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    _stand_in_compiler(monkeypatch, out_of_memory)
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4)
    with pytest.warns(UserWarning, match="compiled f_R is not used .*OutOfMemoryError"):
        got = smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    decision, = smoother.engine().compiling.decisions.values()
    assert not decision.used
    eager = sz.Smoother(model, 0.4, compile=False).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    assert (got.prediction, got.count_top) == (eager.prediction, eager.count_top)


def test_out_of_memory_while_checking_the_scores_decides_against_the_compiled_copy_once(lenient, monkeypatch, auto_on_cpu):
    model, xs = small_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(choices, "score_gap", out_of_memory)
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4)
    with pytest.warns(UserWarning, match="compiled f_R is not used .*OutOfMemoryError"):
        smoother.predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    smoother.predict(xs[1], 300, 0.05, batch_size=64, seed=1)  # due again, but decided: no second compile
    decision, = smoother.engine().compiling.decisions.values()
    assert not decision.used and len(calls.entries) == 1 and calls == [64]


def test_compile_true_never_asks_for_a_graph_of_the_eager_copy(monkeypatch):
    """compile=True samples full batches compiled from the first one: a CUDA graph of the eager copy would hold
    memory and never replay (graph keys: channels_last, pooled, fused, compiled, rows)."""
    from splitz_fast.sampling.graphs import GraphChoice

    model, xs = small_splitz()
    _stand_in_compiler(monkeypatch, lambda net: net)
    asked = []
    choose = GraphChoice.choose
    monkeypatch.setattr(GraphChoice, "choose", lambda self, key, *a: asked.append(key) or choose(self, key, *a))
    sz.Smoother(model, 0.4, compile=True).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    assert asked == [_eager(64, compiled=True)]
    asked.clear()
    sz.Smoother(model, 0.4, compile=False).predict(xs[0], 300, 0.05, batch_size=64, seed=0)
    assert asked == [_eager(64)]  # the same check sees the eager copy's request


@pytest.mark.parametrize("setting", [None, True])
def test_the_compile_decision_is_made_again_for_an_edited_model(monkeypatch, auto_on_cpu, setting):
    # made again, not recalled: the memory across engines is off here (an edit of the weights keeps its key; it is
    # tested in tests/sampling/test_memory.py)
    monkeypatch.setenv("SPLITZ_MEMORY", "0")
    model, xs = small_splitz()
    calls = _stand_in_compiler(monkeypatch, lambda net: net)
    _due_now(monkeypatch)
    smoother = sz.Smoother(model, 0.4, compile=setting)
    decided = []
    choose = CompileChoice.choose
    monkeypatch.setattr(CompileChoice, "choose", lambda self, *a, **k: decided.append(1) or choose(self, *a, **k))
    smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    smoother.predict(xs[1], 200, 0.05, batch_size=64, seed=1)
    assert len(decided) == 1
    compiled_before = len(calls)
    with torch.no_grad():
        model.right[4].bias += torch.tensor([0.0, 0, 0, 0, 100.0])
    after = smoother.predict(xs[0], 200, 0.05, batch_size=64, seed=0)
    assert after.prediction == 4 and after.count_top == 200  # the edit is seen through a fresh compiled copy
    assert len(decided) == 2 and len(calls) > compiled_before and len(calls.entries) == 2


@pytest.mark.slow
def test_a_real_torch_compile_on_the_cpu_certifies_like_eager_even_past_dynamos_recompile_limit():
    """Inductor on this machine (C++ code for the CPU): the compiled copy is chosen with compile=True, runs, and
    certifies what the eager f_R certifies (up to float rounding, which moves no vote of this input), also after
    another nn.Sequential has used up dynamo's recompile limit in this process."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo.utils as dynamo_utils

    other = torch.compile(nn.Sequential(nn.Linear(4, 3)), dynamic=False)
    for rows in range(1, 11):  # 10 static shapes of one nn.Sequential: past the limit of 8
        other(torch.rand(rows, 4))
    model, xs = small_splitz()
    smoother = sz.Smoother(model, 0.4, compile=True)
    frames = dynamo_utils.counters["frames"]["ok"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a failed compile would warn and fall back
        got = smoother.certify(xs[0], 20, 300, 0.01, batch_size=64, seed=3)
    decision, = smoother.engine().compiling.decisions.values()
    assert decision.used, decision
    assert dynamo_utils.counters["frames"]["ok"] > frames  # compiled, not run eagerly by an exhausted dynamo
    eager = sz.Smoother(model, 0.4, compile=False).certify(xs[0], 20, 300, 0.01, batch_size=64, seed=3)
    assert (got.prediction, got.count_a) == (eager.prediction, eager.count_a)
    assert got.radius == pytest.approx(eager.radius, rel=1e-12)


@pytest.mark.slow
def test_a_real_torch_compile_serves_ten_batch_sizes_of_one_engine():
    """Ten static shapes through one engine, past dynamo's recompile limit of 8 per code object: each batch size
    compiles a frame of its own (a shared compiled copy would run eagerly from the ninth shape on, without a word)."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo.utils as dynamo_utils

    model, xs = small_splitz()
    smoother = sz.Smoother(model, 0.4, compile=True)
    sizes = [16, 24, 32, 40, 48, 56, 64, 72, 80, 88]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for size in sizes:
            frames = dynamo_utils.counters["frames"]["ok"]
            got = smoother.predict(xs[0], 200, 0.05, batch_size=size, seed=0)
            assert dynamo_utils.counters["frames"]["ok"] == frames + 1, size  # compiled, not run eagerly
            eager = sz.Smoother(model, 0.4, compile=False).predict(xs[0], 200, 0.05, batch_size=size, seed=0)
            assert (got.prediction, got.count_top) == (eager.prediction, eager.count_top)
    decisions = smoother.engine().compiling.decisions
    assert sorted(key.rows for key in decisions) == sizes and all(d.used for d in decisions.values())


@pytest.mark.gpu
def test_eager_sampling_time_on_cuda_is_counted_from_events_without_a_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, xs = small_splitz()
    model = model.cuda()
    smoother = sz.Smoother(model, 0.4)
    start = time.perf_counter()
    smoother.predict(xs[0].cuda(), 20000, 0.05, batch_size=512, seed=0)
    compiling = smoother.engine().compiling
    key = _eager(512)
    torch.cuda.set_sync_debug_mode("error")  # reading the events never synchronises
    try:
        compiling.due(key)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert not compiling.due(key) and not compiling.decisions and not compiling._pending
    assert 0 < compiling.eager_seconds[key] <= wall


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [None, False])
def test_compile_none_on_cuda_compiles_after_the_threshold_and_certifies_like_eager(monkeypatch, graphs):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_S", 0.0)  # due at the first batch
    model, xs = small_splitz()
    model = model.cuda()
    smoother = sz.Smoother(model, 0.4, cuda_graphs=graphs)
    got = smoother.certify(xs[0].cuda(), 20, 2000, 0.01, batch_size=256, seed=3)
    engine = smoother.engine()
    (key, decision), = engine.compiling.decisions.items()
    assert decision.setup_s is not None and decision.baseline_s is not None and decision.candidate_s is not None
    assert decision.reason.startswith("measured at batch 256"), decision  # compiled, not fallen back
    compiled_graph = replace(key, compiled=True)
    assert (engine.prepared._compiled[key] is not None) == decision.used  # what the engine samples through
    if decision.used and graphs is None:  # the compiled copy's own graph choice was made, and is what replays
        graph_decision = engine.graphs.decisions[compiled_graph]
        assert (engine.prepared._graphs[compiled_graph] is not None) == graph_decision.used
    if not decision.used:  # a copy decided against is dropped with its graph
        assert compiled_graph not in engine.prepared._graphs
    else:  # the eager copy's graph of that batch would never replay again
        assert key not in engine.prepared._graphs
    eager = sz.Smoother(model, 0.4, compile=False, cuda_graphs=graphs).certify(xs[0].cuda(), 20, 2000, 0.01,
                                                                             batch_size=256, seed=3)
    assert got.prediction == eager.prediction and abs(got.count_a - eager.count_a) <= 1


def test_the_strided_pool_asks_for_its_layout_where_torch_compile_traces_it(monkeypatch):
    """Under torch.compile (inference mode) an out= tensor's layout is lost and inductor failed to view the zoo
    LeNet's channels_last pool output at its Flatten: traced, the pool asks for the layout instead, the same values."""
    from splitz_fast.sampling.pooling import MaxPool2x2

    x = torch.randn(4, 8, 7, 9).contiguous(memory_format=torch.channels_last)
    for channels_last in (False, True):
        pool = MaxPool2x2(channels_last)
        with torch.inference_mode():
            eager = pool(x)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            traced = pool(x)
            monkeypatch.undo()
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert torch.equal(traced, eager) and traced.is_contiguous(memory_format=layout)
        assert eager.is_contiguous(memory_format=layout) and torch.equal(eager, nn.functional.max_pool2d(x, 2))


@pytest.mark.slow
@pytest.mark.parametrize("split", [0, 1])
def test_a_real_torch_compile_of_the_zoo_lenet_on_the_cpu_scores_bitwise_like_eager(split):
    """The zoo LeNet's prepared chain (channels_last, strided pools, a Flatten) compiles with inductor without
    falling back, and scores a noisy batch bitwise as the eager copy does."""
    pytest.importorskip("torch._inductor")
    from splitz_fast.sampling.compiled import CompiledOrEager
    from splitz_fast.sampling.engine import SamplingEngine
    from splitz_fast.sampling.prepared import noisy_rows

    torch.manual_seed(0)
    model = sz.build_model("lenet", split_index=split).eval()
    engine = SamplingEngine(model.right, 10, 0.25, CPU, compile=True)
    engine.prepared.check_current()
    latent = model.left(torch.rand(1, 1, 28, 28, generator=torch.Generator().manual_seed(1)))[0]
    pooled = engine.pools_in_noise(latent.shape)
    batch = noisy_rows(latent, 0.25, torch.float32, 64, True, pooled)
    reports = []
    compiled = CompiledOrEager(engine.prepared.get(True, pooled, for_compile=True), reports.append)
    with torch.inference_mode():
        want = engine._scores(engine.prepared.get(True, pooled), batch)
        got = engine._scores(compiled, batch)
    assert reports == [] and compiled.compiled is not None and torch.equal(got, want)
