"""The rows every run kind writes, pinned: certify (sound, an estimate protocol, sequential),
predict, certify-margin and attack on fixed checkpoints and seeds must write the same TSV bytes — every column but
the timing one — whatever the run pipeline looks like inside. The checkpoints and the expected rows live in
tests/runs/run_rows/; `SPLITZ_REGENERATE_RUN_ROWS=1` rewrites the expected rows (only after a deliberate change of
what a row contains, never to make this test pass)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from splitz_fast.cli.main import main

DATA = Path(__file__).parent / "run_rows"
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
    # As that version wrote it: sidecar schema 1 (no "schema" entry), checkpoint_format left out at "splitz".
    earlier = {**{key: value for key, value in settings.items() if key not in ("schema", "checkpoint_format")},
               "kind": "certify", "n0": 1, "n": 1, "alpha": 0.5, "sigma": None}
    out.write_text("\n".join(out.read_text().splitlines()[:3]) + "\n")  # the header and two rows
    sidecar.write_text(json.dumps(earlier))
    assert main([*args, "--resume"]) == 0
    assert _without_time(out.read_text()) == _without_time((DATA / "certify-margin.tsv").read_text())
    sidecar.write_text(json.dumps({**earlier, "gamma_search": "one-step"}))
    assert main([*args, "--resume"]) == 2


@pytest.mark.parametrize("edit", ["foreign row", "duplicated row"])
def test_a_resume_refuses_rows_that_are_not_this_runs(edit, tmp_path, tiny, capsys):
    """A file with a row of an input the run does not select, or a row written twice, would resume into more rows
    than inputs (and analyze would count them): refused, the file untouched."""
    out = tmp_path / "margin.tsv"
    args = [arg.replace("{out}", str(out)) for arg in RUNS["certify-margin"]]
    assert main(args) == 0
    header, first, *rest = out.read_text().splitlines()
    extra = "\t".join(["1", *first.split("\t")[1:]]) if edit == "foreign row" else rest[0]  # --skip 4 never selects 1
    out.write_text("\n".join([header, first, *rest[:1], extra]) + "\n")
    edited = out.read_text()
    assert main([*args, "--resume"]) == 2
    assert ("which this run does not select" if edit == "foreign row" else "has two rows") in capsys.readouterr().err
    assert out.read_text() == edited


def test_a_sigma_other_than_the_trained_one_is_noted_once(tmp_path, tiny, capsys):
    args = [arg.replace("{out}", str(tmp_path / "p.tsv")) for arg in RUNS["predict"]]
    assert main(args) == 0
    assert "note: SIGMA" not in capsys.readouterr().err  # the trained σ: nothing to say
    args = [arg.replace("{out}", str(tmp_path / "q.tsv")).replace("0.5", "0.25") for arg in RUNS["predict"]]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("note: SIGMA = 0.25, but the checkpoint was trained with sigma = 0.5") == 1


def test_a_second_writer_of_the_same_tsv_is_refused(tmp_path, tiny, capsys):
    """While one process writes a run (it holds its sidecar's lock), another started on the same OUTFILE stops at
    once with one line, leaving the file as it was."""
    import fcntl

    out = tmp_path / "margin.tsv"
    args = [arg.replace("{out}", str(out)) for arg in RUNS["certify-margin"]]
    args = [*args, "--max", "2"]
    assert main(args) == 0
    before = out.read_text()
    with open(out.with_name(out.name + ".json")) as held:  # the lock as a running process holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert main([*args, "--resume"]) == 2
        assert "another process is writing" in capsys.readouterr().err
    assert out.read_text() == before
    assert main([*args, "--resume"]) == 0  # the lock went with its holder


def test_a_resume_of_an_emptied_tsv_says_what_it_found(tmp_path, tiny, capsys):
    out = tmp_path / "margin.tsv"
    args = [arg.replace("{out}", str(out)) for arg in RUNS["certify-margin"]]
    assert main(args) == 0
    out.write_text("")
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "it is empty, not the header this run writes ('idx" in err and "start a new OUTFILE" in err


def test_a_row_removed_from_the_middle_is_recomputed_in_its_place(tmp_path, tiny):
    """A resume recomputes a missing row wherever it was; the finished file is in the selection's order, as an
    uninterrupted run writes it."""
    out = tmp_path / "margin.tsv"
    args = [arg.replace("{out}", str(out)) for arg in RUNS["certify-margin"]]
    assert main(args) == 0
    whole = out.read_text().splitlines()
    out.write_text("\n".join(whole[:3] + whole[4:]) + "\n")  # the third row gone
    assert main([*args, "--resume"]) == 0
    assert _without_time(out.read_text()) == _without_time("\n".join(whole))
    assert not list(tmp_path.glob("*.ordering"))
