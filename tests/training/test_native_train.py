"""The native CPU kernels of the training step (csrc/train_cpu.cpp) against their PyTorch references, and the whole
SPLITZ training step with them against the reference path: same losses and gradients when the same noise is used.

Ops: ``conv_power`` (kernels/conv_power.py: masked convolution power step and norm), ``clip_mask``
(kernels/clip_mask.py: clipped ReLU + varying mask), ``train_noise`` (kernels/train_noise.py: noisy copies).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.kernels import select_backend
from splitz_fast.kernels.clip_mask import clip_mask, clip_mask_native, clip_mask_reference
from splitz_fast.kernels.conv_power import (input_factor, masked_conv_gram, masked_conv_gram_native,
                                            masked_conv_gram_reference, masked_conv_norm_native,
                                            masked_conv_norm_reference, native_conv_ok)
from splitz_fast.kernels.native import native_available
from splitz_fast.kernels.philox_reference import stream_normals_reference
from splitz_fast.kernels.train_noise import draw_seed, noisy_repeat, noisy_repeat_native, noisy_repeat_reference
from splitz_fast.bounds.estimate import PowerIterationState, lipschitz_estimate
from splitz_fast.training.config import TrainConfig
from splitz_fast.training.loss import philox_training_noise, splitz_loss, torch_training_noise

pytestmark = pytest.mark.skipif(not native_available("conv_power"),
                                reason="the native training kernels need a C++ compiler (csrc/train_cpu.cpp)")

# (C_in, C_out, kernel, stride, padding, dilation, H, W): LeNet's conv1, odd sizes, strides, dilation, no padding.
CONV_CASES = [
    (1, 32, 3, 1, 1, 1, 28, 28),
    (3, 5, 3, 2, 1, 1, 9, 11),
    (2, 4, (2, 3), (1, 2), (0, 2), (2, 1), 7, 10),
    (1, 3, 5, 1, 0, 1, 5, 6),
    (2, 1, 1, 1, 0, 1, 3, 1),
]


def _conv_case(case, dtype, batch=3, seed=0):
    c_in, c_out, k, s, p, d, h, w = case
    torch.manual_seed(seed)
    layer = nn.Conv2d(c_in, c_out, k, stride=s, padding=p, dilation=d).to(dtype)
    v = torch.randn(batch, c_in, h, w, dtype=dtype)
    out_shape = torch.nn.functional.conv2d(v, layer.weight, None, s, p, d).shape
    mask = torch.rand(out_shape) > 0.4
    factor = torch.rand(1, c_in, h, w, dtype=dtype) * (torch.rand(1, c_in, h, w) > 0.2)
    per_sample_factor = torch.rand(batch, c_in, h, w, dtype=dtype)
    return layer, v, mask, factor, per_sample_factor


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("which", ["none", "mask", "mask+factor", "per-sample factor"])
def test_masked_conv_gram_and_norm_match_reference_float64(case, which):
    layer, v, mask, factor, per_sample = _conv_case(case, torch.float64)
    out_mask = None if which == "none" else mask
    in_factor = {"none": None, "mask": None, "mask+factor": factor, "per-sample factor": per_sample}[which]
    ref = masked_conv_gram_reference(v, layer.weight, layer, out_mask=out_mask, in_factor=in_factor)
    got = masked_conv_gram_native(v, layer.weight, layer, out_mask=out_mask, in_factor=in_factor)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    norm_ref = masked_conv_norm_reference(v, layer.weight, layer, out_mask=out_mask, in_factor=in_factor)
    norm = masked_conv_norm_native(v, layer.weight, layer, out_mask=out_mask, in_factor=in_factor)
    torch.testing.assert_close(norm, norm_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES[:3])
def test_masked_conv_norm_gradients_gradcheck_float64(case):
    layer, v, mask, factor, _ = _conv_case(case, torch.float64, batch=2)
    weight = layer.weight.detach().clone().requires_grad_()
    v = v.requires_grad_()
    # A zero image has norm 0: its gradient is 0 (as torch's norm), not NaN.
    v.data[1].zero_()
    torch.autograd.gradcheck(lambda a, w: masked_conv_norm_native(a, w, layer, out_mask=mask, in_factor=factor)[:1],
                             (v, weight))
    weights = torch.tensor([0.7, -1.3], dtype=torch.float64)
    grads = []
    for fn in (masked_conv_norm_reference, masked_conv_norm_native):
        out = fn(v, weight, layer, out_mask=mask, in_factor=factor)
        grads.append(torch.autograd.grad(out @ weights, (v, weight)))
    for ref, got in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)


def test_masked_conv_float32_lenet_shape_and_nan_propagation():
    layer, v, mask, _, _ = _conv_case(CONV_CASES[0], torch.float32, batch=5)
    ref = masked_conv_gram_reference(v, layer.weight, layer, out_mask=mask)
    got = masked_conv_gram_native(v, layer.weight, layer, out_mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    v[2, 0, 3, 4] = float("nan")  # a NaN input poisons its own image only, as in the reference
    got = masked_conv_gram_native(v, layer.weight, layer)
    ref = masked_conv_gram_reference(v, layer.weight, layer)
    assert torch.isnan(got[2]).any() and torch.isnan(ref[2]).any()
    assert torch.isfinite(got[[0, 1, 3, 4]]).all()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))


def test_masked_conv_bad_arguments_are_clear_errors():
    layer, v, mask, factor, _ = _conv_case(CONV_CASES[0], torch.float32)
    with pytest.raises(ValueError, match="out_mask must be"):
        masked_conv_gram(v, layer.weight, layer, out_mask=mask[:, :3], backend="native")
    with pytest.raises(ValueError, match="in_factor must be"):
        masked_conv_gram(v, layer.weight, layer, in_factor=factor[:, :, :5], backend="native")
    with pytest.raises(ValueError, match="v must be"):
        masked_conv_gram(v[0], layer.weight, layer, backend="native")
    with pytest.raises(ValueError, match="layer must be"):
        masked_conv_gram(v, layer.weight, nn.Linear(3, 4), backend="native")
    with pytest.raises(ValueError, match="backend must be"):
        masked_conv_gram(v, layer.weight, layer, backend="triton")
    assert native_conv_ok(layer) and not native_conv_ok(nn.Conv2d(64, 64, 3)) and not native_conv_ok(nn.Linear(2, 2))


def test_input_factor_is_mask_times_scale():
    mask = torch.rand(4, 2, 3, 3) > 0.5
    scale = torch.rand(1, 2, 3, 3)
    torch.testing.assert_close(input_factor(mask, scale, (2, 3, 3), torch.float64),
                               mask.double() * scale.double())
    assert input_factor(None, None, (2, 3, 3), torch.float32) is None


# ------------------------------------------------------------------------------------------------------- clip_mask
@pytest.mark.parametrize("shape", [(7, 3, 5, 4), (4, 11), (2, 1, 1, 1)])
@pytest.mark.parametrize("theta_kind", ["scalar", "inf", "per-channel", "per-element"])
def test_clip_mask_matches_reference(shape, theta_kind):
    torch.manual_seed(1)
    z = torch.randn(shape) * 2
    sample = shape[1:]
    r = torch.rand(sample)
    gamma = torch.rand(shape[0]) * 0.5
    theta = {"scalar": torch.tensor(0.8), "inf": torch.tensor(float("inf")),
             "per-channel": torch.rand(sample[0]) + 0.2, "per-element": torch.rand(sample) + 0.2}[theta_kind]
    z[0].view(-1)[0] = float("nan")
    lat_ref, mask_ref = clip_mask_reference(z, r, gamma, theta)
    lat, mask = clip_mask_native(z, r, gamma, theta)
    assert mask.dtype == torch.bool and mask.shape == z.shape
    assert torch.equal(mask, mask_ref)  # the same float operations in the same order
    torch.testing.assert_close(lat, lat_ref, rtol=0, atol=0, equal_nan=True)


def test_clip_mask_gradients_match_reference_with_ties_and_learnable_theta():
    torch.manual_seed(2)
    theta = torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64, requires_grad=True)
    z = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    z[0, 0, 0, 0] = 0.5  # ties with θ: the gradient is split in half, as torch.minimum does
    z[1, 1, 0, 0] = 1.0
    z[2, 2, 1, 1] = 0.0  # relu's kink
    r = torch.rand(1, 3, 4, 4, dtype=torch.float64)
    grads = []
    for fn in (clip_mask_reference, clip_mask_native):
        zz = z.clone().requires_grad_()
        latent, _ = fn(zz, r, 0.1, theta)
        weights = torch.linspace(-1, 2, latent.numel(), dtype=torch.float64).view_as(latent)
        grads.append(torch.autograd.grad((latent * weights).sum(), (zz, theta)))
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=1e-14, atol=1e-14)
    zz = (torch.randn(2, 3, 2, 2, dtype=torch.float64) * 2).requires_grad_()
    torch.autograd.gradcheck(lambda a, t: clip_mask_native(a, r[:, :, :2, :2], 0.1, t)[0], (zz, theta))


def test_clip_mask_bad_arguments():
    z = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="r must have shape"):
        clip_mask(z, torch.rand(3, 4), 0.1, 1.0, backend="native")
    with pytest.raises(ValueError, match="theta is required"):
        clip_mask(z, torch.rand(3, 4, 4), 0.1, None, backend="native")
    with pytest.raises(ValueError, match="gamma must be"):
        clip_mask(z, torch.rand(3, 4, 4), torch.rand(3), 1.0, backend="native")
    with pytest.raises(ValueError, match="z must be"):
        clip_mask(z.long(), torch.rand(3, 4, 4), 0.1, 1.0, backend="native")


# ----------------------------------------------------------------------------------------------------- train_noise
@pytest.mark.parametrize("shape,q,channels_last", [((3, 4, 5, 6), 2, False), ((3, 4, 5, 6), 1, True),
                                                    ((2, 3, 3, 3), 3, True), ((5, 7), 2, False)])
def test_noisy_repeat_matches_reference_and_stream(shape, q, channels_last):
    torch.manual_seed(3)
    latent = torch.randn(shape)
    seed, offset = 2**63 + 12345, 7
    out_ref = noisy_repeat_reference(latent, q, 0.5, seed, offset, channels_last)
    out = noisy_repeat_native(latent, q, 0.5, seed, offset, channels_last)
    assert out.shape == (shape[0] * q, *shape[1:]) and out.dtype == torch.float32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=2e-6)
    # Row k is latent[k // q] + σ z over the stream positions of sample offset + k.
    numel = latent[0].numel()
    z = stream_normals_reference(seed, offset * numel, shape[0] * q * numel).view(out.shape)
    torch.testing.assert_close(out, latent.repeat_interleave(q, 0) + 0.5 * z, rtol=0, atol=2e-6)


def test_noisy_repeat_gradient_sums_copies():
    latent = torch.randn(3, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    out = noisy_repeat_native(latent, 3, 0.25, 9)
    weights = torch.randn(out.shape)
    (grad,) = torch.autograd.grad((out * weights).sum(), latent)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(grad, weights.view(3, 3, 2, 4, 4).sum(1).double())
    out_ref = noisy_repeat_reference(latent, 3, 0.25, 9)
    (grad_ref,) = torch.autograd.grad((out_ref * weights).sum(), latent)
    torch.testing.assert_close(grad, grad_ref)


def test_noisy_repeat_seed_changes_noise_and_bad_arguments():
    latent = torch.zeros(2, 3)
    assert not torch.equal(noisy_repeat_native(latent, 1, 1.0, 1), noisy_repeat_native(latent, 1, 1.0, 2))
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert draw_seed(gen_a) == draw_seed(gen_b) and 0 <= draw_seed(gen_a) < 2**64
    for kwargs, match in [({"q": 0}, "q"), ({"sigma": -1.0}, "sigma"), ({"seed": -1}, "seed"),
                          ({"seed": 2**64}, "seed"), ({"offset": -2}, "offset")]:
        args = {"q": 1, "sigma": 0.5, "seed": 1, "offset": 0, **kwargs}
        with pytest.raises(ValueError, match=match):
            noisy_repeat(latent, args["q"], args["sigma"], args["seed"], args["offset"], backend="native")
    with pytest.raises(ValueError, match="channels_last"):
        noisy_repeat_native(latent, 1, 0.5, 1, channels_last=True)


# ----------------------------------------------------------------------------------------------- the training step
def _steps(backend, monkeypatch, model, x, y, config, n_steps=2, lam=0.8):
    monkeypatch.setenv("SPLITZ_BACKEND", backend)
    state, gen = PowerIterationState(), torch.Generator().manual_seed(11)
    losses, grads = [], []
    for _ in range(n_steps):
        loss, parts = splitz_loss(model, x, y, config, lam, state, gen, training_noise=philox_training_noise)
        model.zero_grad(set_to_none=True)
        loss.backward()
        losses.append((float(loss.detach()), parts["ce"], parts.get("lip")))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    return losses, grads


@pytest.mark.parametrize("variant,threshold,learnable", [("advertorch", 1.0, False), ("splitz", 0.5, True)])
def test_training_step_native_equals_reference(monkeypatch, variant, threshold, learnable):
    """LeNet split 1: the native step (fused first layer, native power steps and norm, native Philox noise) gives the
    reference step's losses and gradients, with the same Philox noise (``philox_training_noise``) on both."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=1, variant=variant, threshold=threshold, learnable_threshold=learnable)
    x, y = torch.rand(24, 1, 28, 28), torch.randint(0, 10, (24,))
    config = TrainConfig(noise_samples=2, power_iters=3, sigma=0.5)
    for op in ("conv_power", "clip_mask", "train_noise"):
        monkeypatch.setenv("SPLITZ_BACKEND", "auto")
        assert select_backend(op, x.device) == "native"
    ref_losses, ref_grads = _steps("reference", monkeypatch, model, x, y, config)
    losses, grads = _steps("auto", monkeypatch, model, x, y, config)
    for (loss, ce, lip), (loss_r, ce_r, lip_r) in zip(losses, ref_losses):
        assert loss == pytest.approx(loss_r, rel=1e-5)
        assert ce == pytest.approx(ce_r, rel=1e-5)
        assert lip == pytest.approx(lip_r, rel=1e-5)
    for got, ref in zip(grads, ref_grads):
        assert got.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # The check can fail: another noise seed moves the loss far beyond the tolerance.
    other, _ = _steps("reference", monkeypatch, model, x, y, TrainConfig(noise_samples=2, power_iters=3, sigma=0.6),
                      n_steps=1)
    assert other[0][1] != pytest.approx(ref_losses[0][1], rel=1e-5)


