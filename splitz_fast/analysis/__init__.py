"""Analysis of run files: certified accuracy, ACR, tables and plots (:mod:`.tables`), envelopes (:mod:`.envelope`) and
diagnostics (:mod:`.diagnostics`).

``splitz_fast.analysis`` was one module before 0.2: its names are handed on here."""
from .tables import (
    DEFAULT_RADII, CertificationTable, Summary, abstention_rate, acr, analyze, certified_accuracy,
    certified_accuracy_curve, clean_accuracy, constant_prediction, latex_table, load_runs, markdown_table,
    mean_time, plot_certified_accuracy, read_certification, run_protocol, summarize, summary_markdown_table,
    unfinished_note
                     )

__all__ = [
    "DEFAULT_RADII", "CertificationTable", "Summary", "abstention_rate", "acr", "analyze", "certified_accuracy",
    "certified_accuracy_curve", "clean_accuracy", "constant_prediction", "latex_table", "load_runs", "markdown_table",
    "mean_time", "plot_certified_accuracy", "read_certification", "run_protocol", "summarize",
    "summary_markdown_table", "unfinished_note",
]
