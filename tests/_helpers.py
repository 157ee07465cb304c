"""Helpers shared by the test files (importable because pytest puts this folder on sys.path)."""
from __future__ import annotations

import importlib.metadata
import importlib.util


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` (e.g. an offline data package) is installed."""
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def kernel_devices() -> list:
    """Where a Triton kernel test runs: Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by
    conftest.py without a GPU) and, marked ``gpu``, CUDA tensors where a GPU exists."""
    import os

    import pytest
    import torch

    has_triton = importlib.util.find_spec("triton") is not None
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return [
        pytest.param("cpu", id="interp", marks=pytest.mark.skipif(not (has_triton and interpret),
                                                                 reason="needs triton with TRITON_INTERPRET=1")),
        pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not (has_triton and torch.cuda.is_available()), reason="needs CUDA")]),
    ]
