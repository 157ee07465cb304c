"""Static checks of every Python file of the project (pyflakes): an undefined name, an unused import or a shadowed
definition fails here, on the CPU, instead of in a code path that only a GPU run reaches."""
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("splitz_fast", "benchmarks", "scripts", "tests", "setup.py")


def test_pyflakes_finds_nothing():
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is in requirements/ci.txt: `make install`")
    from pyflakes.reporter import Reporter

    out = io.StringIO()
    api.checkRecursive([str(ROOT / path) for path in CHECKED], Reporter(out, out))
    assert out.getvalue() == "", out.getvalue()
