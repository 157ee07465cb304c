"""The library run end to end on the Triton backend (Triton's interpreter on CPU tensors here, the compiled kernels on
CUDA tensors where a GPU exists) against the reference backend: same bounds, same estimates and gradients, a sound and
reproducible sampler."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz
from splitz_fast.kernels import BACKEND_ENV

pytest.importorskip("triton")

# Triton runs compiled on CUDA tensors, or interpreted on CPU tensors (conftest.py sets TRITON_INTERPRET=1 without CUDA).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv(BACKEND_ENV, name)
    return use


def _mlp() -> sz.LeftHalf:
    torch.manual_seed(0)
    act = sz.ClippedReLU(1.0, shape=(7,))
    act.threshold.copy_(torch.linspace(0.3, 1.5, 7))
    return sz.LeftHalf([nn.Linear(5, 7), nn.Linear(7, 4)], [act, sz.ClippedReLU(0.8)],
                       standardize=sz.Standardize([0.1] * 5, [0.5] * 5), input_shape=(5,))


def _conv() -> sz.LeftHalf:
    torch.manual_seed(1)
    return sz.LeftHalf([nn.Conv2d(2, 3, 3, stride=2, padding=1)], [sz.ClippedReLU(0.9, shape=(3,))],
                       standardize=sz.Standardize([0.4, 0.5], [0.3, 0.2]), input_shape=(2, 5, 5))


@pytest.mark.parametrize("make_left", [_mlp, pytest.param(_conv, marks=pytest.mark.slow)])  # _conv: ~12 s, 2 cores
def test_ball_bounds_and_certificates_agree_across_backends(backend, make_left):
    left = make_left().to(DEVICE)
    x = _rand(3, *left.input_shape, seed=2)
    gamma = torch.tensor([0.0, 0.1, 0.7], device=DEVICE)
    results = {}
    for name in ("reference", "triton"):
        backend(name)
        bounds = sz.ball_bounds(left, x, gamma)
        exact = sz.lipschitz_bound(left, x, gamma, method="exact").value
        prob = sz.lipschitz_bound(left, x, gamma, method="probabilistic", power_iters=16,
                                  generator=_gen(0)).value
        results[name] = (bounds, exact, prob)
    (b_ref, e_ref, p_ref), (b_tri, e_tri, p_tri) = results["reference"], results["triton"]
    # The fused first layer sums its taps in another order than the reference convolution/matmul: equal within
    # float64 rounding (which the 1e-10 rounding margin dominates), and the masks — all the certificate uses — equal.
    for k in range(left.depth):
        torch.testing.assert_close(b_tri.lower[k], b_ref.lower[k], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(b_tri.upper[k], b_ref.upper[k], rtol=1e-13, atol=1e-13)
        assert torch.equal(b_ref.masks[k], b_tri.masks[k])
    assert torch.equal(e_ref, e_tri)  # the exact bound depends on the weights and the masks only
    assert torch.allclose(p_ref, p_tri, rtol=1e-9)


def _two_convs() -> sz.LeftHalf:
    torch.manual_seed(2)
    return sz.LeftHalf([nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 3, 3, stride=2)],
                       [sz.ClippedReLU(1.0), sz.ClippedReLU(0.7)], input_shape=(1, 7, 6))


@pytest.mark.parametrize("make_left", [_mlp, pytest.param(_two_convs, marks=pytest.mark.slow)])  # ~1 min, 2 cores
def test_training_estimate_and_gradient_agree_across_backends(backend, make_left):
    left = make_left().to(DEVICE)
    x = _rand(4, *left.input_shape, seed=3)
    out = {}
    for name in ("reference", "triton"):
        backend(name)
        left.zero_grad()
        est = sz.lipschitz_estimate(left, x, 0.2, power_iters=20, generator=_gen(0))
        est.sum().backward()
        out[name] = (est.detach(), [layer.weight.grad.clone() for layer in left.layers])
    assert torch.allclose(out["reference"][0], out["triton"][0], rtol=1e-4)
    for g_ref, g_tri in zip(out["reference"][1], out["triton"][1]):
        assert torch.allclose(g_ref, g_tri, rtol=1e-3, atol=1e-5)


class _Linear2(nn.Module):
    def __init__(self, w: torch.Tensor, b: float):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, u):
        s = u.flatten(1) @ self.w + self.b
        return torch.stack([-s, s], dim=1)


@pytest.mark.slow  # ~18 s on 2 CPU cores in Triton's interpreter
def test_smoother_on_the_triton_noise_path_is_reproducible_batch_invariant_and_calibrated(backend):
    backend("triton")
    left = sz.LeftHalf([nn.Conv2d(1, 2, 3, padding=1)], [sz.ClippedReLU(1.0)], input_shape=(1, 4, 4)).to(DEVICE)
    x = _rand(1, 4, 4, seed=4)
    with torch.no_grad():
        u = left(x.unsqueeze(0))[0]
    w = torch.randn(u.numel(), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    sigma = 0.5
    b = 0.8 * sigma * float(w.norm()) - float(u.flatten() @ w)  # p_A = Φ(0.8) ≈ 0.788 for class 1
    model = sz.SplitModel(left, _Linear2(w, b), num_classes=2)
    smoother = sz.Smoother(model, sigma)
    r1 = smoother.certify(x, n0=16, n=256, alpha=0.01, batch_size=64, seed=11)
    r2 = smoother.certify(x, n0=16, n=256, alpha=0.01, batch_size=37, seed=11)
    assert r1.noise_source == "philox4x32-10"
    assert (r1.prediction, r1.count_a, r1.radius) == (r2.prediction, r2.count_a, r2.radius)  # Philox: any batching
    r3 = smoother.certify(x, n0=16, n=256, alpha=0.01, batch_size=64, seed=12)
    assert r3.count_a != r1.count_a or r3.prediction != r1.prediction or r3.seed != r1.seed
    results = [smoother.certify(x, n0=64, n=256, alpha=0.01, batch_size=256, seed=s) for s in range(8)]
    assert all(r.prediction == 1 for r in results)  # so count_a counts the votes for class 1
    counts = [r.count_a for r in results]
    rate = sum(counts) / (8 * 256)
    assert abs(rate - 0.788) < 4 * (0.788 * 0.212 / (8 * 256)) ** 0.5
