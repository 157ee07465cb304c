"""Reading certification TSVs and the statistics, tables and plots built on them.

Every expected number is computed by hand in the comments next to it.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from splitz_fast.analysis import plots
from splitz_fast.analysis import tables as an
from splitz_fast.runs import rows as results

SPLITZ_HEADER = "idx\tlabel\tpredict\tradius\tcorrect\ttime\tL\tgamma\tR_latent\tpA_lower\tbound\tfailure_prob"
COHEN_HEADER = "idx\tlabel\tpredict\tradius\tcorrect\ttime"

# Run "A" (SPLITZ columns), 5 rows:
#   row 0: correct, radius exactly 0.5 (a tie when r = 0.5)
#   row 1: abstention (predict -1, radius 0, correct 0)
#   row 2: correct with radius 0
#   row 3: wrong prediction that still has a radius (must never count)
#   row 4: correct, radius 1.25
A_ROWS = [
    "0\t3\t3\t0.5\t1\t1.0\t2\t0.5\t1\t0.84\tlocal-exact\t0.001",
    "1\t7\t-1\t0\t0\t2.0\t1\t0\t0\t0.4\tidentity\t0.001",
    "2\t1\t1\t0.0\t1\t3.0\t4\t0\t0\t0.5\tlocal-exact\t0.001",
    "3\t2\t5\t0.8\t0\t4.0\t1\t0.8\t0.8\t0.79\tlocal-exact\t0.001",
    "4\t9\t9\t1.25\t1\t5.0\t2\t1.5\t2.5\t0.99\tglobal-exact\t0.0011",
]
# Run "B" in Cohen's original six-column format with datetime.timedelta times, 4 rows.
B_ROWS = [
    "0\t3\t3\t0.25\t1\t0:00:01.500000",
    "20\t1\t-1\t0.0\t0\t0:00:02.500000",
    "40\t2\t2\t0.75\t1\t0:01:00",
    "60\t4\t4\t0.1\t1\t0:00:00",
]


def write(path, header, rows, trailing_newline=True):
    path.write_text("\n".join([header, *rows]) + ("\n" if trailing_newline else ""), encoding="utf-8")
    return path


@pytest.fixture
def table_a(tmp_path):
    return an.read_certification(write(tmp_path / "A.tsv", SPLITZ_HEADER, A_ROWS))


@pytest.fixture
def table_b(tmp_path):
    return an.read_certification(write(tmp_path / "B.tsv", COHEN_HEADER, B_ROWS))


# ---------------------------------------------------------------------------------------------------- reading

def test_read_splitz_file(table_a):
    assert len(table_a) == 5
    np.testing.assert_array_equal(table_a.idx, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(table_a.label, [3, 7, 1, 2, 9])
    np.testing.assert_array_equal(table_a.predict, [3, -1, 1, 5, 9])
    np.testing.assert_array_equal(table_a.radius, [0.5, 0.0, 0.0, 0.8, 1.25])
    np.testing.assert_array_equal(table_a.correct, [True, False, True, False, True])
    np.testing.assert_array_equal(table_a.time, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert table_a.columns == tuple(SPLITZ_HEADER.split("\t"))
    assert table_a.is_splitz
    # Numeric extra columns become float arrays, text columns stay strings; all reachable by name.
    assert table_a["L"].dtype == np.float64
    np.testing.assert_array_equal(table_a["L"], [2, 1, 4, 1, 2])
    np.testing.assert_array_equal(table_a["failure_prob"], [0.001] * 4 + [0.0011])
    assert list(table_a["bound"]) == ["local-exact", "identity", "local-exact", "local-exact", "global-exact"]
    assert table_a["radius"] is table_a.radius
    with pytest.raises(KeyError, match="no column 'sigma'"):
        table_a["sigma"]


def test_read_cohen_six_column_file_with_timedelta_times(table_b):
    assert len(table_b) == 4
    assert table_b.columns == tuple(COHEN_HEADER.split("\t"))
    assert table_b.extra == {} and not table_b.is_splitz
    np.testing.assert_array_equal(table_b.idx, [0, 20, 40, 60])
    # 0:00:01.5 -> 1.5 s, 0:00:02.5 -> 2.5 s, 0:01:00 -> 60 s, 0:00:00 -> 0 s
    np.testing.assert_array_equal(table_b.time, [1.5, 2.5, 60.0, 0.0])


def test_read_tolerates_crlf_blank_lines_and_no_trailing_newline(tmp_path):
    path = tmp_path / "crlf.tsv"
    path.write_bytes(("\r\n".join([COHEN_HEADER, B_ROWS[0], "", B_ROWS[1], "  "]) + "\r\n" + B_ROWS[2]).encode())
    table = an.read_certification(path)
    np.testing.assert_array_equal(table.idx, [0, 20, 40])
    assert table.path == str(path)


def test_round_trip_with_the_results_writer(tmp_path):
    from splitz_fast.certify.smoothing import CertifyResult

    def result(prediction, radius, seconds):
        return CertifyResult(prediction=prediction, radius=radius, p_a_lower=0.9, latent_radius=radius,
                             lipschitz=1.0, gamma=float("inf"), bound_kind="identity", failure_prob=0.001,
                             count_a=90, n=100, gamma_evaluations=1, seed=0, seconds=seconds)

    path = tmp_path / "written.tsv"
    with open(path, "w") as fh:
        fh.write(results.HEADER + "\n")
        results.write_row(fh, 0, 4, result(4, 0.3, 0.25))
        results.write_row(fh, 1, 2, result(-1, 0.0, 0.5))
        results.write_row(fh, 2, 2, result(7, 0.9, 0.75))
    table = an.read_certification(path)
    np.testing.assert_array_equal(table.correct, [True, False, False])
    np.testing.assert_array_equal(table.radius, [0.3, 0.0, 0.9])
    assert table.is_splitz and list(table["bound"]) == ["identity"] * 3
    assert table["gamma"][0] == np.inf
    assert an.acr(table) == pytest.approx(0.3 / 3)  # only row 0 is correct


@pytest.mark.parametrize("content, message", [
    ("", r"empty file"),
    ("\n  \n", r"empty file"),
    (COHEN_HEADER + "\n", r"header but no data rows"),
    ("idx\tlabel\tpredict\tradius\tcorrect\n0\t1\t1\t0.5\t1\n", r":1: header must start with"),
    ("idx label predict radius correct time\n0 1 1 0.5 1 2\n", r":1: .*separated by tabs"),
    ("label\tidx\tpredict\tradius\tcorrect\ttime\n1\t0\t1\t0.5\t1\t2\n", r":1: header must start with"),
    (COHEN_HEADER + "\tL\tL\n0\t1\t1\t0.5\t1\t2\t1\t1\n", r":1: header has repeated"),
    (COHEN_HEADER + "\n0\t1\t1\t0.5\t1\t2\n1\t1\t1\t0.5\t1\n", r":3: expected 6 tab-separated fields, got 5"),
    (SPLITZ_HEADER + "\n" + A_ROWS[0] + "\n0\t1\t1\t0.5\t1\t2\n", r":3: expected 12 .* got 6"),
    (COHEN_HEADER + "\n0\t1\t1\t0.5\t1\t2\n1\t1\t1\tbig\t1\t2\n", r":3: malformed row"),
    (COHEN_HEADER + "\n\n\n0\t1\t1\t0.5\t1\tnever\n", r":4: malformed row .*time 'never'"),
    (COHEN_HEADER + "\n0\t1\t1.0\t0.5\t1\t2\n", r":2: malformed row"),
    (COHEN_HEADER + "\n0\t1\t1\t-0.5\t1\t2\n", r":2: radius must be finite and >= 0"),
    (COHEN_HEADER + "\n0\t1\t1\tnan\t1\t2\n", r":2: radius must be finite"),
    (COHEN_HEADER + "\n0\t1\t1\t0.5\t2\t2\n", r":2: correct must be 0 or 1"),
    (COHEN_HEADER + "\n0\t1\t2\t0.5\t1\t2\n", r":2: correct=1 disagrees with predict=2, label=1"),
    (COHEN_HEADER + "\n0\t1\t-1\t0.5\t0\t2\n", r":2: abstention \(predict -1\) must have radius 0"),
    (COHEN_HEADER + "\n5\t1\t1\t0.5\t1\t2\n6\t1\t1\t0.5\t1\t2\n5\t1\t1\t0.5\t1\t2\n", r":4: idx 5 already seen on line 2"),
])
def test_read_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        an.read_certification(path)


# ---------------------------------------------------------------------------------------------------- statistics

def test_statistics_by_hand_run_a(table_a):
    # Certified (correct) radii: 0.5, 0.0, 1.25 out of 5 rows; the abstention and the wrong row never count.
    # r=0: 3/5; r=0.25: {0.5, 1.25} 2/5; r=0.5: tie counts, 2/5; just above 0.5: {1.25} 1/5; r=1.25: 1/5; 1.3: 0.
    radii = [0.0, 0.25, 0.5, 0.5 + 1e-9, 1.25, 1.3, 10.0]
    np.testing.assert_allclose(an.certified_accuracy(table_a, radii), [0.6, 0.4, 0.4, 0.2, 0.2, 0.0, 0.0])
    # The wrong row 3 has radius 0.8: at r=0.8 only row 4 (1.25) counts.
    assert an.certified_accuracy(table_a, 0.8) == pytest.approx(0.2)
    assert an.clean_accuracy(table_a) == pytest.approx(0.6)
    assert an.acr(table_a) == pytest.approx((0.5 + 0.0 + 1.25) / 5)  # 0.35
    assert an.abstention_rate(table_a) == pytest.approx(1 / 5)
    assert an.mean_time(table_a) == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    assert an.summarize(table_a) == an.Summary(n=5, clean_accuracy=pytest.approx(0.6), acr=pytest.approx(0.35),
                                                abstention_rate=pytest.approx(0.2), mean_time=pytest.approx(3.0))


def test_statistics_by_hand_run_b(table_b):
    # Certified radii 0.25, 0.75, 0.1 out of 4 rows (row 20 abstains).
    np.testing.assert_allclose(an.certified_accuracy(table_b, [0, 0.1, 0.25, 0.5, 0.75, 1.0]),
                               [3 / 4, 3 / 4, 2 / 4, 1 / 4, 1 / 4, 0])
    assert an.acr(table_b) == pytest.approx((0.25 + 0.75 + 0.1) / 4)  # 0.275
    assert an.abstention_rate(table_b) == pytest.approx(0.25)
    assert an.mean_time(table_b) == pytest.approx((1.5 + 2.5 + 60 + 0) / 4)  # 16 s


def test_certified_accuracy_shapes_and_radius_checks(table_a):
    assert isinstance(an.certified_accuracy(table_a, 0.5), float)
    grid = an.certified_accuracy(table_a, np.zeros((2, 3)))
    assert isinstance(grid, np.ndarray) and grid.shape == (2, 3)
    assert an.certified_accuracy(table_a, []).shape == (0,)
    for bad in (-0.1, [0.0, -1.0], float("nan")):
        with pytest.raises(ValueError, match="radii must be >= 0"):
            an.certified_accuracy(table_a, bad)


def test_empty_table_statistics_raise():
    empty = an.CertificationTable(*(np.zeros(0, dtype=dtype) for dtype in (int, int, int, float, bool, float)))
    for statistic in (an.acr, an.clean_accuracy, an.abstention_rate, an.mean_time, an.summarize):
        with pytest.raises(ValueError, match="no certification rows"):
            statistic(empty)


def test_agrees_with_a_plain_loop_on_random_runs():
    rng = np.random.default_rng(0)
    for _ in range(5):
        n = int(rng.integers(1, 60))
        predict = rng.integers(-1, 3, n)
        label = rng.integers(0, 3, n)
        # Radii on a coarse grid so that ties with the query radii happen.
        radius = np.where(predict == -1, 0.0, rng.integers(0, 8, n) * 0.25)
        table = an.CertificationTable(idx=np.arange(n), label=label, predict=predict, radius=radius,
                                      correct=predict == label, time=np.ones(n))
        radii = np.arange(0, 2.25, 0.125)
        rows = list(zip(radius.tolist(), (predict == label).tolist()))
        expected = [sum(1 for r_i, c_i in rows if c_i and r_i >= r) / n for r in radii]
        np.testing.assert_allclose(an.certified_accuracy(table, radii), expected, rtol=0, atol=1e-15)
        assert an.acr(table) == pytest.approx(sum(r_i * c_i for r_i, c_i in rows) / n, abs=1e-15)


def test_curve_is_exact_at_the_drops(table_a):
    radii, accuracy = plots.certified_accuracy_curve(table_a, max_radius=2.0, points=9)
    assert radii[0] == 0.0 and radii[-1] == 2.0 and np.all(np.diff(radii) > 0)
    assert {0.5, 1.25} <= set(radii.tolist())  # each certified radius is a grid point
    assert accuracy[radii.tolist().index(0.5)] == pytest.approx(0.4)
    assert accuracy[radii.tolist().index(0.75)] == pytest.approx(0.2)  # 0.75 is on the uniform grid
    assert 0.8 not in radii  # the wrong row's radius causes no drop, so it is not added
    assert np.all(np.diff(accuracy) <= 0)


# ---------------------------------------------------------------------------------------------------- tables

RADII = [0, 0.25, 0.5]
# A: r=0 60.0, r=0.25 40.0, r=0.5 40.0, ACR 0.350.  B: 75.0, 50.0, 25.0, ACR 0.275.
# Best: B at r=0 and r=0.25; A at r=0.5 and ACR.


def test_markdown_table_cells_and_bold(table_a, table_b):
    """A and B hold different inputs: nothing is ranked across them (bold among runs over the same inputs:
    tests/analysis/test_envelope_inputs.py), and a line says which runs hold which inputs."""
    text = an.markdown_table({"A": table_a, "B": table_b}, RADII)
    assert text.splitlines() == [
        "| run | r=0 | r=0.25 | r=0.5 | ACR |",
        "|---|---:|---:|---:|---:|",
        "| A | 60.0 | 40.0 | 40.0 | 0.350 |",
        "| B | 75.0 | 50.0 | 25.0 | 0.275 |",
        "",
        "Runs over different inputs, ranked only among runs over the same inputs: A (5 inputs); B (4 inputs).",
    ]


def test_latex_table_cells_and_bold(table_a, table_b):
    text = an.latex_table({"A": table_a, "run_B & 50%": table_b}, RADII)
    lines = text.splitlines()
    assert r"\begin{tabular}{lrrrr}" in lines
    assert lines.index(r"\toprule") < lines.index(r"\midrule") < lines.index(r"\bottomrule")
    assert r" & \multicolumn{3}{c}{certified accuracy (\%) at radius $r$} & \\" in lines
    assert r"run & $0$ & $0.25$ & $0.5$ & ACR \\" in lines
    assert r"A & 60.0 & 40.0 & 40.0 & 0.350 \\" in lines  # different inputs: not ranked against each other
    assert r"run\_B \& 50\% & 75.0 & 50.0 & 25.0 & 0.275 \\" in lines
    assert lines[-1] == r"\end{tabular}"


def test_latex_table_is_ascii_for_pdflatex(table_a):
    """Run names such as the demo's "SPLITZ (s=1, σ=0.75)" must not put raw Unicode into table.tex."""
    text = an.latex_table({"SPLITZ (s=1, σ=0.75)": table_a, "λ ≥ 0.5 → γ×2": table_a}, RADII)
    assert text.isascii()
    assert r"SPLITZ (s=1, $\sigma$=0.75) & " in text
    assert r"$\lambda$ $\geq$ 0.5 $\to$ $\gamma$$\times$2 & " in text


