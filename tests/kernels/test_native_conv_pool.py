"""csrc/conv_pool_cpu.cpp: the C++ kernel of conv_relu_maxpool2 on the CPU against the float64 eager chain, over the
shapes of the Triton kernel's tests (padding, floor-mode pooling, thin inputs, channel blocks that do not divide, any
input strides); NaN through the pool and the ReLU; the refusals; and the sampling engine's use of it: a CPU fused site
whose fused form computes what its unfused operations compute, the site decision made by measurement (a fused form
that measures slower is not taken), nothing fused where the kernel is not built, and certificates of LeNet with the
fused copy against without."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
import splitz_fast.kernels.conv_relu_pool as conv_relu_pool
import splitz_fast.sampling.epilogues as epilogues
from splitz_fast.kernels.conv_relu_pool import conv_relu_maxpool2, conv_relu_maxpool2_native, \
    conv_relu_maxpool2_reference
from splitz_fast.kernels.native import native_available
from splitz_fast.sampling.epilogues import ConvReLUMaxPool2, FusionChoice, fused_sites
from splitz_fast.sampling.prepared import fused_conv_pools

from test_kernels_conv_relu_pool import SHAPES, TOLERANCE, _problem

pytestmark = pytest.mark.skipif(not native_available("conv_relu_maxpool2"),
                                reason="the native conv + pool kernel is not built here (no C++ compiler)")


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_kernel_matches_the_float64_chain(shape, dtype, channels_last, poisoned):
    x, weight, bias, padding = _problem(shape, dtype, "cpu", channels_last=channels_last)
    got = conv_relu_maxpool2_native(x, weight, bias, padding)
    # the operands as the kernel takes them (input, weight and bias in the input's dtype), exact in float64
    want = conv_relu_maxpool2_reference(x.double(), weight.to(dtype).double(), bias.to(dtype).double(), padding)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    scale = float(want.abs().max()) + 1e-12
    assert float((got.double() - want).abs().max()) <= TOLERANCE[dtype] * scale
    assert (got >= 0).all()  # the ReLU


def test_native_kernel_reads_any_strides_and_no_bias(poisoned):
    """A view that starts one row and one channel in, with a batch stride of its own, and a convolution without
    bias: the same values as the contiguous copy of that view."""
    x, weight, _, padding = _problem((3, 3, 9, 10, 20, 3, 1), torch.float32, "cpu")
    taller = torch.randn(3, 4, 11, 10)
    view = taller[:, 1:, 1:10]
    got = conv_relu_maxpool2_native(view, weight, None, padding)
    want = conv_relu_maxpool2_reference(view.contiguous().double(), weight.double(), None, padding)
    assert float((got.double() - want).abs().max()) <= TOLERANCE[torch.float32] * (float(want.abs().max()) + 1e-12)


def test_native_kernel_propagates_nan_through_the_pool_and_the_relu():
    """A NaN pixel makes every pooled output whose window reads it NaN, as the eager chain does (a maximum or ReLU
    that dropped it would let a broken input vote)."""
    x, weight, bias, padding = _problem((2, 1, 10, 10, 32, 3, 1), torch.float32, "cpu")
    x[1, 0, 4, 5] = float("nan")
    got = conv_relu_maxpool2_native(x, weight, bias, padding)
    want = conv_relu_maxpool2_reference(x.double(), weight.double(), bias.double(), padding)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_native_kernel_refusals_say_what_to_fix():
    x, weight, bias, padding = _problem((2, 1, 10, 10, 32, 3, 1), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"needs a float32/bfloat16 CPU input \[B, 1, H, W\], got \(2, 1, 10, 10\) "
                                         r"torch.float16"):
        conv_relu_maxpool2_native(x.half(), weight, bias, padding)
    with pytest.raises(ValueError, match="supports groups=1, stride 1"):
        conv_relu_maxpool2_native(x, weight, bias, "same")
    # the dispatching op: float16 on the CPU runs the reference (the same function), float32 the kernel
    torch.testing.assert_close(conv_relu_maxpool2(x.half(), weight, bias, padding).float(),
                               conv_relu_maxpool2_reference(x, weight, bias, padding), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_site_computes_its_unfused_operations(dtype):
    """ConvReLUMaxPool2 on the CPU: the fused form (the C++ kernel) and the unfused one (convolution, strided-maxima
    pool, ReLU) agree within the unfused chain's rounding, also under autocast (the engine's bf16 scores), and the
    fused form reads the convolution's current weight (an edit is seen at the next call, nothing cached)."""
    torch.manual_seed(0)
    site = ConvReLUMaxPool2(nn.Conv2d(1, 32, 3, padding=1)).eval()
    x = torch.rand(16, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    # as the engine scores: autocast without its weight cache (which would keep the weight from before the edit)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16,
                                         cache_enabled=False):
        fused, unfused = site.fused_forward(x), site.unfused_forward(x)
        assert fused.dtype == unfused.dtype == dtype
        assert unfused.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(fused.float(), unfused.float(), **({} if dtype == torch.float32 else
                                                                       dict(atol=2e-2, rtol=2e-2)))
        site.conv.weight.mul_(-1.0)
        torch.testing.assert_close(site.fused_forward(x).float(), site.unfused_forward(x).float(),
                                   **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def _lenet_smoother(precision: str, fused_kernels=None) -> sz.Smoother:
    torch.manual_seed(3)
    model = sz.build_model("lenet", split_index=0).eval()
    return sz.Smoother(model, 0.5, precision=precision, fused_kernels=fused_kernels, max_batch_size=64)


def test_on_the_cpu_fusion_is_considered_only_where_the_kernel_is_built(monkeypatch):
    assert FusionChoice(None, torch.device("cpu")).considered
    assert not FusionChoice(False, torch.device("cpu")).considered
    # compiled: the compiled copy is made from the plain one (a C++ call would break its graph)
    assert not FusionChoice(None, torch.device("cpu"), compile=True).considered
    assert FusionChoice(None, torch.device("cuda"), compile=True).considered
    monkeypatch.setattr(epilogues, "select_backend", lambda op, device: "reference")  # no C++ compiler, say
    assert not FusionChoice(None, torch.device("cpu")).considered


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_lenet_certifies_on_the_cpu_with_the_fused_sites_as_without(precision):
    """The engine decides LeNet's two conv + ReLU + pool sites on the CPU by measurement, records each decision, and
    certifies the same digits as with fused kernels off (votes within Monte Carlo noise of each other: the fused
    kernel sums in another order)."""
    xs = torch.rand(3, 1, 28, 28)
    runs = {}
    for fused in (None, False):
        smoother = _lenet_smoother(precision, fused)
        runs[fused] = list(smoother.certify_many(xs, 100, 2000, 0.001, seeds=range(3)))
        if fused is None:
            decisions = smoother.engine().fusion.records()
            assert decisions and all(set(d["sites"]) == {"0", "1"} for d in decisions)
    for a, b in zip(runs[None], runs[False]):
        assert a.prediction == b.prediction and a.n == b.n == 2000
        assert abs(a.count_a - b.count_a) <= 0.02 * 2000  # the same noise: only rounding-borderline votes may move


def test_a_cpu_site_whose_kernel_measures_slower_is_not_fused(lenient, monkeypatch):
    """A stand-in kernel that computes the same values but takes 20 ms more: both sites measured slower stay unfused,
    the plain copy samples, and no warning is given (the measurement working, not a failure)."""
    real = conv_relu_pool.conv_relu_maxpool2_native

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv_relu_pool, "conv_relu_maxpool2_native", slow)
    smoother = _lenet_smoother("float32")
    list(smoother.certify_many(torch.rand(1, 1, 28, 28), 100, 200, 0.001, seeds=[0]))
    records = smoother.engine().fusion.records()
    assert records and not any(r["used"] for r in records)
    assert all(not site["used"] and site["fused_s"] > 0.02 for r in records for site in r["sites"].values())


