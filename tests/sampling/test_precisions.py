"""tf32 is a labelled precision that computes float32 on the CPU."""
from __future__ import annotations

import torch
import torch.nn as nn

import splitz_fast as sz


def test_tf32_is_a_labelled_precision_that_computes_float32_on_the_cpu():
    """``tf32`` is float32 storage (on CUDA its convolutions and matmuls run in TF32: tests/test_cuda_math.py); on the
    CPU it computes what ``float32`` does."""
    from splitz_fast.sampling.engine import PRECISIONS

    assert PRECISIONS["tf32"] is torch.float32
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
    model = sz.split_sequential(net, 1, num_classes=3, input_shape=(1, 6, 6), threshold=1.0)
    x = torch.rand(1, 6, 6, generator=torch.Generator().manual_seed(1))
    fp32, tf32 = (sz.Smoother(model, 0.5, precision=p).certify(x, 10, 200, 0.01, seed=3) for p in ("float32", "tf32"))
    assert fp32.count_a == tf32.count_a and fp32.radius == tf32.radius