def test_radius_errors_show_the_bad_values_plainly(table_a):
    with pytest.raises(ValueError, match=r"^radii must be >= 0, got -1, nan$"):
        an.certified_accuracy(table_a, np.array([0.5, -1.0, float("nan")]))


def test_ties_are_all_bold_and_a_single_run_has_none(table_a):
    tied = an.markdown_table({"x": table_a, "y": table_a}, [0.5]).splitlines()
    assert tied[2:] == ["| x | **40.0** | **0.350** |", "| y | **40.0** | **0.350** |"]
    single = an.markdown_table({"x": table_a}, [0.5])
    assert "**" not in single and "| x | 40.0 | 0.350 |" in single
    assert r"\textbf" not in an.latex_table({"x": table_a}, [0.5])
    with pytest.raises(ValueError, match="no runs"):
        an.markdown_table({}, [0.5])


def test_summary_markdown_table(table_a, table_b):
    lines = an.summary_markdown_table({"A": table_a, "B": table_b}).splitlines()
    assert lines[2] == "| A | — | 5 | 60.0 | 20.0 | 0.350 | 3.00 |"  # no sidecar: no σ recorded
    assert lines[3] == "| B | — | 4 | 75.0 | 25.0 | 0.275 | 16.00 |"


# ---------------------------------------------------------------------------------------------------- plot, analyze

