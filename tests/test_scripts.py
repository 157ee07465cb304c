"""The scripts under scripts/ (one per results table, the device check) parse: a broken edit shows here, in seconds,
not at the end of an hour-long run or of a lent GPU's 15 minutes."""
from __future__ import annotations

import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh"))
PYTHON_SCRIPTS = sorted(SCRIPTS.glob("*.py"))
# Python fed to an interpreter through a quoted here-document (`$PY - ARGS <<'EOF'` … `EOF`), e.g. a results table.
EMBEDDED_PYTHON = re.compile(r"^[^\n]*(?:PY|PYTHON)\S* - [^\n]*<<'EOF'[^\n]*\n(.*?)^EOF$", re.MULTILINE | re.DOTALL)


def embedded_python(script: Path) -> list[str]:
    return EMBEDDED_PYTHON.findall(script.read_text())


def test_there_are_scripts_to_check():
    assert SHELL_SCRIPTS and PYTHON_SCRIPTS


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script: Path):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_python_script_compiles(script: Path, tmp_path: Path):
    py_compile.compile(str(script), cfile=str(tmp_path / "compiled.pyc"), doraise=True)


@pytest.mark.parametrize("script", [s for s in SHELL_SCRIPTS if embedded_python(s)], ids=lambda p: p.name)
def test_embedded_python_compiles(script: Path):
    for number, source in enumerate(embedded_python(script)):
        compile(source, f"{script.name} (here-document {number})", "exec")


def test_embedded_python_is_found_and_checked():
    (table,) = embedded_python(SCRIPTS / "mnist_attacks.sh")
    assert "checkpoint_digest" in table and table.rstrip().endswith('print(table, end="")')  # the whole body
    with pytest.raises(SyntaxError):
        compile(table + "\nif True print()\n", "broken", "exec")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_broken_script_is_caught(tmp_path: Path):
    broken = tmp_path / "broken.sh"
    broken.write_text("for x in 1 2; do\n  echo $x\n")  # no `done`
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0
