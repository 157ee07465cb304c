"""Reading certification result files and turning them into statistics and tables (plots and the ``splitz analyze``
entry point: :mod:`splitz_fast.analysis.plots`).

A certification TSV (Cohen et al. 2019's format, also written by :mod:`splitz_fast.runs.rows`) has a header
line whose first six tab-separated columns are exactly ``idx label predict radius correct time``, then one
line per certified image. SPLITZ's files add ``L gamma R_latent pA_lower bound failure_prob`` after those six;
Cohen's original files stop at six. Any extra columns are kept and can be read by name.

Column meanings and units:

- ``idx``: index of the image in the evaluated split; ``label``: its true class.
- ``predict``: the smoothed classifier's class, or ``-1`` when it abstains (then ``radius`` is 0 and
  ``correct`` is 0).
- ``radius``: certified l2 radius **in input units** (the units of the raw input ``x`` fed to the model, i.e.
  before any standardization the model does itself).
- ``correct``: 1 when ``predict == label``, else 0.
- ``time``: wall-clock seconds spent on the image. SPLITZ writes plain seconds (``1.2345``); Cohen's code wrote
  ``datetime.timedelta`` strings (``0:00:15.123456``); both are read as seconds.

Statistics are taken over **all** rows, abstentions counting as wrong:

- certified accuracy at radius ``r``: ``mean_i(correct_i ∧ radius_i ≥ r)`` (a fraction in [0, 1]);
- clean accuracy: certified accuracy at ``r = 0``, i.e. ``mean_i(correct_i)``;
- ACR (average certified radius): ``mean_i(correct_i · radius_i)``, in input units;
- abstention rate: ``mean_i(predict_i = -1)``; mean time: ``mean_i(time_i)`` in seconds.

:func:`load_runs` reads several files into named tables, each run's name marked where its radii are estimates,
its classifier is (nearly) constant or the run is unfinished (:func:`labelled`).
"""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

import numpy as np

from .._checks import check_input_file, read_settings_file
from ..kinds import NOT_A_CERTIFICATE, certificate_status
from ..runs.rows import COHEN_COLUMNS, SPLITZ_COLUMNS

PathLike = Union[str, "os.PathLike[str]"]

#: Radii (input units) used when a caller has no preference; r = 0 gives the clean accuracy.
DEFAULT_RADII = (0.0, 0.25, 0.5, 0.75, 1.0)

_ABSTAIN = -1
_INT_COLUMNS = ("idx", "label", "predict", "correct")


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class CertificationTable:
    """The rows of one certification TSV, one numpy array per column (row ``i`` is the ``i``-th data line).

    Attributes:
        idx, label, predict: ``int64`` arrays; ``predict`` is ``-1`` for an abstention.
        radius: ``float64`` certified l2 radius in input units (0 for abstentions).
        correct: ``bool`` array, ``predict == label``.
        time: ``float64`` seconds per image.
        extra: columns after Cohen's six, by name, in file order: ``float64`` when every value parses as a
            number, otherwise the raw strings (``object`` array), e.g. SPLITZ's ``bound`` column.
        path: the file this was read from, if any.
        recorded_certificate: ``False`` when the run's sidecar (``OUTFILE.json``) records ``certificate: false`` (an
            estimate protocol's run), else ``None``.
        planned_inputs: how many inputs the run selects, as its sidecar records them (``None`` without one, and for
            a shard's file): more than the rows means the run is unfinished (:func:`unfinished_note`).

    ``table["name"]`` returns any column (Cohen's six or an extra one); ``len(table)`` is the number of rows.
    Rows that mix certificates with estimates (their ``bound`` column), or estimate-run sidecars beside certificate
    rows, are refused (``ValueError``): such a table would count estimates as certified.
    """

    idx: np.ndarray
    label: np.ndarray
    predict: np.ndarray
    radius: np.ndarray
    correct: np.ndarray
    time: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    path: str | None = None
    recorded_certificate: bool | None = None
    planned_inputs: int | None = None

    def __post_init__(self) -> None:
        where = self.path or "the certification table"
        rows = certificate_status(self.extra.get("bound", ()), where)
        if rows is True and self.recorded_certificate is False:
            raise ValueError(f"{where}: its sidecar records an estimate run (certificate: false) but its rows are "
                             "certificates; the file and its sidecar belong to different runs")
        object.__setattr__(self, "_rows_certificate", rows)

    def __len__(self) -> int:
        return int(self.idx.shape[0])

    @property
    def columns(self) -> tuple[str, ...]:
        """All column names in file order."""
        return COHEN_COLUMNS + tuple(self.extra)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in COHEN_COLUMNS:
            return getattr(self, name)
        if name in self.extra:
            return self.extra[name]
        raise KeyError(f"no column {name!r}; columns are {', '.join(self.columns)}")

    @property
    def is_splitz(self) -> bool:
        """True when SPLITZ's extra columns are all present."""
        return all(c in self.extra for c in SPLITZ_COLUMNS)

    @property
    def is_estimate(self) -> bool:
        """True for an estimate protocol's run (``splitz certify --protocol paper`` or ``published-code``: its rows'
        ``bound`` or its sidecar say so): its radii are not certificates (:mod:`splitz_fast.kinds`), never counted
        as certified nor shown as a best value."""
        return self._rows_certificate is False or self.recorded_certificate is False


