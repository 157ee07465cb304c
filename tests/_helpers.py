"""Helpers shared by the test files (importable because pytest puts this folder on sys.path)."""
from __future__ import annotations

import importlib.metadata


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` (e.g. an offline data package) is installed."""
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
