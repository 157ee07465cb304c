"""The CPU's cast copy of f_R (splitz_fast/sampling/casting.py): bf16 weights cast once instead of under autocast, used
only with a reduced precision asked for, only where it scores like autocast and measures faster; a failing copy
warns once (an error under SPLITZ_STRICT=1) and autocast samples."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
import splitz_fast.sampling.choices as choices
import splitz_fast.sampling.prepared as prepared
from splitz_fast.sampling.casting import cast_copy


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    return sz.split_sequential(net, 0, num_classes=3, input_shape=(1, 16, 16))


X = torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(1))


def _certify(precision: str, batch_sizes=(64,)):
    # the cast choice alone: the fused sites' own choice (tests/kernels/test_native_conv_pool.py) times nothing here
    smoother = sz.Smoother(_model(), 0.5, precision=precision, fused_kernels=False)
    results = [smoother.certify(X, 10, 300, 0.01, batch_size=b, seed=2) for b in batch_sizes]
    return smoother.engine(), results[0]


def _cast_measured_faster(monkeypatch):
    timed = iter([2.0, 1.0])  # autocast, then the cast copy
    monkeypatch.setattr(choices, "seconds_per_call", lambda call, device: next(timed))


def _dtypes(module: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()}


class _Wrapped(nn.Module):
    """A stand-in cast copy: the real one, run ``repeats`` times (slower), with ``shift`` added to its scores, or
    raising when ``fails``."""

    def __init__(self, net: nn.Module, repeats: int = 1, shift: float = 0.0, fails: bool = False):
        super().__init__()
        self.net, self.repeats, self.shift, self.fails = net, repeats, shift, fails

    def forward(self, x):
        if self.fails:
            raise RuntimeError("no bf16 kernel here")
        for _ in range(self.repeats):
            out = self.net(x)
        return out + self.shift


def _stand_in(monkeypatch, **kwargs):
    made = []

    def cast(net, dtype):
        made.append(_Wrapped(cast_copy(net, dtype), **kwargs))
        return made[-1]

    monkeypatch.setattr(prepared, "cast_copy", cast)
    return made


def test_bfloat16_is_never_used_unless_asked():
    engine, _ = _certify("float32")
    assert not engine.casting.considered and engine.casting.decisions == {}
    assert all(_dtypes(net) == {torch.float32} for net in engine.prepared._prepared.values())
    assert not engine.prepared._cast


def test_the_cast_copy_holds_bf16_weights_channels_last_and_scores_like_autocast(monkeypatch):
    _cast_measured_faster(monkeypatch)
    engine, _ = _certify("bfloat16")
    (variant, decision), = engine.casting.decisions.items()
    cast = engine.prepared._cast[variant]
    assert _dtypes(cast) == {torch.bfloat16} and cast[0].weight.is_contiguous(memory_format=torch.channels_last)
    plain = engine.prepared.get(*variant.layout)
    assert _dtypes(plain) == {torch.float32}  # the autocast copy is untouched
    batch = prepared.noisy_rows(torch.rand(1, 16, 16), 0.5, torch.bfloat16, 64, True, False)
    with torch.inference_mode():  # the copies were made in it, as the engine samples
        torch.testing.assert_close(engine._scores(cast, batch), engine._scores(plain, batch), rtol=0, atol=0)


def test_a_cast_copy_measured_faster_is_used(monkeypatch):
    made = _stand_in(monkeypatch)
    _cast_measured_faster(monkeypatch)
    engine, _ = _certify("bfloat16")
    (variant, decision), = engine.casting.decisions.items()
    assert decision.used and engine.prepared._cast[variant] is made[0]


def test_a_cast_copy_measured_slower_is_not_taken(monkeypatch):
    _stand_in(monkeypatch, repeats=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a slower candidate is the measurement working: no warning
        engine, result = _certify("bfloat16")
    (variant, decision), = engine.casting.decisions.items()
    assert not decision.used and decision.candidate_s > decision.baseline_s
    assert engine.prepared._cast[variant] is None
    _, autocast = _certify("bfloat16")
    assert (result.prediction, result.count_a) == (autocast.prediction, autocast.count_a)


@pytest.mark.parametrize("stand_in, why", [({"fails": True}, "no bf16 kernel"), ({"shift": 5.0}, "scores differ")])
def test_a_failing_cast_copy_warns_once_and_autocast_samples(monkeypatch, stand_in, why):
    monkeypatch.delenv("SPLITZ_STRICT", raising=False)
    _stand_in(monkeypatch, **stand_in)
    with pytest.warns(UserWarning, match=f"not cast once.*{why}") as caught:
        engine, _ = _certify("bfloat16", batch_sizes=(64, 32))  # two variants decided, one report
    assert len([w for w in caught if "not cast once" in str(w.message)]) == 1
    assert len(engine.casting.decisions) == 2 and not any(d.used for d in engine.casting.decisions.values())
    monkeypatch.setenv("SPLITZ_STRICT", "1")
    with pytest.raises(RuntimeError, match="SPLITZ_STRICT=1"):
        _certify("bfloat16")


def test_compile_true_keeps_the_autocast_copy():
    from splitz_fast.sampling.casting import CastChoice

    assert not CastChoice(torch.bfloat16, torch.device("cpu"), compile=True).considered
    assert CastChoice(torch.bfloat16, torch.device("cpu"), compile=None).considered
    assert not CastChoice(torch.float32, torch.device("cpu"), compile=None).considered


@pytest.mark.parametrize("layer", [nn.LayerNorm([8, 4, 4]), nn.GroupNorm(2, 8)])
def test_an_f_r_with_a_layer_autocast_keeps_in_float32_keeps_autocast(layer):
    """Autocast runs normalizations in float32 on the CPU: cast to bf16 they would be another base classifier."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.MaxPool2d(4), layer, nn.Flatten(), nn.Linear(128, 3))
    smoother = sz.Smoother(sz.split_sequential(net, 0, num_classes=3, input_shape=(1, 16, 16)), 0.5,
                           precision="bfloat16")
    smoother.certify(X, 10, 100, 0.01, batch_size=32, seed=2)
    prepared = smoother.engine().prepared
    assert smoother.engine().casting.decisions == {} and prepared._cast and all(
        copy is None for copy in prepared._cast.values())  # decided once per variant: no cast copy