class IncompleteLastLineWarning(UserWarning):
    """A certification TSV whose last line has no line end was read without that line (:func:`read_certification`)."""


def _parse_seconds(text: str) -> float:
    """Seconds from ``"12.5"`` or a ``datetime.timedelta`` string (``"0:00:15.1"``, ``"1 day, 2:03:04"``)."""
    try:
        return float(text)
    except ValueError:
        pass
    match = re.fullmatch(r"(?:(-?\d+) days?, )?(\d+):(\d{1,2}):(\d{1,2}(?:\.\d*)?)", text)
    if match is None:
        raise ValueError(f"time {text!r} is neither seconds nor H:MM:SS")
    days, hours, minutes, seconds = match.groups()
    return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _extra_column(values: list[str]) -> np.ndarray:
    try:
        return np.array([float(v) for v in values], dtype=np.float64)
    except ValueError:
        return np.array(values, dtype=object)


def _parse_row(header: list[str], line: str, where: str) -> tuple[dict[str, int], float, float, dict[str, str]]:
    """One data line's integer columns, radius, seconds and raw fields, checked (``ValueError`` naming ``where``)."""
    fields = [value.strip() for value in line.split("\t")]
    if len(fields) != len(header):
        raise ValueError(f"{where}: expected {len(header)} tab-separated fields, got {len(fields)}: {line!r}")
    row = dict(zip(header, fields))
    try:
        values = {name: int(row[name]) for name in _INT_COLUMNS}
        r = float(row["radius"])
        t = _parse_seconds(row["time"])
    except ValueError as err:
        raise ValueError(f"{where}: malformed row ({err}): {line!r}") from None
    if not math.isfinite(r) or r < 0:
        raise ValueError(f"{where}: radius must be finite and >= 0, got {row['radius']!r}")
    if values["correct"] not in (0, 1):
        raise ValueError(f"{where}: correct must be 0 or 1, got {row['correct']!r}")
    if values["label"] < 0:  # else a label of -1 would make an abstention "correct"
        raise ValueError(f"{where}: label must be a class index >= 0, got {row['label']!r}")
    if values["correct"] != int(values["predict"] == values["label"]):
        raise ValueError(f"{where}: correct={values['correct']} disagrees with "
                         f"predict={values['predict']}, label={values['label']}")
    if values["predict"] == _ABSTAIN and r != 0:
        raise ValueError(f"{where}: abstention (predict -1) must have radius 0, got {row['radius']!r}")
    return values, r, t, row


def _is_row(header: list[str], line: str) -> bool:
    try:
        _parse_row(header, line, "")
    except ValueError:
        return False
    return True


