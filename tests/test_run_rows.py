"""The rows every run kind writes, pinned: certify (sound, an estimate protocol, sequential),
predict, certify-margin and attack on fixed checkpoints and seeds must write the same TSV bytes — every column but
the timing one — whatever the run pipeline looks like inside. The checkpoints and the expected rows live in
tests/data/run_rows/; `SPLITZ_REGENERATE_RUN_ROWS=1` rewrites the expected rows (only after a deliberate change of
what a row contains, never to make this test pass)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from splitz_fast.cli import main

DATA = Path(__file__).parent / "data" / "run_rows"
SPLIT1, WHOLE = DATA / "mlp-split1.pt", DATA / "mlp-split3.pt"
SAMPLING = ["--skip", "4", "--N", "200", "--batch", "64", "--seed", "3"]
RUNS = {
    "certify": ["certify", "tiny", str(SPLIT1), "0.5", "{out}", *SAMPLING, "--N0", "20"],
    "certify-paper": ["certify", "tiny", str(SPLIT1), "0.5", "{out}", *SAMPLING, "--N0", "20", "--protocol", "paper"],
    "certify-sequential": ["certify", "tiny", str(SPLIT1), "0.5", "{out}", *SAMPLING, "--N0", "20", "--sequential",
                           "--radii", "0.1", "0.3"],
    "predict": ["predict", "tiny", str(SPLIT1), "0.5", "{out}", *SAMPLING, "--alpha", "0.05"],
    "certify-margin": ["certify-margin", "tiny", str(WHOLE), "{out}", "--skip", "4", "--seed", "3"],
    "attack": ["attack", "tiny", str(SPLIT1), "0.5", "{out}", "--skip", "8", "--eps", "0.3", "--steps", "3",
               "--samples", "4", "--N", "200", "--seed", "3"],
}


def _without_time(text: str) -> list[list[str]]:
    """The TSV's cells, with the timing column (``time``) dropped."""
    rows = [line.split("\t") for line in text.splitlines()]
    drop = rows[0].index("time")
    return [row[:drop] + row[drop + 1:] for row in rows]


@pytest.mark.parametrize("kind", RUNS)
def test_each_run_kind_writes_its_pinned_rows(kind, tmp_path, tiny):
    out = tmp_path / f"{kind}.tsv"
    assert main([arg.replace("{out}", str(out)) for arg in RUNS[kind]]) == 0
    expected = DATA / f"{kind}.tsv"
    if os.environ.get("SPLITZ_REGENERATE_RUN_ROWS") == "1":
        expected.write_text(out.read_text())
    assert _without_time(out.read_text()) == _without_time(expected.read_text())


def test_a_margin_run_recorded_before_the_run_tasks_resumes_to_the_pinned_rows(tmp_path, tiny):
    """Margin runs were recorded as CERTIFY runs with placeholder sampling settings (kind "certify", n0 = n = 1,
    α = 0.5, no σ) before the run tasks; such a run, stopped after two rows, must resume to the same rows — and one
    recorded with other margin settings must still be refused."""
    out = tmp_path / "margin.tsv"
    args = [arg.replace("{out}", str(out)) for arg in RUNS["certify-margin"]]
    assert main(args) == 0
    sidecar = out.with_name(out.name + ".json")
    settings = json.loads(sidecar.read_text())
    assert settings["kind"] == "certify-margin" and "n0" not in settings
    earlier = {**settings, "kind": "certify", "n0": 1, "n": 1, "alpha": 0.5, "sigma": None}
    out.write_text("\n".join(out.read_text().splitlines()[:3]) + "\n")  # the header and two rows
    sidecar.write_text(json.dumps(earlier))
    assert main([*args, "--resume"]) == 0
    assert _without_time(out.read_text()) == _without_time((DATA / "certify-margin.tsv").read_text())
    sidecar.write_text(json.dumps({**earlier, "gamma_search": "one-step"}))
    assert main([*args, "--resume"]) == 2
