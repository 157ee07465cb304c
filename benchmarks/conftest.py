"""Shared benchmark helpers: every benchmark records the machine and versions next to its numbers."""
from __future__ import annotations

import os
import platform

import pytest
import torch


def environment() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional on CPU-only stacks
        triton_version = "absent"
    import splitz_fast

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    return {
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "splitz_fast": splitz_fast.__version__,
        "python": platform.python_version(),
    }


@pytest.fixture
def record_env(benchmark):
    benchmark.extra_info.update(environment())
    return benchmark.extra_info


# Quick mode (SPLITZ_BENCH_QUICK=1, used by `make test` so the suite cannot rot): tiny sample counts, one round, the
# small shapes only. Its numbers are smoke-test timings, never results.
QUICK = os.environ.get("SPLITZ_BENCH_QUICK", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
