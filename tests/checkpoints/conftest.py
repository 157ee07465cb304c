"""What the checkpoint tests share: a CIFAR-10 stand-in for the commands that certify a checkpoint."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def fake_cifar10(monkeypatch):
    """Four random CIFAR-shaped images under any dataset name (this process only)."""
    from torch.utils.data import TensorDataset

    import splitz_fast.data.datasets as datasets
    from splitz_fast.data.datasets import DatasetInfo

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen))
    info = DatasetInfo(data, (3, 32, 32), 10, None, None, "fake CIFAR-10")
    monkeypatch.setattr(datasets, "get_dataset", lambda name, split, root=None, **options: info)
    return info
