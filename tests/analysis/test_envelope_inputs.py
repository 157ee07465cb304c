"""Envelopes and tables over the inputs runs hold: ``splitz envelope`` refuses a group whose σ runs hold different
inputs (the best σ must be chosen on one test set), ``analyze`` ranks runs only against runs over the same inputs and
shows σ, and a file whose last line is torn is read up to its last complete row."""
import json
import warnings

import numpy as np
import pytest

from splitz_fast.analysis import envelope as env
from splitz_fast.analysis.plots import analyze
from splitz_fast.analysis.tables import IncompleteLastLineWarning, markdown_table, read_certification
from splitz_fast.cli.main import main

HEADER = "idx\tlabel\tpredict\tradius\tcorrect\ttime"


def _run(tmp_path, name, sigma, inputs, radius=0.5, n=1000, rows=None):
    """A certify TSV over dataset indices 0..inputs-1 (every input correct at ``radius``) and its sidecar."""
    path = tmp_path / f"{name}.tsv"
    lines = rows if rows is not None else [f"{i}\t{i % 10}\t{i % 10}\t{radius}\t1\t0.1" for i in range(inputs)]
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    (tmp_path / f"{name}.tsv.json").write_text(json.dumps({
        "kind": "certify", "sigma": sigma, "n0": 100, "n": n, "alpha": 0.001, "indices": [0, inputs - 1, inputs]}))
    return str(path)


def test_envelope_refuses_a_group_of_runs_over_different_inputs_in_one_line(tmp_path, capsys):
    wide, narrow = _run(tmp_path, "s075", 0.75, 20), _run(tmp_path, "s050", 0.5, 6, radius=1.0)
    assert main(["envelope", "--group", "RS", wide, narrow]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --group RS mixes runs over different inputs (")
    assert f"σ=0.75 ({wide}): 20 inputs" in err and f"σ=0.5 ({narrow}): 6 inputs" in err
    assert "same --split, --skip and --max" in err
    with pytest.raises(ValueError, match=r"^group RS mixes runs over different inputs"):  # tables built in Python
        env.envelope_report({"RS": {0.75: read_certification(wide), 0.5: read_certification(narrow)}}, [0.0])


def test_envelope_of_runs_over_the_same_inputs_says_when_groups_differ_and_titles_its_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rs = [_run(tmp_path, f"rs{s}", s, 20, radius=s) for s in (0.25, 0.5)]
    splitz = [_run(tmp_path, "splitz", 0.5, 6, radius=1.0)]
    assert main(["envelope", "--group", "RS", *rs, "--group", "SPLITZ", *splitz, "--radii", "0", "0.5", "1",
                 "--out", str(tmp_path / "e")]) == 0
    text = capsys.readouterr().out
    assert "| RS envelope | 100.0 (σ=0.25) | 100.0 (σ=0.5) | 0.0 (σ=0.25) |" in text
    assert "The groups hold different inputs (RS: 20 inputs; SPLITZ: 6 inputs)" in text
    assert (tmp_path / "e" / "envelope.png").stat().st_size > 1000
    groups = {"RS": env.load_group(rs), "SPLITZ": env.load_group(splitz)}
    assert env._plot_protocol(groups) == "RS: n = 1,000, α = 0.001, 20 inputs\nSPLITZ: n = 1,000, α = 0.001, 6 inputs"
    assert env._plot_protocol({"RS": groups["RS"]}) == "n = 1,000, α = 0.001, 20 inputs"


def test_envelope_plot_has_a_legend_entry_per_sigma(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    labels, titles = [], []
    monkeypatch.setattr(Axes, "legend", lambda self, *a, **k: labels.extend(self.get_legend_handles_labels()[1]))
    monkeypatch.setattr(Axes, "set_title", lambda self, title, **k: titles.append(title))
    group = env.load_group([_run(tmp_path, f"rs{s}", s, 8, radius=s) for s in (0.25, 0.5)])
    env.envelope_report({"RS": group}, [0.0], out_dir=tmp_path / "e")
    assert labels == ["RS envelope", "RS σ = 0.25", "RS σ = 0.5"]
    assert titles == ["best-σ envelope\nn = 1,000, α = 0.001, 8 inputs"]


def test_analyze_bolds_only_among_runs_over_the_same_inputs_and_shows_sigma(tmp_path):
    low, high = _run(tmp_path, "low", 0.25, 10, radius=0.3), _run(tmp_path, "high", 0.5, 10, radius=0.6)
    other = _run(tmp_path, "other", 1.0, 4, radius=2.0)  # the best numbers, on other inputs
    text = analyze([low, high, other], [0.5])
    assert "| low | 0.0 | 0.300 |" in text and "| high | **100.0** | **0.600** |" in text
    assert "| other | 100.0 | 2.000 |" in text  # alone on its inputs: nothing to rank it against
    assert ("Runs over different inputs, ranked only among runs over the same inputs: low, high (10 inputs); other "
            "(4 inputs).") in text
    assert "| run | σ | images |" in text and "| low | 0.25 | 10 |" in text and "| other | 1 | 4 |" in text
    same = markdown_table({"low": read_certification(low), "high": read_certification(high)}, [0.5])
    assert "Runs over different inputs" not in same


def test_a_torn_last_line_is_left_out_with_one_line_on_stderr(tmp_path, capsys):
    rows = [f"{i}\t1\t1\t0.5\t1\t0.1" for i in range(3)]
    path = tmp_path / "running.tsv"
    path.write_text("\n".join([HEADER, *rows]) + "\n3\t1\t1\t0.")  # a row cut while it was being written
    assert main(["analyze", str(path), "--radii", "0.5"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"note: {path}: its last line (5) is incomplete (no line end: a run still writing it, or "
                            "stopped while writing it) and is left out\n")
    assert "| running | 100.0 | 0.500 |" in captured.out and "| running | — | 3 |" in captured.out
    with pytest.warns(IncompleteLastLineWarning, match="last line"):
        np.testing.assert_array_equal(read_certification(path).idx, [0, 1, 2])
    path.write_text("\n".join([HEADER, *rows]))  # a complete last row without a line end is read, without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_certification(path)) == 3
    path.write_text("\n".join([HEADER, "0\t1\t1\t0.", *rows]) + "\n")  # a bad row elsewhere is still an error
    with pytest.raises(ValueError, match=r"running.tsv:2: expected 6 tab-separated fields"):
        read_certification(path)


def _overlapping_tick_labels(fig) -> list[str]:
    """Pairs of neighbouring x tick labels whose drawn boxes overlap, on every axis of ``fig``."""
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        found += [f"{a.get_text()} / {b.get_text()}" for (a, box_a), (b, box_b)
                  in zip(zip(labels, boxes), zip(labels[1:], boxes[1:])) if box_a.x1 > box_b.x0]
    return found


def test_the_diagnostics_histograms_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from splitz_fast.analysis.diagnostics import CertificateDiagnostics, NeuronStates, diagnostics_report

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or save(self, *a, **k))
    rows = 40
    spread = np.linspace(0.0, 1.0, rows)
    lipschitz = 123456.7 * (1 + spread)  # six-digit labels: matplotlib's default nine ticks collide
    states = NeuronStates(0.3 * spread, 0.1 * spread, 1 - 0.4 * spread, np.ones(4, dtype=bool))
    diag = CertificateDiagnostics(np.arange(rows), lipschitz, 0.5 * np.ones(rows), 0.9 * np.ones(rows), states)
    diagnostics_report(diag, "narrow", out_dir=tmp_path)
    fig = figures[0]
    fig.canvas.draw()
    assert _overlapping_tick_labels(fig) == []
