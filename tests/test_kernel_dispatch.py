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
