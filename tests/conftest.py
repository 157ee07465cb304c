"""Test-session setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must
be set before anything imports triton, which is why it lives here (pytest imports conftest.py first)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
