"""The ``splitz`` command (:mod:`.main`), one file per command family with its parsers: :mod:`.demo`, :mod:`.train`,
:mod:`.certify` (certify, predict, certify-margin, attack, merge), :mod:`.analyze` (analyze, diagnose, envelope);
what several share: :mod:`.options`.

``splitz_fast.cli`` was one module before 0.2: its names are handed on here, each imported when first read, so that
``splitz --help`` (which imports this package first) loads no more than the parser."""
import importlib

from .._moved import folded_attribute

#: name -> the module of this package that defines it
_WHERE = {
    "DEMO_RADII": "options", "train_command": "train", "HELD_OUT_SPLIT": "choices",  # demo: the module (.demo.demo)
    **dict.fromkeys(("certify_command", "certify_margin_command", "predict_command", "attack_command",
                     "merge_command"), "certify"),
    **dict.fromkeys(("analyze_command", "diagnose_command", "envelope_command"), "analyze"),
    **dict.fromkeys(("RANK_ERROR_EXIT_DELAY", "build_parser", "main"), "main"),
}

__all__ = [
    "DEMO_RADII", "demo", "train_command", "HELD_OUT_SPLIT", "certify_command", "certify_margin_command",
    "predict_command", "attack_command", "merge_command", "analyze_command", "diagnose_command", "envelope_command",
    "RANK_ERROR_EXIT_DELAY", "build_parser", "main",
]


def __getattr__(name: str):
    """The names of :data:`__all__` from their modules; other names of the 0.1 module ``splitz_fast.cli``, with a
    warning naming their module now."""
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    return folded_attribute(__name__, name)