def test_the_cpu_fused_copy_holds_only_the_pool_sites_and_their_unfused_pools_write_what_the_plain_chain_writes():
    """LeNet's fused copy for the CPU: its two conv + ReLU + pool sites and no cuDNN epilogue (the fc ReLU stays a
    ReLU); the Flatten is read in storage order by the first linear (_FlattenLinear), so a site left unfused pools
    into channels_last as the fused form writes; a plain Flatten would have it pool into NCHW (a view there)."""
    smoother = _lenet_smoother("float32")
    engine = smoother.engine()
    engine.prepared.check_current()
    fused = engine.prepared.get(channels_last=True, fused=True)
    sites = list(fused_sites(fused).values())
    assert [type(m).__name__ for m in fused] == ["ConvReLUMaxPool2", "ConvReLUMaxPool2", "_FlattenLinear", "ReLU",
                                                 "Linear"]
    assert [site.unfused_channels_last for site in sites] == [True, True]
    x = torch.rand(4, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        first = sites[0].unfused_forward(x)
        assert first.is_contiguous(memory_format=torch.channels_last)
        assert sites[1].unfused_forward(first).is_contiguous(memory_format=torch.channels_last)
    plain_flatten = fused_conv_pools([nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 2)])
    assert plain_flatten[0].unfused_channels_last is False


def test_after_an_edit_of_the_users_first_layer_the_fused_copy_samples_the_edited_f_r():
    """The fused copy is rebuilt from f_R as it is at each call: after an in-place edit of the user's first
    convolution (and a new bias), the fused copy the engine samples through scores like the edited f_R, not the old."""
    smoother = _lenet_smoother("float32")
    x = torch.rand(1, 1, 28, 28)
    list(smoother.certify_many(x, 100, 200, 0.001, seeds=[0]))
    conv = smoother.model.right[0]
    with torch.no_grad():
        conv.weight.mul_(-1.5)
        conv.bias.add_(0.25)
    list(smoother.certify_many(x, 100, 200, 0.001, seeds=[0]))
    net = smoother.engine().prepared.get(channels_last=True, fused=True)  # the copy the fused sites come from
    for site in fused_sites(net).values():
        site.fused = True  # every site through the C++ kernel, whatever the timing decided
    batch = torch.rand(16, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(net(batch), smoother.model.right(batch), rtol=1e-4, atol=1e-4)
