"""The ``splitz`` command (:mod:`.main`), one file per command family with its parsers: :mod:`.demo`, :mod:`.train`,
:mod:`.certify` (certify, predict, certify-margin, attack, merge), :mod:`.analyze` (analyze, diagnose, envelope);
what several share: :mod:`.options`.

``splitz_fast.cli`` was one module before 0.2: its names are handed on here. Every module of this package imports
neither torch nor scipy at its top (the commands import what they run), so ``splitz --help`` stays light."""
from .._moved import folded_attribute
from .options import DEMO_RADII
from .demo import demo
from .train import train_command
from .choices import HELD_OUT_SPLIT
from .certify import certify_command, certify_margin_command, predict_command, attack_command, merge_command
from .analyze import analyze_command, diagnose_command, envelope_command
from .main import RANK_ERROR_EXIT_DELAY, build_parser, main

__all__ = [
    "DEMO_RADII", "demo", "train_command", "HELD_OUT_SPLIT", "certify_command", "certify_margin_command",
    "predict_command", "attack_command", "merge_command", "analyze_command", "diagnose_command", "envelope_command",
    "RANK_ERROR_EXIT_DELAY", "build_parser", "main",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.cli``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
