"""The tree keeps the shape docs/layout.md draws: one folder per stage of the data flow, imports only downward in the
stage order (no import that points back up, no circle), the sound side (``bounds/``) and the fast side
(``sampling/``) never importing each other, and no file longer than a reader takes in one sitting."""
from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "splitz_fast"

# Stages, bottom to top: a module may import its own stage's modules and those of lower levels. Siblings on one level
# (bounds and sampling above all) never import each other.
LEVELS = [
    {"_checks", "cuda_math", "_moved", "kinds"},
    {"kernels", "data"},
    {"model"},
    {"zoo", "bounds", "sampling"},
    {"certify", "checkpoints"},
    {"training"},
    {"runs"},
    {"analysis"},
    {"__init__"},
    {"cli"},
    {"__main__"},
]
LEVEL = {stage: level for level, stages in enumerate(LEVELS) for stage in stages}
MAX_FILE_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name; ``kernels/`` (shipped as ``splitz_fast.kernels``) included."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(("splitz_fast", *parts)).removesuffix(".__init__")] = path
    for path in (ROOT / "kernels").glob("*.py"):
        found[f"splitz_fast.kernels.{path.stem}".removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its file (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _stage(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down_the_stage_order():
    graph = _graph()
    unplaced = sorted({_stage(m) for m in graph} - set(LEVEL))
    assert not unplaced, f"place these in LEVELS (and docs/layout.md): {unplaced}"
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if _stage(a) != _stage(b) and LEVEL[_stage(b)] >= LEVEL[_stage(a)]]
    assert not upward, upward


def test_no_import_circle():
    graph = _graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            # a package's face importing its own modules is not a circle with them
            if len(component) > 1 and not _face_only(component, graph):
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def _face_only(component: list[str], graph: dict[str, set[str]]) -> bool:
    """A circle that runs only through package faces (``__init__`` re-exports) and their own modules."""
    faces = {m for m in component if (_modules()[m].name == "__init__.py")}
    rest = [m for m in component if m not in faces]
    return bool(faces) and not any(b in rest for a in rest for b in graph[a])


def test_bounds_and_sampling_never_import_each_other():
    graph = _graph()
    crossing = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if {_stage(a), _stage(b)} == {"bounds", "sampling"}]
    assert not crossing, crossing


def test_no_file_is_longer_than_a_sitting():
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "kernels").glob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    long = sorted(f"{p.relative_to(ROOT)} ({n} lines)" for p in paths
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES)
    assert not long, long


@pytest.mark.parametrize("old", sorted(importlib.import_module("splitz_fast._moved").MOVED))
def test_an_old_module_path_still_imports_with_a_warning_naming_the_new_one(old):
    import sys

    import splitz_fast
    from splitz_fast._moved import new_paths

    paths = new_paths(old)
    new = [importlib.import_module(path) for path in paths]

    public = old in splitz_fast.__all__  # sz.attacks, sz.envelope, ...: public attributes of the new path, no warning

    def forget():  # the import system caches the old name twice: as a module and as the package's attribute
        sys.modules.pop(f"splitz_fast.{old}", None)
        vars(splitz_fast).pop(old, None)

    def check(module):
        if len(new) == 1:
            assert module is new[0]
        first = {}  # every public name of the new modules, from the first that defines it
        for part in new:
            first.update({k: v for k, v in vars(part).items() if not k.startswith("_") and k not in first})
        assert all(getattr(module, name) is value for name, value in first.items())

    warning = f"splitz_fast.{old} moved to {' and '.join(paths)}"
    forget()
    with pytest.warns(DeprecationWarning, match=warning):
        check(importlib.import_module(f"splitz_fast.{old}"))
    forget()
    if "." in old:
        return
    if public:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(splitz_fast, old) is new[0]
    else:  # a module directly under splitz_fast is also its attribute
        with pytest.warns(DeprecationWarning, match=warning):
            check(getattr(splitz_fast, old))
        forget()


def test_an_old_name_of_a_module_that_became_a_folder_still_resolves_with_a_warning():
    import splitz_fast.sampling as sampling
    from splitz_fast.sampling.engine import DEFAULT_MAX_BATCH

    with pytest.warns(DeprecationWarning, match="splitz_fast.sampling.DEFAULT_MAX_BATCH moved to "
                                                "splitz_fast.sampling.engine.DEFAULT_MAX_BATCH"):
        assert sampling.DEFAULT_MAX_BATCH is DEFAULT_MAX_BATCH
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        sampling.no_such_name


# The checks at the top of tests/ concern the whole repository, not one stage.
REPOSITORY_CHECKS = {"test_cifar_script", "test_cuda_math", "test_deprecations", "test_docs_site", "test_gpu_checks",
                     "test_gpu_stage_runner", "test_layout", "test_lint", "test_readme", "test_scripts", "test_smoke"}


def test_tests_mirror_the_stages():
    """Each test file sits in the folder of the stage it tests (tests/bounds/ for splitz_fast/bounds/, …), or at the
    top of tests/ when it checks the whole repository; no folder of tests names a stage that does not exist."""
    tests = ROOT / "tests"
    stages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    stages.add("kernels")
    folders = {path.name for path in tests.iterdir() if path.is_dir() and any(path.glob("test_*.py"))}
    assert folders <= stages, sorted(folders - stages)
    top = {path.stem for path in tests.glob("test_*.py")}
    assert top == REPOSITORY_CHECKS, (sorted(top - REPOSITORY_CHECKS), sorted(REPOSITORY_CHECKS - top))
    assert not list(tests.glob("*/*/test_*.py")), "one folder level per stage"


def test_docs_layout_names_every_module_in_its_folder():
    """docs/layout.md's tree lists every module of the package under its folder (a new file is placed there too)."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    tree = text[text.index("splitz_fast/\n"):]
    tree = tree[:tree.index("```")]
    folder, listed = "", set()
    for line in tree.splitlines()[1:]:
        name = line.strip().split(" ")[0]
        if line.startswith("  ") and not line.startswith("    ") and name:
            folder = name.rstrip("/") if name.endswith("/") else ""
            if not folder:
                listed.add(name)
        elif line.startswith("    ") and name.endswith((".py", "/")) and folder:
            listed.add(f"{folder}/{name}")
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" and len(path.relative_to(PACKAGE).parts) <= 2}
    modules |= {f"{path.parent.relative_to(PACKAGE)}/" for path in PACKAGE.glob("*/*/__init__.py")}
    assert modules <= listed, sorted(modules - listed)
