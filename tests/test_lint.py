"""Static checks of every Python file of the project (pyflakes): an undefined name, an unused import or a shadowed
definition fails here, on the CPU, instead of in a code path that only a GPU run reaches. A line that says
``# noqa`` (a deliberate re-export) is exempt, as flake8 would have it."""
import linecache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("splitz_fast", "kernels", "benchmarks", "scripts", "tests", "setup.py")


def test_pyflakes_finds_nothing():
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is in requirements/ci.txt: `make install`")

    class Findings:
        def __init__(self):
            self.lines: list[str] = []

        def flake(self, message):
            if "# noqa" not in linecache.getline(message.filename, message.lineno):
                self.lines.append(str(message))

        def unexpectedError(self, filename, message):
            self.lines.append(f"{filename}: {message}")

        def syntaxError(self, filename, message, lineno, offset, text):
            self.lines.append(f"{filename}:{lineno}: {message}")

    findings = Findings()
    api.checkRecursive([str(ROOT / path) for path in CHECKED], findings)
    assert findings.lines == [], "\n".join(findings.lines)