def check_png_pdf(png, pdf):
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 1000
    assert pdf.read_bytes().startswith(b"%PDF") and pdf.stat().st_size > 1000


def test_plot_writes_png_and_pdf_without_touching_the_backend(tmp_path, table_a, table_b):
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    paths = plots.plot_certified_accuracy({"A": table_a, "B": table_b}, tmp_path / "sub" / "curves", title="t")
    assert paths == [tmp_path / "sub" / "curves.png", tmp_path / "sub" / "curves.pdf"]
    check_png_pdf(*paths)
    assert matplotlib.get_backend() == backend
    assert had_pyplot or "matplotlib.pyplot" not in sys.modules
    with pytest.raises(ValueError, match="max_radius"):
        plots.plot_certified_accuracy({"A": table_a}, tmp_path / "x", max_radius=0.0)


def test_plot_title_states_n_alpha_and_inputs_from_the_sidecars(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import json

    from matplotlib.axes import Axes

    titles, labels = [], []
    monkeypatch.setattr(Axes, "set_title", lambda ax, text, **kw: titles.append(text))
    real_step = Axes.step
    monkeypatch.setattr(Axes, "step", lambda ax, *a, **kw: labels.append(kw["label"]) or real_step(ax, *a, **kw))

    def run(name, rows, **settings):
        path = write(tmp_path / f"{name}.tsv", SPLITZ_HEADER, rows)
        if settings:
            (tmp_path / f"{name}.tsv.json").write_text(json.dumps({"kind": "certify", "n0": 100, **settings}))
        return an.read_certification(path)

    a = run("a", A_ROWS, n=10_000, alpha=0.001)
    b = run("b", A_ROWS, n=10_000, alpha=0.001)
    plots.plot_certified_accuracy({"A": a, "B": b}, tmp_path / "same", title="MNIST")
    assert titles[-1] == "MNIST\nn = 10,000, α = 0.001, 5 inputs" and labels[-2:] == ["A (ACR 0.350)", "B (ACR 0.350)"]
    c = run("c", A_ROWS[:3], n=100_000, alpha=0.001)
    plots.plot_certified_accuracy({"A": a, "C": c}, tmp_path / "differ")
    assert titles[-1] == "runs differ in n, α or inputs (see legend)"
    assert labels[-2:] == ["A (ACR 0.350; n = 10,000, α = 0.001, 5 inputs)",
                           "C (ACR 0.167; n = 100,000, α = 0.001, 3 inputs)"]
    assert plots.run_protocol(run("cohen", A_ROWS)) == "n, α not recorded, 5 inputs"
    assert plots.run_protocol(run("m", A_ROWS[:1], n=1, alpha=0.5, certifier="margin")) == \
        "margin certificates (no sampling), 1 input"
    assert plots.run_protocol(run("s", A_ROWS, n=5000, alpha=0.01, sequential=True)) == \
        "budget n = 5,000, α = 0.01, 5 inputs"


def test_plot_keeps_a_backend_the_user_chose(tmp_path, table_a):
    matplotlib = pytest.importorskip("matplotlib")
    previous = matplotlib.get_backend()  # both backends here are non-interactive: switching is harmless
    matplotlib.use("svg")
    try:
        plots.plot_certified_accuracy({"A": table_a}, tmp_path / "curve")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)