def read_certification(path: PathLike) -> CertificationTable:
    """Read a certification TSV (Cohen's six columns first, any extra columns after).

    Blank lines are ignored; line numbers in errors are 1-based lines of the file. A last data line that has no line
    end and is not a valid row is left out with an :class:`IncompleteLastLineWarning`: rows are written whole with
    their line end, so it is one that a run is still writing, or was stopped while writing, and the file is read up
    to its last complete row. (A last row without a line end that is valid is read, as hand-written files have them.)

    Raises:
        ValueError: the file is empty or has a header but no rows; the header does not start with
            ``idx label predict radius correct time`` (tab-separated) or repeats a column name; a row has the
            wrong number of fields, a value that does not parse, a negative or non-finite radius, ``correct``
            other than ``predict == label``, an abstention with a nonzero radius, or an ``idx`` seen before.
        FileNotFoundError, IsADirectoryError: no file at ``path`` (one line naming it).
    """
    path = os.fspath(path)
    check_input_file(path, "a certification TSV")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = fh.readlines()
    except OSError as err:
        raise type(err)(f"{path}: cannot be read ({err.strerror or type(err).__name__})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file (byte {err.start} is not UTF-8); expected a certification TSV "
                         f"whose header starts with {' '.join(COHEN_COLUMNS)}") from None
    lines = [(number, line.rstrip("\r\n")) for number, line in enumerate(raw, start=1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty file, expected a header starting with {' '.join(COHEN_COLUMNS)}")

    header_number, header_line = lines[0]
    header = [name.strip() for name in header_line.split("\t")]
    if tuple(header[:len(COHEN_COLUMNS)]) != COHEN_COLUMNS:
        hint = " (columns must be separated by tabs)" if "\t" not in header_line else ""
        raise ValueError(
            f"{path}:{header_number}: header must start with the tab-separated columns "
            f"{' '.join(COHEN_COLUMNS)}, got {header_line!r}{hint}")
    duplicates = sorted({name for name in header if header.count(name) > 1})
    if duplicates or "" in header:
        raise ValueError(f"{path}:{header_number}: header has repeated or empty column names: {header_line!r}")
    unended = len(raw) if not raw[-1].endswith("\n") else None  # rows are written whole, with their line end
    if len(lines) > 1 and lines[-1][0] == unended and not _is_row(header, lines[-1][1]):
        warnings.warn(IncompleteLastLineWarning(
            f"{path}: its last line ({len(raw)}) is incomplete (no line end: a run still writing it, or stopped while "
            "writing it) and is left out"), stacklevel=2)
        lines.pop()
    if len(lines) == 1:
        raise ValueError(f"{path}: header but no data rows")

    ints = {name: [] for name in _INT_COLUMNS}
    radius: list[float] = []
    seconds: list[float] = []
    extra: dict[str, list[str]] = {name: [] for name in header[len(COHEN_COLUMNS):]}
    first_line_of_idx: dict[int, int] = {}
    for number, line in lines[1:]:
        where = f"{path}:{number}"
        values, r, t, row = _parse_row(header, line, where)
        if values["idx"] in first_line_of_idx:
            raise ValueError(f"{where}: idx {values['idx']} already seen on line {first_line_of_idx[values['idx']]}")
        first_line_of_idx[values["idx"]] = number
        for name in _INT_COLUMNS:
            ints[name].append(values[name])
        radius.append(r)
        seconds.append(t)
        for name in extra:
            extra[name].append(row[name])

    settings = _sidecar_settings(path)
    return CertificationTable(
        idx=np.array(ints["idx"], dtype=np.int64),
        label=np.array(ints["label"], dtype=np.int64),
        predict=np.array(ints["predict"], dtype=np.int64),
        radius=np.array(radius, dtype=np.float64),
        correct=np.array(ints["correct"], dtype=bool),
        time=np.array(seconds, dtype=np.float64),
        extra={name: _extra_column(values) for name, values in extra.items()},
        path=path,
        recorded_certificate=False if settings.get("certificate", True) is False else None,
        planned_inputs=_planned_inputs(settings),
    )


def _planned_inputs(settings: dict) -> int | None:
    """The number of inputs a run's sidecar selects (its ``indices``: first, last, count), or ``None``: no sidecar,
    another layout, or a shard's file (which holds its share of them)."""
    indices = settings.get("indices")
    if "shard" in settings or not isinstance(indices, list) or len(indices) != 3:
        return None
    count = indices[2]
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def _sidecar_settings(path: str | None) -> dict:
    """The settings ``splitz certify`` recorded beside ``path`` (``OUTFILE.json``); empty when there are none (Cohen's
    files, tables built in memory) or they do not parse (they only label the run: the rows are what is read)."""
    try:
        return read_settings_file(f"{path}.json") if path else {}
    except ValueError:
        return {}


# --------------------------------------------------------------------------------------------------------------
# Statistics (over all rows; abstentions count as wrong)
# --------------------------------------------------------------------------------------------------------------

def _require_rows(table: CertificationTable) -> int:
    n = len(table)
    if n == 0:
        raise ValueError("no certification rows to analyze")
    return n


def certified_accuracy(table: CertificationTable, radii: float | Iterable[float]) -> float | np.ndarray:
    """Certified accuracy ``mean_i(correct_i ∧ radius_i ≥ r)`` over all rows, for each radius ``r``.

    Radii are l2 distances in input units, ``r ≥ 0``. A scalar ``radii`` gives a ``float``; anything else a
    ``float64`` array of the same shape. Each value is a fraction in [0, 1]. A row whose radius equals ``r``
    exactly counts as certified at ``r``.
    """
    n = _require_rows(table)
    r = np.asarray(radii, dtype=np.float64)
    if np.isnan(r).any() or (r < 0).any():
        bad = [v for v in np.atleast_1d(r).tolist() if not v >= 0]
        raise ValueError(f"radii must be >= 0, got {', '.join(f'{v:g}' for v in bad)}")
    certified = np.sort(table.radius[table.correct])
    # Rows with radius >= r are those at or after the first position where r could be inserted.
    counts = certified.size - np.searchsorted(certified, r, side="left")
    accuracy = counts / n
    return float(accuracy) if accuracy.ndim == 0 else accuracy


def clean_accuracy(table: CertificationTable) -> float:
    """Certified accuracy at ``r = 0``: the fraction of rows predicted correctly (abstentions are wrong)."""
    return float(certified_accuracy(table, 0.0))


def acr(table: CertificationTable) -> float:
    """Average certified radius ``mean_i(correct_i · radius_i)`` over all rows, in input units."""
    _require_rows(table)
    return float(np.mean(np.where(table.correct, table.radius, 0.0)))


def abstention_rate(table: CertificationTable) -> float:
    """Fraction of rows where the smoothed classifier abstained (``predict == -1``)."""
    _require_rows(table)
    return float(np.mean(table.predict == _ABSTAIN))


def mean_time(table: CertificationTable) -> float:
    """Mean wall-clock seconds per certified image."""
    _require_rows(table)
    return float(np.mean(table.time))


@dataclass(frozen=True)
class Summary:
    """Headline numbers of one run. Fractions in [0, 1]; ``acr`` in input units; ``mean_time`` in seconds."""

    n: int
    clean_accuracy: float
    acr: float
    abstention_rate: float
    mean_time: float


def summarize(table: CertificationTable) -> Summary:
    """Row count, clean accuracy, ACR, abstention rate and mean time per image of one run."""
    return Summary(n=_require_rows(table), clean_accuracy=clean_accuracy(table), acr=acr(table),
                   abstention_rate=abstention_rate(table), mean_time=mean_time(table))


# --------------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------------

def _check_named(named_tables: Mapping[str, CertificationTable]) -> list[tuple[str, CertificationTable]]:
    items = list(named_tables.items())
    if not items:
        raise ValueError("no runs to tabulate")
    return items


def _cells(named_tables: Mapping[str, CertificationTable], radii: Sequence[float]
           ) -> tuple[list[str], list[list[str]], list[list[bool]]]:
    """Run names, formatted cells (accuracy % to 0.1 then ACR to 0.001) and which cells are a column's best.

    Best is decided on the displayed (rounded) values among the certificate runs over the same inputs (the same
    ``idx`` set, :func:`input_sets`: statistics of different inputs are not ranked), so ties all show in bold; an
    estimate run is never bold (its values are not certified); where fewer than two certificate runs share their
    inputs nothing is bold (there is nothing to compare).
    """
    items = _check_named(named_tables)
    names = [name for name, _ in items]
    cells = []
    for _, table in items:
        accuracy = np.atleast_1d(certified_accuracy(table, np.asarray(radii, dtype=np.float64)))
        cells.append([f"{100 * a:.1f}" for a in accuracy] + [f"{acr(table):.3f}"])
    bold = [[False] * (len(radii) + 1) for _ in items]
    for same_inputs in input_sets(dict(items)):
        ranked = [names.index(name) for name in same_inputs if not named_tables[name].is_estimate]
        for column in range(len(radii) + 1) if len(ranked) > 1 else ():
            best = max(float(cells[i][column]) for i in ranked)
            for i in ranked:
                bold[i][column] = float(cells[i][column]) == best
    return names, cells, bold


def input_sets(named_tables: Mapping[str, CertificationTable]) -> list[list[str]]:
    """The runs' names grouped by the inputs they hold (their ``idx`` sets), in order of first appearance."""
    sets: dict[frozenset, list[str]] = {}
    for name, table in named_tables.items():
        sets.setdefault(frozenset(table.idx.tolist()), []).append(name)
    return list(sets.values())


def input_sets_note(named_tables: Mapping[str, CertificationTable]) -> str | None:
    """"Runs over different inputs: …" naming each set's runs and input count, when the runs hold more than one set."""
    sets = input_sets(named_tables)
    if len(sets) < 2:
        return None
    described = [f"{', '.join(names)} ({len(named_tables[names[0]])} inputs)" for names in sets]
    return f"Runs over different inputs, ranked only among runs over the same inputs: {'; '.join(described)}."


def recorded_sigma(table: CertificationTable) -> float | None:
    """The σ the run's sidecar records (``OUTFILE.json``), or ``None`` (no sidecar, Cohen's files)."""
    sigma = _sidecar_settings(table.path).get("sigma")
    return float(sigma) if isinstance(sigma, (int, float)) and not isinstance(sigma, bool) else None


def _markdown_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(named_tables: Mapping[str, CertificationTable], radii: Iterable[float]) -> str:
    """Markdown table: one line per run, certified accuracy (%) at each radius (input units), then ACR.

    The best value of each column among the certificate runs over the same inputs is bold (``**60.0**``); ties are
    all bold; estimate runs (``--protocol paper|published-code``) are never bold; a single run has no bold. Runs over
    different inputs get a line under the table that names each set (:func:`input_sets_note`).
    """
    radii = [float(r) for r in radii]
    names, cells, bold = _cells(named_tables, radii)
    head = "| run | " + " | ".join(f"r={r:g}" for r in radii) + (" | " if radii else "") + "ACR |"
    lines = [head, "|---" + "|---:" * (len(radii) + 1) + "|"]
    for name, row_cells, row_bold in zip(names, cells, bold):
        shown = [f"**{c}**" if b else c for c, b in zip(row_cells, row_bold)]
        lines.append(f"| {_markdown_escape(name)} | " + " | ".join(shown) + " |")
    note = input_sets_note(named_tables)
    return "\n".join(lines + ([] if note is None else ["", _markdown_escape(note)])) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
# pdflatex has no glyphs for Greek or math symbols in text (run names such as "RS (σ=0.25)"): emit math mode.
_LATEX_SPECIAL.update({ch: rf"$\{name}$" for ch, name in zip(
    "αβγδεζηθικλμνξπρστυφχψωΓΔΘΛΞΠΣΦΨΩ",
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau upsilon phi chi psi "
    "omega Gamma Delta Theta Lambda Xi Pi Sigma Phi Psi Omega".split())})
_LATEX_SPECIAL.update({"≥": r"$\geq$", "≤": r"$\leq$", "×": r"$\times$", "→": r"$\to$", "·": r"$\cdot$",
                       "∞": r"$\infty$", "−": "-", "√": r"$\surd$"})


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex_table(named_tables: Mapping[str, CertificationTable], radii: Iterable[float]) -> str:
    """LaTeX ``tabular`` (needs ``\\usepackage{booktabs}``) with the same content as :func:`markdown_table`.

    Certified accuracy (%) at each l2 radius (input units), then ACR; the best of each column is
    ``\\textbf``; run names are escaped. The result can be ``\\input`` inside a ``table`` environment.
    """
    radii = [float(r) for r in radii]
    names, cells, bold = _cells(named_tables, radii)
    k = len(radii)
    lines = [
        "% certified accuracy (%) at l2 radius r (input units) and average certified radius (ACR)",
        r"\begin{tabular}{l" + "r" * (k + 1) + "}",
        r"\toprule",
    ]
    if k:
        lines.append(r" & \multicolumn{" + str(k) + r"}{c}{certified accuracy (\%) at radius $r$} & \\")
        lines.append(r"\cmidrule(lr){2-" + str(k + 1) + "}")
        lines.append("run & " + " & ".join(f"${r:g}$" for r in radii) + r" & ACR \\")
    else:
        lines.append(r"run & ACR \\")
    lines.append(r"\midrule")
    for name, row_cells, row_bold in zip(names, cells, bold):
        shown = [rf"\textbf{{{c}}}" if b else c for c, b in zip(row_cells, row_bold)]
        lines.append(_latex_escape(name) + " & " + " & ".join(shown) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def summary_markdown_table(named_tables: Mapping[str, CertificationTable]) -> str:
    """Markdown table of :func:`summarize` per run: σ (from the sidecar, — where none is recorded), images, clean
    accuracy %, abstentions %, ACR, s/image."""
    lines = ["| run | σ | images | clean acc. (%) | abstain (%) | ACR | time/image (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, table in _check_named(named_tables):
        s, sigma = summarize(table), recorded_sigma(table)
        lines.append(f"| {_markdown_escape(name)} | {'—' if sigma is None else f'{sigma:g}'} | {s.n} | "
                     f"{100 * s.clean_accuracy:.1f} | "
                     f"{100 * s.abstention_rate:.1f} | {s.acr:.3f} | {s.mean_time:.2f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------
# Runs by name
# --------------------------------------------------------------------------------------------------------------

RunsArg = Union[Sequence[PathLike], Mapping[str, Union[PathLike, CertificationTable]]]


def _run_names(paths: Sequence[PathLike]) -> list[str]:
    """File stems, or the full paths when two stems coincide."""
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [os.fspath(p) for p in paths]


def load_runs(paths_or_named: RunsArg) -> dict[str, CertificationTable]:
    """``{name: table}`` from a list of paths (named by file stem) or a mapping name -> path or table."""
    if isinstance(paths_or_named, (str, os.PathLike)):
        paths_or_named = [paths_or_named]
    if isinstance(paths_or_named, Mapping):
        named = dict(paths_or_named)
    else:
        paths = list(paths_or_named)
        resolved = [Path(p).resolve() for p in paths]
        repeated = next((p for p, r in zip(paths, resolved) if resolved.count(r) > 1), None)
        if repeated is not None:  # the names would collide and one run would silently be left out
            raise ValueError(f"{os.fspath(repeated)} is given more than once; give each run once")
        named = dict(zip(_run_names(paths), paths))
    if not named:
        raise ValueError("no result files given")
    tables = {name: value if isinstance(value, CertificationTable) else read_certification(value)
              for name, value in named.items()}
    return {labelled(name, table): table for name, table in tables.items()}


#: A run whose smoothed classifier answers one class for at least this share of its inputs is flagged as (nearly)
#: constant: a constant classifier is certifiably robust everywhere, so its "certified accuracy" is the share of that
#: class in the data, not robustness anyone wants (it can look good at large radii).
CONSTANT_SHARE = 0.95
#: Runs with fewer rows are not judged.
CONSTANT_MIN_ROWS = 10


def constant_prediction(table: CertificationTable) -> tuple[int, float] | None:
    """``(class, share of all rows)`` when the smoothed classifier predicts one class for at least
    :data:`CONSTANT_SHARE` of the rows (abstentions count against it), else ``None``."""
    if len(table) < CONSTANT_MIN_ROWS:
        return None
    predicted = table.predict[table.predict != _ABSTAIN]
    if predicted.size == 0:
        return None
    classes, counts = np.unique(predicted, return_counts=True)
    share = float(counts.max()) / len(table)
    return (int(classes[counts.argmax()]), share) if share >= CONSTANT_SHARE else None


def constant_note(table: CertificationTable) -> str | None:
    """"predicts class 1 for 100 % of inputs" for a (nearly) constant run (:func:`constant_prediction`), else None."""
    found = constant_prediction(table)
    return None if found is None else f"predicts class {found[0]} for {100 * found[1]:.0f} % of inputs"


def unfinished_note(table: CertificationTable) -> str | None:
    """"unfinished: 10 of 30 inputs" when the run's sidecar selects more inputs than the file has rows (a run
    stopped before its end: its statistics are those of the inputs it reached), else None."""
    planned = table.planned_inputs
    return f"unfinished: {len(table)} of {planned} inputs" if planned is not None and len(table) < planned else None


def labelled(name: str, table: CertificationTable) -> str:
    """``name``, marked "(not a certificate)" when ``table`` holds an estimate protocol's radii, with
    :func:`constant_note` when its smoothed classifier is (nearly) constant, and with :func:`unfinished_note` when
    the run stopped before its end."""
    marks = [NOT_A_CERTIFICATE] if table.is_estimate else []
    marks += [note for note in (constant_note(table), unfinished_note(table)) if note]
    marks = [mark for mark in marks if mark not in name]
    return f"{name} ({'; '.join(marks)})" if marks else name


__all__ = [
    "DEFAULT_RADII",
    "CertificationTable",
    "IncompleteLastLineWarning",
    "Summary",
    "abstention_rate",
    "acr",
    "certified_accuracy",
    "clean_accuracy",
    "constant_prediction",
    "input_sets",
    "input_sets_note",
    "latex_table",
    "load_runs",
    "markdown_table",
    "mean_time",
    "read_certification",
    "recorded_sigma",
    "summarize",
    "summary_markdown_table",
    "unfinished_note",
]
