"""certify_many / predict_many over a stream equal one-by-one certification; seeds and bad inputs are handled before or
exactly at the input they concern."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast import LeftHalf, Smoother, SplitModel
from _helpers import small_splitz as _small_splitz


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
