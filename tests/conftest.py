"""Test-session setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must
be set before anything imports triton, which is why it lives here (pytest imports conftest.py first)."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The engine remembers its measured decisions in a user cache folder (splitz_fast.sampling.memory): tests, and the
# commands they run in subprocesses, use a folder of this session (one per test: fresh_memory), never the home one.
_CACHE_DIR = os.environ["SPLITZ_CACHE_DIR"] = tempfile.mkdtemp(prefix="splitz-test-cache-")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_memory(request, monkeypatch):
    """A remembered-decisions folder of the test's own: a verdict one test measured never replaces another test's
    measurement."""
    name = request.node.nodeid.replace("/", "_").replace(":", "_")[-120:]
    monkeypatch.setenv("SPLITZ_CACHE_DIR", os.path.join(_CACHE_DIR, name))


@pytest.fixture
def lenient(monkeypatch):
    """Fallbacks warn, as without ``SPLITZ_STRICT=1`` (which `make test` sets): for the tests of a fallback's warning."""
    monkeypatch.delenv("SPLITZ_STRICT", raising=False)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """A test marked ``gpu`` skips by itself where there is no CUDA device (no skip line of its own needed)."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs CUDA (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


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


@pytest.fixture
def tiny(monkeypatch):
    """A 40-row, 4-feature, 2-class dataset under any dataset name (in this process only: subprocesses see the real
    datasets), so every command runs in well under a second."""
    from torch.utils.data import TensorDataset

    import splitz_fast.data.datasets as datasets
    from splitz_fast.data.datasets import DatasetInfo

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=gen)
    info = DatasetInfo(TensorDataset(x, (x[:, 0] > 0).long()), (4,), 2, None, None, "tiny test data")
    monkeypatch.setattr(datasets, "get_dataset", lambda name, split, root=None: info)
    return info
