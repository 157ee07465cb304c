"""The GPU smoke stage's harness (benchmarks/smoke.py), run on the CPU with stand-in checks: one verdict line per check
as it ends, a watchdog per check that records a hang with every thread's stack and goes on with the next check, and
the default list naming only gpu tests that exist."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import smoke  # noqa: E402

STAND_INS = '''
import time

def test_ok():
    assert 1 + 1 == 2

def test_wrong():
    difference = 0.25
    assert difference <= 1e-6, f"max difference {difference}"

def test_failed():
    raise RuntimeError("no kernel image is available for execution on the device")

def test_hangs():
    time.sleep(120)

def test_after_the_hang():
    pass
'''


def test_each_check_gets_its_verdict_and_a_hang_costs_only_its_limit(tmp_path):
    (tmp_path / "test_stand_ins.py").write_text(STAND_INS)
    checks = {name: (f"test_stand_ins.py::test_{name}", 3 if name == "hangs" else 30)
              for name in ("ok", "wrong", "failed", "hangs", "after_the_hang")}
    verdicts = smoke.run_checks(checks, tmp_path / "out", rootdir=tmp_path, budget_s=120)
    by_name = {line["name"]: line for line in verdicts}
    assert [by_name[n]["verdict"] for n in checks] == ["ok", "wrong", "failed", "timed out", "ok"]
    assert "max difference 0.25" in by_name["wrong"]["detail"]
    assert "RuntimeError: no kernel image" in by_name["failed"]["detail"]
    assert "test_hangs" in by_name["hangs"]["detail"] and "time.sleep" not in by_name["ok"]["detail"]
    lines = [json.loads(line) for line in (tmp_path / "out" / "smoke.jsonl").read_text().splitlines()]
    assert [line["name"] for line in lines] == list(checks)  # written as they ended, in order
    assert all(line["seconds"] >= 0 for line in lines)


def test_every_verdict_is_a_line_of_its_own_for_the_summary(tmp_path, capfd):
    """gpu_checks.sh copies the lines that start with "SMOKE " into gpu.txt: pytest -q's progress characters must not
    stand in front of them."""
    (tmp_path / "test_stand_ins.py").write_text(STAND_INS)
    smoke.run_checks({"ok": ("test_stand_ins.py::test_ok", 10), "wrong": ("test_stand_ins.py::test_wrong", 10)},
                     tmp_path / "out", rootdir=tmp_path, budget_s=60)
    lines = capfd.readouterr().out.splitlines()
    assert sum(line.startswith("SMOKE ok ") for line in lines) == 1
    assert sum(line.startswith("SMOKE wrong ") for line in lines) == 1


def test_an_unknown_check_is_reported_not_lost(tmp_path):
    (tmp_path / "test_stand_ins.py").write_text(STAND_INS)
    checks = {"missing": ("test_stand_ins.py::test_no_such_test", 10), "ok": ("test_stand_ins.py::test_ok", 10)}
    verdicts = smoke.run_checks(checks, tmp_path / "out", rootdir=tmp_path, budget_s=60)
    assert [line["verdict"] for line in verdicts] == ["failed", "ok"]


def test_the_default_checks_are_gpu_tests_of_the_suite():
    ids = [test for test, _ in smoke.SMOKE.values()]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "gpu", *ids], cwd=ROOT, capture_output=True, text=True)
    found = {line.strip() for line in collected.stdout.splitlines()}
    assert [test for test in ids if test not in found] == []


def test_no_check_may_hold_the_stage_longer_than_90_s():
    assert all(0 < limit <= 90 for _, limit in smoke.SMOKE.values())
