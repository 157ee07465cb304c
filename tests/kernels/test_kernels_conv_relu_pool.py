"""kernels/conv_relu_pool.py: the fused Conv2d + ReLU + 2x2 max pool of f_R against the float64 eager chain (Triton's
interpreter on the CPU, compiled on a GPU), over shapes that exercise padding, floor-mode pooling, thin inputs
(LeNet's first layer), channel tiles that do not divide, strides of the input and every output element written; the
refusals; the chain rewrite of the prepared f_R, which keeps the function; on a GPU, LeNet's certificates with the
kernel against without."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
import splitz_fast.kernels as kernels
from splitz_fast.sampling.choices import Variant
from splitz_fast.sampling.epilogues import ConvReLUMaxPool2
from splitz_fast.kernels.conv_relu_pool import (CONFIGS, GATHER_MAX_BLOCK_M, OP_NAME, _timed_configs,
                                                conv_relu_maxpool2, conv_relu_maxpool2_reference,
                                                conv_relu_maxpool2_triton, needs_int64, reduction_step)
from _helpers import kernel_devices

# (batch, C_in, H, W, C_out, kernel, padding): LeNet's two layers (advertorch: 3x3 padded; 5x5 without and with
# padding), an odd image (floor mode drops the last row/column), C_out that no channel tile divides, a 1x1
# convolution, several reduction steps with a remainder (C_in·KH·KW = 108). C_in = 32 and 64 (channels_last) run the
# tap-aligned loop, 64 with two steps per tap and an odd image; the others the general gather, the 3x3 first layer
# (K = 9), the 1x1 one and C_in = 16 with the 16-wide step.
SHAPES = [(3, 1, 12, 12, 32, 5, 0), (2, 1, 10, 10, 32, 5, 2), (2, 32, 8, 8, 64, 5, 0), (2, 5, 9, 11, 20, 3, 1),
          (4, 3, 6, 6, 7, 1, 0), (2, 12, 7, 7, 40, 3, 1), (2, 32, 6, 6, 64, 3, 1), (2, 64, 5, 7, 24, 3, 1),
          (3, 1, 10, 10, 32, 3, 1), (2, 16, 6, 7, 32, 3, 1)]
# Largest error allowed relative to the output's scale: float32 products and float32 accumulation; bf16 / fp16 round
# the stored value once (2^-8 / 2^-11 relative), and the multiplication is in the inputs' own type.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _problem(shape, dtype, device, seed=0, channels_last=True):
    batch, c_in, h, w, c_out, k, padding = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, h, w, generator=gen).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c_out, c_in, k, k, generator=gen) / (c_in * k * k) ** 0.5
    bias = torch.randn(c_out, generator=gen) * 0.3
    return x.to(device), weight.to(device), bias.to(device), (padding, padding)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_float64_chain(shape, dtype, device, poisoned):
    x, weight, bias, padding = _problem(shape, dtype, device)
    got = conv_relu_maxpool2_triton(x, weight, bias, padding)
    # the reference with the kernel's operands: the input and the weight in the input's dtype, exact in float64
    want = conv_relu_maxpool2_reference(x.double(), weight.to(dtype).double(), bias.double(), padding)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    scale = float(want.abs().max()) + 1e-12
    assert float((got.double() - want).abs().max()) <= TOLERANCE[dtype] * scale
    assert (got >= 0).all()  # the ReLU


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("shape", [(3, 4, 9, 8, 24, 3, 1), (2, 32, 7, 6, 16, 3, 1)])
def test_kernel_reads_any_input_strides_and_runs_without_a_bias(shape, device, poisoned):
    """NCHW and channels_last inputs, every other channel of a wider tensor, the channels of a channels_last tensor
    twice as wide, and a crop give the same result (with 32 channels: the tap-aligned loop where the channel stride is
    1, the general gather elsewhere); no bias is no bias."""
    x, weight, bias, padding = _problem(shape, torch.float32, device, seed=1, channels_last=False)
    want = conv_relu_maxpool2_reference(x.double(), weight.double(), None, padding)
    wide = torch.cat([x, -x], 1).contiguous(memory_format=torch.channels_last)
    views = (x, x.contiguous(memory_format=torch.channels_last), torch.stack([x, -x], 2).flatten(1, 2)[:, ::2],
             wide[:, :x.shape[1]])
    for view in views:
        got = conv_relu_maxpool2_triton(view, weight, None, padding)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    taller = torch.cat([x[:, :, :1], x], 2).contiguous(memory_format=torch.channels_last)
    got = conv_relu_maxpool2_triton(taller[:, :, 1:], weight, None, padding)  # a view that starts one row in
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_reduction_step_pads_least_and_aligns_to_taps_where_it_can():
    """LeNet's 3x3 first layer (K = 9) pads to 16, not 32; 5x5 (K = 25) to 32 either way (the larger step: fewer
    iterations); K = 75 (5x5x3) to 80 with 16, not 96; channels that 32 divides take the tap-aligned loop where they
    are contiguous, the gather where not; 16 or 48 channels the gather (a 16-wide tap-aligned loop is not pipelined)."""
    assert reduction_step(1, 9, True) == (16, False)
    assert reduction_step(1, 25, True) == (32, False)
    assert reduction_step(3, 75, True) == (16, False)
    assert reduction_step(64, 576, True) == (32, True)
    assert reduction_step(16, 144, True) == (16, False)
    assert reduction_step(48, 432, True) == (16, False)
    assert reduction_step(32, 288, False) == (32, False)  # NCHW: 288 is a multiple of 32


def test_64_bit_addresses_only_where_an_offset_can_reach_two_to_the_31():
    """A sampling batch of LeNet's first layer fits 32 bits; an input whose strides span 2³¹ elements or an output
    that ends within a tile of rows of 2³¹ does not (meta tensors: shapes and strides, no memory)."""
    x = torch.empty(10000, 1, 28, 28, device="meta")
    out = torch.empty(10000, 32, 14, 14, device="meta")
    assert not needs_int64(x, out, 128)
    wide = torch.empty_strided((2, 1, 28, 28), (2 ** 31, 784, 28, 1), device="meta")
    assert needs_int64(wide, torch.empty(2, 32, 14, 14, device="meta"), 128)
    tall = torch.empty(2 ** 31 // 32 - 64, 32, 1, 1, device="meta")
    assert not needs_int64(x, tall, 1) and needs_int64(x, tall, 128)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("shape", [(3, 1, 10, 10, 32, 3, 1), (2, 32, 6, 6, 64, 3, 1)])
def test_the_64_bit_and_32_bit_kernels_agree(shape, device, monkeypatch, poisoned):
    """The same result with every address in 64 bits (forced by a tiny limit) as in 32 (the gather and the tap-aligned
    loop)."""
    import splitz_fast.kernels.conv_relu_pool as conv_pool

    x, weight, bias, padding = _problem(shape, torch.float32, device)
    narrow = conv_relu_maxpool2_triton(x, weight, bias, padding)
    monkeypatch.setattr(conv_pool, "_INT32_LIMIT", 1)
    assert needs_int64(x, narrow, 1)
    wide = conv_relu_maxpool2_triton(x, weight, bias, padding)
    assert torch.equal(narrow, wide)


def test_unsupported_layers_and_inputs_are_refused_with_the_reason():
    x, weight, bias, _ = _problem((1, 2, 8, 8, 4, 3, 0), torch.float32, "cpu")
    cases = (({"stride": (2, 2)}, "stride 1"), ({"dilation": 2}, "dilation 1"),
             ({"groups": 2, "in_channels": 2, "out_channels": 4}, "groups=1"), ({"padding": "same"}, "numeric"))
    for kwargs, match in cases:
        conv = nn.Conv2d(**{"in_channels": 2, "out_channels": 4, "kernel_size": 3, **kwargs})
        assert not ConvReLUMaxPool2.takes(conv)
        with pytest.raises(ValueError, match=match):
            ConvReLUMaxPool2(conv)
    with pytest.raises(ValueError, match="smaller than the 2x2 pool window"):
        conv_relu_maxpool2_reference(x[..., :3, :3], weight, bias, (0, 0))
    if kernels.interpreting():
        with pytest.raises(ValueError, match="float32/bfloat16/float16 input"):
            conv_relu_maxpool2_triton(x.double(), weight.double(), bias.double(), (0, 0))


def test_the_tuner_times_the_largest_tiles_for_the_tap_aligned_loop_only():
    """BLOCK_M above GATHER_MAX_BLOCK_M spills registers in the general gather (ptxas, sm_90a): never timed there;
    every configuration is timed for the tap-aligned loop, and each launch keeps at least one."""
    triton = pytest.importorskip("triton")
    configs = [triton.Config({"BLOCK_M": block_m}, num_warps=warps) for block_m, warps in CONFIGS]
    aligned = _timed_configs(configs, {}, TAP_ALIGNED=True, BLOCK_N=64)
    gather = _timed_configs(configs, {}, TAP_ALIGNED=False, BLOCK_N=64)
    assert aligned == configs and any(c.kwargs["BLOCK_M"] > GATHER_MAX_BLOCK_M for c in configs)
    assert gather and all(c.kwargs["BLOCK_M"] <= GATHER_MAX_BLOCK_M for c in gather)
    assert len(gather) == sum(block_m <= GATHER_MAX_BLOCK_M for block_m, _ in CONFIGS)


def test_the_tuned_tiles_are_reported_per_layer_shape(monkeypatch):
    """tuned_configs(): nothing before the compiled kernel ran (here: never, on the CPU), then the autotuner's choice
    per tuned key, for the GPU records."""
    from types import SimpleNamespace

    import splitz_fast.kernels.conv_relu_pool as conv_pool

    assert conv_pool.tuned_configs() == []
    triton = pytest.importorskip("triton")
    chosen = {(32, 14, 14, 64, 288, 3, 1, 1, False, True, "torch.bfloat16"): triton.Config({"BLOCK_M": 128},
                                                                                           num_warps=8)}
    tuner = SimpleNamespace(cache=chosen)
    fake = lambda: tuner  # noqa: E731
    fake.cache_info = lambda: SimpleNamespace(currsize=1)
    monkeypatch.setattr(conv_pool, "_tuned_kernel", fake)
    assert conv_pool.tuned_configs() == [dict(key=["32", "14", "14", "64", "288", "3", "1", "1", "False", "True",
                                                   "torch.bfloat16"], BLOCK_M=128, num_warps=8)]


def test_dispatch_runs_the_kernel_on_cuda_and_the_reference_where_asked(monkeypatch):
    """The fused module's op: Triton on CUDA under auto (the module exists only in the fused copy of f_R, which the
    engine uses where it measured it faster), the C++ kernel on the CPU where it is built (else the reference), the
    reference under SPLITZ_BACKEND=reference."""
    from splitz_fast.kernels.native import native_available

    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert OP_NAME in kernels.AUTO_TRITON_OPS
    assert kernels.select_backend(OP_NAME, torch.device("cuda")) == "triton"
    assert kernels.select_backend(OP_NAME, torch.device("cpu")) == ("native" if native_available(OP_NAME) else
                                                                    "reference")
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels.select_backend(OP_NAME, torch.device("cuda")) == "reference"


@pytest.mark.parametrize("split", [0, 1])
def test_prepared_lenet_chain_fuses_each_conv_relu_pool_and_keeps_the_function(split):
    """LeNet's fused chain for CUDA runs each Conv2d + ReLU + MaxPool2d(2) as one ConvReLUMaxPool2 sharing the
    convolution's parameters (built without a GPU for a CUDA device, then run on the CPU, where the fused module
    computes the eager chain); the plain chain keeps its layers."""
    from splitz_fast.sampling import prepared as preparing

    model = sz.build_model("lenet", split_index=split).eval()
    right = model.right[1:] if split else model.right  # s = 1: the leading pool is drawn by the noise kernel
    plain = preparing._cheaper_chain(copy.deepcopy(right), True, device=torch.device("cuda"))
    assert not any(isinstance(m, ConvReLUMaxPool2) for m in plain)
    chain = preparing._cheaper_chain(copy.deepcopy(right), True, device=torch.device("cuda"), fused=True)
    fused = [m for m in chain if isinstance(m, ConvReLUMaxPool2)]
    assert len(fused) == 2 - split and not any(type(m) is nn.MaxPool2d for m in chain)
    assert [type(m).__name__ for m in chain][len(fused):] == ["_FlattenLinear", "ReLU", "Linear"]
    with torch.no_grad():
        latents = model.left(torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(2)))
        if split:
            latents = nn.functional.max_pool2d(latents, 2)
        latents = latents.double().contiguous(memory_format=torch.channels_last)
        # float64: the two may pick different memory formats for a layer (oneDNN rounds each its own way)
        torch.testing.assert_close(chain.double()(latents), right.double()(latents), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", kernel_devices())
def test_fused_module_under_autocast_casts_like_a_convolution(device, monkeypatch):
    """Under bf16 autocast the module multiplies in bf16 (as autocast's convolution would) and returns bf16."""
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    conv = nn.Conv2d(3, 16, 3, padding=1).to(device)
    x = torch.randn(2, 3, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got = ConvReLUMaxPool2(conv)(x)
        want = nn.functional.max_pool2d(torch.relu(conv(x)), 2)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


# ---------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["float32", "tf32", "bfloat16"])
@pytest.mark.parametrize("split", [0, 1])
def test_lenet_certificates_with_the_fused_kernel_match_the_eager_chain(split, precision):
    """LeNet on CUDA through its fused copy (every Conv2d + ReLU + pool of f_R one Triton kernel; fused_kernels=True,
    which still checks the scores) against the plain one: the same predictions, and counts within 1 % (the fused
    epilogue rounds once where the eager chain rounds twice); the default measures and records its choice."""
    model = sz.build_model("lenet", split_index=split).cuda().eval()
    xs = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(3)).cuda()
    results = {}
    for fused in (False, True, None):
        smoother = sz.Smoother(model, 0.25, precision=precision, fused_kernels=fused)
        results[fused] = list(smoother.certify_many(xs, 64, 4000, 0.001, seeds=range(3), batch_size=1024))
        decisions = smoother.engine().fusion.decisions
        assert (not decisions) if fused is False else [d.used for d in decisions.values()] in ([True], [False])
        if fused:
            plain = Variant(channels_last=True, pooled=bool(split), rows=1024)
            assert decisions[plain].reason == "fused_kernels=True"
            chain = smoother.engine().prepared.get(channels_last=True, pooled=bool(split), fused=True)
            assert sum(isinstance(m, ConvReLUMaxPool2) for m in chain.modules()) == 2 - split
    for off, on in zip(results[False], results[True]):
        assert off.prediction == on.prediction and abs(off.count_a - on.count_a) <= 0.01 * off.n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_a_sampling_batch_in_every_precision():
    """LeNet's conv2 at a real sampling batch (4096 noisy latents) on the GPU, float32 IEEE / TF32 / bf16, against
    the float64 chain; and the dispatcher's Triton path is the kernel."""
    shape = (4096, 32, 12, 12, 64, 5, 0)
    for dtype, tf32, tolerance in ((torch.float32, False, 1e-5), (torch.float32, True, 5e-3),
                                   (torch.bfloat16, False, 1e-2)):
        x, weight, bias, padding = _problem(shape, dtype, "cuda", seed=4)
        got = conv_relu_maxpool2_triton(x, weight, bias, padding, tf32=tf32)
        want = conv_relu_maxpool2_reference(x.double(), weight.to(dtype).double(), bias.double(), padding)
        assert float((got.double() - want).abs().max()) <= tolerance * float(want.abs().max())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kernels.BACKEND_ENV, "triton")
        assert torch.equal(conv_relu_maxpool2(x, weight, bias, padding), got)
