"""``splitz analyze``, ``diagnose`` and ``envelope``: tables, plots and diagnostics from certification TSVs, each
command beside its parser."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from pathlib import Path

from .options import DEMO_RADII, _HelpFormatter, _add_threads_option


@contextlib.contextmanager
def incomplete_lines_on_stderr():
    """The reader's note that a TSV's torn last line was left out (:class:`~splitz_fast.analysis.tables.
    IncompleteLastLineWarning`), shown as its one line on stderr; other warnings as before."""
    from ..analysis.tables import IncompleteLastLineWarning

    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, IncompleteLastLineWarning):
            print(f"note: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", IncompleteLastLineWarning)  # each file says it
        warnings.showwarning = shown
        yield


@incomplete_lines_on_stderr()
def analyze_command(args: argparse.Namespace) -> int:
    from ..analysis.plots import analyze

    if args.names and len(args.names) != len(args.files):
        raise ValueError(f"--names gives {len(args.names)} names for {len(args.files)} files")
    if args.names and len(set(args.names)) != len(args.names):
        raise ValueError(f"--names gives a name twice ({', '.join(args.names)}): one name per run")
    runs = dict(zip(args.names, args.files)) if args.names else list(args.files)
    print(analyze(runs, args.radii, out_dir=args.out))
    return 0


def diagnose_command(args: argparse.Namespace) -> int:
    from .._checks import read_settings_file
    from ..analysis.tables import read_certification
    from ..analysis.diagnostics import diagnose, diagnostics_report
    from ..checkpoints.splitz import checkpoint_digest
    from ..runs.dataset_run import load_model_and_dataset

    if args.radii is not None and not args.headroom:
        raise ValueError("--radii is read only with --headroom; add --headroom or leave --radii out")
    if args.radii is None:
        from ..analysis.headroom import DEFAULT_HEADROOM_RADII
        args.radii = list(DEFAULT_HEADROOM_RADII)
    if any(not math.isfinite(r) or r < 0 for r in args.radii):
        raise ValueError(f"--radii must be finite and >= 0, got {' '.join(f'{r:g}' for r in args.radii)}")
    table = read_certification(args.certification)  # first: a missing TSV is named as such, not as a missing sidecar
    try:
        sidecar = read_settings_file(args.certification + ".json")
    except ValueError as err:
        raise ValueError(f"{args.certification}: its sidecar {err}; diagnose needs the one `splitz certify` wrote "
                         "(it records which images were certified)") from None
    missing = [key for key in ("dataset", "split", "sigma") if key not in sidecar]
    if missing:
        raise ValueError(f"{args.certification}: its sidecar records no {', '.join(missing)}; diagnose reads a "
                         "`splitz certify` run")
    args.dataset, args.split = sidecar["dataset"], sidecar["split"]
    args.checkpoint_format = sidecar.get("checkpoint_format", "splitz")
    # A MACER checkpoint is read behind the input normalisation its run recorded (the file itself records none).
    normalization = sidecar.get("input_normalization")
    model, ckpt, info = load_model_and_dataset(args.checkpoint, args.dataset, args.split, device=args.device,
                                               root=args.root, checkpoint_format=args.checkpoint_format,
                                               input_normalization=normalization)
    if checkpoint_digest(ckpt) != sidecar.get("checkpoint_digest"):
        raise ValueError(f"{args.certification} was certified with another model than {args.checkpoint} "
                         "(checkpoint digests differ); give the checkpoint that was certified")
    behind = "" if normalization is None else f", input normalisation {normalization}"
    title = f"{Path(args.certification).stem} (σ = {sidecar['sigma']:g}{behind})"
    if args.headroom:
        from ..analysis.headroom import headroom_of_run, headroom_report

        result = headroom_of_run(model, info.dataset, table, sidecar["sigma"], args.radii)
        print(headroom_report(result, title, out_dir=args.out))
        return 0
    print(diagnostics_report(diagnose(model, info.dataset, table, progress=True), title, out_dir=args.out))
    return 0


@incomplete_lines_on_stderr()
def envelope_command(args: argparse.Namespace) -> int:
    from ..analysis.envelope import MNIST_REFERENCES, envelope_report, load_group

    groups = {}
    for name, *files in args.group:
        if not files:
            raise ValueError(f"--group {name} names no certification files; give NAME FILE [FILE ...]")
        if name in groups:
            raise ValueError(f"--group {name} is given twice; give each method's files once")
        groups[name] = load_group(files, name=f"--group {name}")
    references = MNIST_REFERENCES if args.references == "mnist" else ()
    print(envelope_report(groups, args.radii, references, out_dir=args.out))
    return 0


def _add_analyze_parser(sub) -> None:
    """``splitz analyze``: tables and plots from certify TSVs."""
    a = sub.add_parser("analyze", help="certified accuracy / ACR tables and plots from certify TSVs (bold: a column's "
                                       "best among the runs over the same inputs)",
                       formatter_class=_HelpFormatter)
    a.add_argument("files", nargs="+", help="certification TSVs (Cohen's six columns first); a torn last line (a run "
                                            "still writing, or killed) is left out, with a note on stderr")
    a.add_argument("--names", nargs="+", default=None, help="one display name per file; file names when omitted")
    a.add_argument("--radii", type=float, nargs="+", default=DEMO_RADII,
                   help="l2 radii (input units, >= 0) at which to report certified accuracy")
    a.add_argument("--out", default=None, help="folder for table.md, table.tex and the plot (PNG and PDF)")
    a.set_defaults(func=analyze_command)


def _add_diagnose_parser(sub) -> None:
    """``splitz diagnose``: what explains a SPLITZ model's certificates."""
    x = sub.add_parser("diagnose", help="what explains a SPLITZ model's certificates: L(x, γ*), p_A and the neurons "
                                        "of f_L constant on the ball, per certified input", formatter_class=_HelpFormatter)
    x.add_argument("checkpoint", help="the checkpoint that was certified")
    x.add_argument("certification", help="its SPLITZ certify TSV (dataset and split are read from the sidecar)")
    x.add_argument("--root", default=None, help="dataset folder (CIFAR-10, ImageNet, torchvision MNIST)")
    x.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N where a GPU is present")
    x.add_argument("--out", default=None, help="folder for diagnostics.md/.tsv and the histograms (with --headroom: "
                                               "headroom.md/.tsv)")
    x.add_argument("--headroom", action="store_true",
                   help="instead: per input, the bound on the cell-exit probability e_s, L̄/L(x, 0⁺) and the best case "
                        "of SPLITZ against randomized smoothing of an equivalent base classifier (docs/splitz-vs-rs.md)")
    x.add_argument("--radii", type=float, nargs="+", default=None,
                   help="with --headroom: l2 radii ε (input units) of the table (default 0.5 1 1.5 2)")
    _add_threads_option(x)
    x.set_defaults(func=diagnose_command)


def _add_envelope_parser(sub) -> None:
    """``splitz envelope``: best-σ envelopes of methods."""
    e = sub.add_parser("envelope", help="best-σ envelopes of methods (one certify TSV per σ) with reference lines",
                       formatter_class=_HelpFormatter)
    e.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "FILE"),
                   help="a method's name, then its certification TSVs, one per σ (σ read from each sidecar), all over "
                        "the same inputs (a group whose runs hold different inputs is refused: the best σ must be "
                        "chosen on one test set); repeat for each method; same-σ differences are second group − "
                        "first")
    e.add_argument("--radii", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 2.0, 2.5],
                   help="l2 radii ε (input units) of the table")
    e.add_argument("--references", choices=("mnist", "none"), default="none",
                   help="published lines to show: mnist = the literature's RS envelope and best trained RS (LeNet, "
                        "n = 10⁵, full test set)")
    e.add_argument("--out", default=None, help="folder for envelope.md and envelope.png/.pdf")
    e.set_defaults(func=envelope_command)
