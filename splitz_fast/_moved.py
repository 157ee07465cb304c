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
import types
import warnings

# old path -> new path, under splitz_fast (removed in 0.3.0)
MOVED = {
    "modules": "model.modules",
    "models": "zoo.models",
    "datasets": "data.datasets",
    "operators": "bounds.operators",
    "gram": "bounds.gram",
    "lipschitz": ("bounds.lipschitz", "bounds.certificate", "bounds.eigen", "bounds.estimate"),
    "displacement": "bounds.displacement",
    "radius": "bounds.radius",
    "folding": "sampling.folding",
    "prepared": "sampling.prepared",
    "epilogues": "sampling.epilogues",
    "graphs": "sampling.graphs",
    "compiled": "sampling.compiled",
    "protocols": ("certify.protocols", "kinds"),
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
    "distributed": ("runs.torchrun", "training.parallel"),  # torchrun runs; data-parallel training
    "results": "runs.rows",
    "envelope": "analysis.envelope",
    "diagnostics": "analysis.diagnostics",
    "kernels.noise_votes": ("kernels.noise", "kernels.votes", "kernels.philox_reference"),
}


# folder that took the name of a 0.1 module -> the modules that define that module's names now. Its face hands on the
# public names; any other name of the old module is found here, with a warning naming where it lives.
FOLDED = {
    "bounds": ("bounds.intervals",),
    "sampling": ("sampling.engine",),
    "training": ("training.config", "training.loss", "training.batches", "training.loop", "training.parallel"),
    "runs": ("runs.loop", "runs.tasks", "runs.files", "runs.shards"),
    "checkpoints": ("checkpoints.splitz", "checkpoints.files"),
    "analysis": ("analysis.tables", "analysis.plots"),
    "cli": ("cli.main", "cli.options", "cli.demo", "cli.train", "cli.certify", "cli.analyze", "runs.dataset_run",
            "checkpoints.splitz"),
    "zoo": ("zoo.pretrained",),
    "data": ("data.packages",),
}


def folded_attribute(package: str, name: str):
    """``splitz_fast.<folder>.<name>`` for a name of the 0.1 module ``<folder>`` that the folder's face does not hand
    on (the module-level ``__getattr__`` of each face of :data:`FOLDED`): from the module that defines it now, with a
    ``DeprecationWarning`` naming it."""
    folder = package.removeprefix("splitz_fast.")
    if not name.startswith("__"):
        for path in FOLDED[folder]:
            module = importlib.import_module(f"splitz_fast.{path}")
            if name in vars(module):
                warnings.warn(f"{package}.{name} moved to splitz_fast.{path}.{name}; import it from there (the old "
                              "path goes in 0.3.0)", DeprecationWarning, stacklevel=3)
                return vars(module)[name]
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def new_paths(old: str) -> tuple[str, ...]:
    """Where the names of ``splitz_fast.<old>`` live now (one module, or several where the old one held two jobs)."""
    moved = MOVED[old]
    return tuple(f"splitz_fast.{path}" for path in ((moved,) if isinstance(moved, str) else moved))


def moved_module(old: str) -> types.ModuleType:
    """The module that ``splitz_fast.<old>`` became, imported, with the deprecation warning; where it became several,
    a module that hands on the names of all of them."""
    paths = new_paths(old)
    warnings.warn(f"splitz_fast.{old} moved to {' and '.join(paths)}; import it from there (the old path goes in "
                  "0.3.0)", DeprecationWarning, stacklevel=3)
    modules = [importlib.import_module(path) for path in paths]
    if len(modules) == 1:
        return modules[0]
    joined = types.ModuleType(f"splitz_fast.{old}", f"Names of {' and '.join(paths)} (the 0.1 path).")
    for module in reversed(modules):  # the first path wins a name both define
        vars(joined).update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return joined


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
