"""The ``splitz`` command (:mod:`.main`).

``splitz_fast.cli`` was one module before 0.2: its names are handed on here."""
from .main import (
    DEMO_RADII, demo, train_command, HELD_OUT_SPLIT, certify_command, certify_margin_command, predict_command,
    attack_command, merge_command, analyze_command, diagnose_command, envelope_command, RANK_ERROR_EXIT_DELAY,
    build_parser, main
                   )

__all__ = [
    "DEMO_RADII", "demo", "train_command", "HELD_OUT_SPLIT", "certify_command", "certify_margin_command",
    "predict_command", "attack_command", "merge_command", "analyze_command", "diagnose_command", "envelope_command",
    "RANK_ERROR_EXIT_DELAY", "build_parser", "main",
]
