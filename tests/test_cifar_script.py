"""scripts/cifar10_splitz_vs_rs.sh: its SMOKE mode runs every command end to end on the 20 foolbox CIFAR-10 images
(so the script for the user's full CIFAR-10 cannot rot), and the full mode refuses plainly without the user's data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import installed

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cifar10_splitz_vs_rs.sh"
COHEN = ["idx", "label", "predict", "radius", "correct", "time"]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # The splitz of the interpreter running the tests, whatever environment that is.
    splitz = tmp_path / "splitz"
    splitz.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m splitz_fast "$@"\n')
    splitz.chmod(0o755)
    full_env = {**os.environ, "SPLITZ": str(splitz), "OMP_NUM_THREADS": "1", "RUNS": str(tmp_path / "runs"),
                "RESULTS": str(tmp_path / "results"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full_env, cwd=tmp_path, capture_output=True, text=True)


def _rows(tsv: Path) -> tuple[list[str], list[list[str]]]:
    header, *rows = (line.split("\t") for line in tsv.read_text().splitlines())
    return header, rows


@pytest.mark.slow
@pytest.mark.skipif(not installed("foolbox"), reason="the smoke run needs `pip install --no-deps foolbox==3.3.4`")
def test_smoke_mode_runs_every_command_and_resumes(tmp_path):
    skip, budget = 5, {"N0": "10", "N": "100"}  # lighter than the script's smoke defaults: this runs it twice
    proc = _run(tmp_path, SMOKE="1", SKIP=str(skip), **budget)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not results" in proc.stderr
    out = tmp_path / "results"
    indices = [str(i) for i in range(0, 20, skip)]
    for run in ("rs", "splitz"):
        header, rows = _rows(out / f"{run}.tsv")
        assert header[:6] == COHEN
        assert [row[0] for row in rows] == indices and all(len(row) == len(header) for row in rows)
        for row in rows:
            assert 0 <= int(row[1]) <= 9 and -1 <= int(row[2]) <= 9 and float(row[3]) >= 0 and row[4] in ("0", "1")
        settings = json.loads((out / f"{run}.tsv.json").read_text())
        assert settings["dataset"] == "cifar10-samples" and settings["model_spec"]["name"] == "cifar_resnet110"
        assert settings["model_spec"]["split"] == "test"  # trained on the test images: recorded, not hidden
        log = (out / f"{run}.train.log").read_text().splitlines()
        assert len(log) == 1 and "epoch_seconds" in json.loads(log[0])
    header, splitz_rows = _rows(out / "splitz.tsv")
    assert all(row[header.index("bound")].startswith("local") for row in splitz_rows)
    table = (out / "table.md").read_text()
    assert "| run | r=0 | r=0.25 | r=0.5 | r=0.75 | r=1 | r=1.25 | r=1.5 | ACR |" in table
    assert "RS (s=0) [smoke: not a result]" in table and "SPLITZ (s=1) [smoke: not a result]" in table
    for name in ("table.tex", "certified_accuracy.png", "certified_accuracy.pdf"):
        assert (out / name).stat().st_size > 0

    # A second run resumes everything: nothing trained or certified again, the TSVs are unchanged.
    before = {run: (out / f"{run}.tsv").read_bytes() for run in ("rs", "splitz")}
    again = _run(tmp_path, SMOKE="1", SKIP=str(skip), **budget)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {run: (out / f"{run}.tsv").read_bytes() for run in ("rs", "splitz")} == before


def test_full_mode_without_the_users_data_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ROOT", "SMOKE")}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "set ROOT to your CIFAR-10 folder" in proc.stderr


def test_relative_root_is_the_callers_folder(tmp_path):
    proc = _run(tmp_path, ROOT="mydata", DEVICE="cpu")
    assert proc.returncode == 2
    assert f"root folder {str(tmp_path / 'mydata')!r} does not exist" in proc.stderr
