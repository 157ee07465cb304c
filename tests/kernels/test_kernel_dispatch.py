"""Backend dispatch: explicit, overridable by SPLITZ_BACKEND, never a silent fallback."""
from __future__ import annotations

import pytest
import torch

from splitz_fast.kernels import BACKEND_ENV, select_backend


def test_default_dispatch_uses_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend("ball_bounds", torch.device("cpu")) == "reference"


def test_forcing_a_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert select_backend("ball_bounds", torch.device("cuda")) == "reference"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(NotImplementedError, match="no Triton kernel"):
        select_backend("ball_bounds", torch.device("cuda"))
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend("ball_bounds", torch.device("cpu"))


def test_auto_sends_only_the_measured_winners_to_triton_on_cuda(monkeypatch):
    """masked_conv2d's kernel lost to cuDNN on an H200 (benchmarks/RESULTS.md): auto keeps it on the reference,
    forcing still reaches it; the fused bound and sampling ops go to Triton."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cuda = torch.device("cuda")
    assert select_backend("masked_conv2d", cuda) == "reference"
    for op in ("first_layer_bounds", "interval_clip", "masked_linear", "noisy_latents", "count_votes"):
        assert select_backend(op, cuda) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_backend("masked_conv2d", cuda) == "triton"