def test_analyze_writes_its_files(tmp_path):
    pytest.importorskip("matplotlib")
    a = write(tmp_path / "A.tsv", SPLITZ_HEADER, A_ROWS)
    b = write(tmp_path / "B.tsv", COHEN_HEADER, B_ROWS)
    out = tmp_path / "report"
    text = plots.analyze([a, b], RADII, out_dir=out)
    assert "| A | 60.0 | 40.0 | 40.0 | 0.350 |" in text  # different inputs: not ranked against each other
    assert "| B | 75.0 | 50.0 | 25.0 | 0.275 |" in text
    assert "| B | — | 4 | 75.0 | 25.0 | 0.275 | 16.00 |" in text
    assert (out / "table.md").read_text() == text
    assert r"A & 60.0 & 40.0 & 40.0 & 0.350 \\" in (out / "table.tex").read_text()
    check_png_pdf(out / "certified_accuracy.png", out / "certified_accuracy.pdf")


def test_analyze_names_runs(tmp_path, table_b):
    a = write(tmp_path / "A.tsv", SPLITZ_HEADER, A_ROWS)
    (tmp_path / "other").mkdir()
    a2 = write(tmp_path / "other" / "A.tsv", SPLITZ_HEADER, A_ROWS)
    # A mapping may mix paths and tables; no out_dir means nothing is written.
    text = plots.analyze({"splitz": a, "cohen": table_b}, [0.25])
    assert "| splitz | 40.0 | 0.350 |" in text and "| cohen | 50.0 | 0.275 |" in text
    # Equal file stems fall back to the full paths; a single path is accepted too.
    assert list(an.load_runs([a, a2])) == [str(a), str(a2)]
    assert list(an.load_runs(a)) == ["A"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A.tsv", "B.tsv", "other"]
    with pytest.raises(ValueError, match="no result files"):
        plots.analyze([], [0.25])


def test_a_run_given_twice_or_two_runs_of_one_name_are_refused(tmp_path, monkeypatch, capsys):
    """Runs are keyed by name: a second one of the same name silently replaced the first before."""
    from splitz_fast.cli.main import main

    a = write(tmp_path / "A.tsv", SPLITZ_HEADER, A_ROWS)
    (tmp_path / "other").mkdir()
    b = write(tmp_path / "other" / "B.tsv", SPLITZ_HEADER, A_ROWS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="given more than once"):
        an.load_runs([a, "A.tsv"])
    assert main(["analyze", str(a), str(b), "--names", "X", "X", "--radii", "0", "--out", str(tmp_path / "r")]) == 2
    assert "--names gives a name twice" in capsys.readouterr().err


def test_a_negative_label_is_refused_so_an_abstention_cannot_count_as_correct(tmp_path):
    rows = A_ROWS + ["9\t-1\t-1\t0\t1\t0.1\t1.0\t0.0\t0.0\t0.2\tnone\tnan"]
    path = write(tmp_path / "A.tsv", SPLITZ_HEADER, rows)
    with pytest.raises(ValueError, match="label must be a class index >= 0"):
        an.read_certification(path)


@pytest.mark.parametrize("radius,failure", [(0.1234567891, 0.0010005), (1.9999999, 0.001 + 4.9e-7), (0.5, 0.001)])
def test_rows_never_round_a_certificate_in_the_users_disfavour(radius, failure):
    """A printed radius is never above the certified one, a printed failure probability never below the true one."""
    from splitz_fast.runs.rows import format_row
    from splitz_fast.certify.smoothing import CertifyResult

    result = CertifyResult(prediction=3, radius=radius, p_a_lower=0.9, latent_radius=radius, lipschitz=1.0,
                           gamma=radius, bound_kind="local-probabilistic", failure_prob=failure, count_a=90, n=100,
                           gamma_evaluations=3, seed=0, seconds=0.1, noise_source="torch-cpu")
    fields = format_row(0, 3, result).split("\t")
    assert float(fields[3]) <= radius and float(fields[8]) <= radius
    assert float(fields[11]) >= failure


def test_a_nearly_constant_classifier_is_flagged_in_tables_envelopes_and_diagnostics():
    """A smoothed classifier that answers one class for (nearly) every input is certifiably robust everywhere: its
    certified accuracy is that class's share of the data. analyze's run names, the envelope's cells and diagnose
    say so."""
    from splitz_fast.analysis.tables import CertificationTable, constant_prediction, labelled
    from splitz_fast.analysis.envelope import envelope_report

    def table(predict, label, radius):
        predict, label = np.asarray(predict), np.asarray(label)
        return CertificationTable(idx=np.arange(len(predict)), label=label, predict=predict,
                                  radius=np.asarray(radius, dtype=float) * (predict != -1), correct=predict == label,
                                  time=np.ones(len(predict)))

    labels = np.arange(40) % 10
    constant = table(np.ones(40, dtype=int), labels, np.full(40, 2.0))  # class 1 for every input, radius 2
    nearly = table(np.where(np.arange(40) < 39, 3, -1), labels, np.full(40, 1.0))  # 39 of 40: 97.5 %
    varied = table(labels, labels, np.full(40, 0.5))
    assert constant_prediction(constant) == (1, 1.0) and constant_prediction(nearly) == (3, 0.975)
    assert constant_prediction(varied) is None
    assert constant_prediction(table(np.ones(5, dtype=int), np.zeros(5, dtype=int), np.ones(5))) is None  # too few
    assert labelled("SPLITZ σ=1", constant) == "SPLITZ σ=1 (predicts class 1 for 100 % of inputs)"
    assert "predicts class" not in labelled("RS", varied)
    report = envelope_report({"SPLITZ": {0.5: varied, 1.0: constant}}, [0.0, 1.5])
    row = next(line for line in report.splitlines() if line.startswith("| SPLITZ envelope"))
    assert "| 100.0 (σ=0.5) |" in row  # ε = 0: the varied run wins, unmarked
    assert "10.0 (σ=1)*" in row  # ε = 1.5: only the constant run certifies (class 1 is 10 % of the labels)
    assert "from a run whose smoothed classifier is (nearly) constant" in report
    assert "SPLITZ σ=1 (predicts class 1 for 100 % of inputs)" in report
    from splitz_fast.analysis.diagnostics import CertificateDiagnostics, NeuronStates, diagnostics_report

    ones = np.ones(3)
    diag = CertificateDiagnostics(np.arange(3), ones, ones, 0.9 * ones, NeuronStates(0 * ones, 0 * ones, ones,
                                                                                    np.ones(4, dtype=bool)),
                                  constant="predicts class 1 for 100 % of inputs")
    assert "DEGENERATE: the smoothed classifier predicts class 1 for 100 % of inputs" in diagnostics_report(diag, "t")
    assert "DEGENERATE" not in diagnostics_report(dataclasses.replace(diag, constant=None), "t")


def test_an_unfinished_run_is_marked_and_runs_over_other_inputs_are_not_subtracted(tmp_path):
    """A file with fewer rows than its sidecar selects is a run stopped early: analyze and the envelope said nothing,
    and the envelope subtracted a 3-input run from a 5-input one."""
    import json

    from splitz_fast.analysis.envelope import envelope_report

    def run(name, rows, count, **extra):
        path = write(tmp_path / f"{name}.tsv", SPLITZ_HEADER, rows)
        (tmp_path / f"{name}.tsv.json").write_text(json.dumps({"kind": "certify", "n0": 100, "n": 1000,
                                                               "alpha": 0.001, "indices": [0, 4, count], **extra}))
        return an.read_certification(path)

    finished, stopped = run("rs", A_ROWS, 5), run("splitz", A_ROWS[:3], 5)
    assert an.unfinished_note(finished) is None and an.unfinished_note(stopped) == "unfinished: 3 of 5 inputs"
    assert plots.run_protocol(stopped)  # still analysable: its statistics are those of the inputs it reached
    text = plots.analyze([tmp_path / "rs.tsv", tmp_path / "splitz.tsv"], [0.0, 0.5])
    assert "| splitz (unfinished: 3 of 5 inputs) |" in text and "| rs |" in text
    assert an.unfinished_note(run("shard", A_ROWS[:3], 5, shard={"index": 0, "count": 2})) is None
    report = envelope_report({"RS": {0.5: finished}, "SPLITZ": {0.5: stopped}}, [0.0, 0.5])
    assert "| 0.5 | not compared: the runs hold different inputs (5 and 3 rows) |" in report
    assert "† from a run that stopped before its end (its inputs so far): SPLITZ σ=0.5 unfinished: 3 of 5 inputs." \
        in report
    same = envelope_report({"RS": {0.5: finished}, "SPLITZ": {0.5: finished}}, [0.0])
    assert "| 0.5 | +0.0 | +0.000 |" in same and "†" not in same
