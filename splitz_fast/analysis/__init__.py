"""Analysis of run files: certified accuracy, ACR and tables (:mod:`.tables`), plots and ``analyze`` (:mod:`.plots`),
envelopes (:mod:`.envelope`), diagnostics (:mod:`.diagnostics`) and SPLITZ's headroom over randomized smoothing
(:mod:`.headroom`: ``sz.headroom``).

``splitz_fast.analysis`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .plots import analyze, certified_accuracy_curve, plot_certified_accuracy, run_protocol
from .tables import (
    DEFAULT_RADII, CertificationTable, Summary, abstention_rate, acr, certified_accuracy, clean_accuracy,
    constant_prediction, latex_table, load_runs, markdown_table, mean_time, read_certification, summarize,
    summary_markdown_table, unfinished_note
)

__all__ = [
    "DEFAULT_RADII", "CertificationTable", "Summary", "abstention_rate", "acr", "analyze", "certified_accuracy",
    "certified_accuracy_curve", "clean_accuracy", "constant_prediction", "latex_table", "load_runs", "markdown_table",
    "mean_time", "plot_certified_accuracy", "read_certification", "run_protocol", "summarize",
    "summary_markdown_table", "unfinished_note",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.analysis``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