def test_training_noise_default_stream_per_backend(monkeypatch):
    """Default noise: Philox where the native kernel runs, torch.randn on the reference path (today's stream)."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=1)
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    config = TrainConfig(power_iters=1)
    results = {}
    for backend, noise in [("auto", None), ("auto", philox_training_noise), ("reference", None),
                           ("reference", torch_training_noise)]:
        monkeypatch.setenv("SPLITZ_BACKEND", backend)
        loss, _ = splitz_loss(model, x, y, config, 0.0, None, torch.Generator().manual_seed(4), training_noise=noise)
        results[(backend, noise)] = float(loss.detach())
    assert results[("auto", None)] == pytest.approx(results[("auto", philox_training_noise)], rel=1e-6)
    assert results[("reference", None)] == results[("reference", torch_training_noise)]
    assert results[("auto", None)] != pytest.approx(results[("reference", None)], rel=1e-6)  # two streams


def test_lipschitz_estimate_native_power_steps_match_reference(monkeypatch):
    """The estimate alone (ball bounds from the reference in both runs): native conv power steps vs MaskedAffine."""
    torch.manual_seed(0)
    model = sz.lenet(split_index=2, variant="splitz")  # conv1 native (9 taps), conv2 MaskedAffine (288 taps)
    x = torch.rand(6, 1, 28, 28)
    values = {}
    for backend in ("reference", "auto"):
        monkeypatch.setenv("SPLITZ_BACKEND", backend)
        est = lipschitz_estimate(model.left, x, 0.1, power_iters=4, generator=torch.Generator().manual_seed(3))
        (grad,) = torch.autograd.grad(est.sum(), model.left.layers[0].weight)
        values[backend] = (est.detach(), grad)
    torch.testing.assert_close(values["auto"][0], values["reference"][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(values["auto"][1], values["reference"][1], rtol=1e-4, atol=1e-6)


def test_noisy_repeat_seed_above_2_63_under_the_profiler():
    """Seeds >= 2**63 pass through autograd.Function.apply as int64 bits (the profiler records apply's arguments as
    int64 and refused the unsigned value)."""
    latent = torch.randn(2, 3, 4, 4)
    seed = 2**64 - 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True):
        out = noisy_repeat_native(latent, 2, 0.5, seed)
    torch.testing.assert_close(out, noisy_repeat_reference(latent, 2, 0.5, seed), rtol=0, atol=2e-6)
