"""Test-session setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must
be set before anything imports triton, which is why it lives here (pytest imports conftest.py first)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def poisoned():
    """While the test runs, torch.empty returns NaN-filled floats / all-ones-bit integers, so a kernel output that was
    never written fails the comparison with its reference."""
    old = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old[0])
    torch.utils.deterministic.fill_uninitialized_memory = old[1]
