"""The module paths of 0.1 that moved into the stage folders of 0.2: importing one still works, for one minor version,
with a ``DeprecationWarning`` that names the new path (``import splitz_fast.smoothing`` gives
``splitz_fast.certify.smoothing`` itself). Paths that became a folder of the same name (``splitz_fast.bounds``,
``.sampling``, ``.training``, ``.runs``, ``.checkpoints``, ``.analysis``, ``.cli``, ``.zoo``, ``.data``) need no alias:
each folder's ``__init__`` hands on the names the module had."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old path -> new path, under splitz_fast (removed in 0.3.0)
MOVED = {
    "modules": "model.modules",
    "models": "zoo.models",
    "datasets": "data.datasets",
    "operators": "bounds.operators",
    "gram": "bounds.gram",
    "lipschitz": "bounds.lipschitz",
    "displacement": "bounds.displacement",
    "radius": "bounds.radius",
    "folding": "sampling.folding",
    "prepared": "sampling.prepared",
    "epilogues": "sampling.epilogues",
    "graphs": "sampling.graphs",
    "compiled": "sampling.compiled",
    "protocols": "certify.protocols",
    "smoothing": "certify.smoothing",
    "windows": "certify.windows",
    "inputs": "certify.inputs",
    "outcomes": "certify.outcomes",
    "stats": "certify.stats",
    "margin": "certify.margin",
    "sequential": "certify.sequential",
    "attacks": "certify.attacks",
    "cohen": "checkpoints.cohen",
    "recipes": "training.recipes",
    "distributed": "runs.torchrun",
    "results": "runs.rows",
    "envelope": "analysis.envelope",
    "diagnostics": "analysis.diagnostics",
}


def moved_module(old: str):
    """The module that ``splitz_fast.<old>`` became, imported, with the deprecation warning."""
    new = f"splitz_fast.{MOVED[old]}"
    warnings.warn(f"splitz_fast.{old} moved to {new}; import it from there (the old path goes in 0.3.0)",
                  DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str):
        self.old = old

    def create_module(self, spec):
        return moved_module(self.old)

    def exec_module(self, module) -> None:
        """The module was executed under its new name."""


class MovedPathFinder(importlib.abc.MetaPathFinder):
    """Finds ``splitz_fast.<old>`` for every old path of :data:`MOVED` (installed by ``splitz_fast/__init__.py``)."""

    def find_spec(self, fullname: str, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix == "splitz_fast" and old in MOVED:
            return importlib.util.spec_from_loader(fullname, _MovedLoader(old))
        return None


def install() -> None:
    if not any(isinstance(finder, MovedPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedPathFinder())
