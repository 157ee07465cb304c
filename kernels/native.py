"""Build and load the native (C++) kernels of ``csrc/``, the ``native`` backend of :func:`splitz_fast.kernels.select_backend`.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja), cached per source digest,
torch version and compiler flags under torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), so a later process only loads it — straight from the cache (:func:`load_built`),
without importing ``torch.utils.cpp_extension``, whose import alone prints torch's "No CUDA runtime is found" warning
on machines with a CUDA toolkit but no GPU. ``make install`` builds it ahead of time
(``python -m splitz_fast.kernels.native``). Where it cannot be built (no C++ compiler, no ninja, a failing build) the
loader warns once, says why and how to fix it, and returns ``None``: every op then runs its PyTorch reference, which
follows the same contract (the noise stream included), so results do not depend on whether a compiler was found —
only speed does. ``SPLITZ_NATIVE=0`` turns the extension off without a warning.

Ops: ``noisy_latents`` (CPU; csrc/noise_cpu.cpp, contract in csrc/philox.h and kernels/noise.py) and
``philox_words`` (the integer half of the stream, for tests) in the noise module (:func:`native_module`); the training
step's ops in a second module built from csrc/train_cpu.cpp (:func:`train_module`): ``conv_power`` (the masked
convolution Gram step and norm of the Lipschitz estimate, kernels/conv_power.py), ``clip_mask`` (the first layer's
clipped ReLU and varying mask, kernels/clip_mask.py) and ``train_noise`` (the training noise,
kernels/train_noise.py); and ``conv_relu_maxpool2`` (a thin first convolution of ``f_R`` with its ReLU and 2x2 max
pool, kernels/conv_relu_pool.py) in a third, built from csrc/conv_pool_cpu.cpp (:func:`conv_module`). One module per
family, because ``load`` builds one module (one ``PYBIND11_MODULE``) per list of sources: each family keeps its own
binding list, and a build failure in one leaves the others usable.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch._appdirs  # where torch's extension cache lives (cpp_extension reads it the same way)

NATIVE_ENV = "SPLITZ_NATIVE"
SOURCES = ("noise_cpu.cpp",)
HEADERS = ("philox.h", "philox_cpu.h")
TRAIN_SOURCES = ("train_cpu.cpp",)  # the training step's module (train_module)
CONV_SOURCES = ("conv_pool_cpu.cpp",)  # f_R's fused convolution + ReLU + pool (conv_module)
# Ops with a native CPU kernel, and the sources of the module that holds each.
OP_SOURCES: dict[str, tuple[str, ...]] = {"noisy_latents": SOURCES, "noisy_latents_maxpool2": SOURCES,
                                          "conv_power": TRAIN_SOURCES,
                                          "train_noise": TRAIN_SOURCES, "clip_mask": TRAIN_SOURCES,
                                          "conv_relu_maxpool2": CONV_SOURCES}
NATIVE_OPS: frozenset[str] = frozenset(OP_SOURCES)
# -ffp-contract=off: no FMA contraction, so the float32 roundings are the ones the contract writes down;
# -fno-math-errno: sqrtf without errno, so the loops vectorise; target_clones in the source picks the ISA at load time.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Per module, where they differ: the convolution's sums may contract to FMA (it has no bitwise contract: its result is
# checked against the unfused layers within their rounding, as oneDNN's own FMA sums are), which doubles its rate.
MODULE_CFLAGS: dict[tuple[str, ...], tuple[str, ...]] = {CONV_SOURCES: ("-O3", "-ffp-contract=fast", "-fno-math-errno",
                                                                        "-fopenmp")}


def csrc_dir() -> Path:
    """The C++/CUDA sources: ``csrc/`` of the source tree (editable installs), else the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"splitz_fast's C++ sources ({SOURCES[0]}) are neither in {here.parent / 'csrc'} nor in "
                            f"{here / 'csrc'}")


def _build_name(directory: Path, sources: tuple[str, ...] = SOURCES) -> str:
    digest = hashlib.sha256()
    for name in sources + HEADERS:
        digest.update((directory / name).read_bytes())
    digest.update(" ".join(_cflags(sources) + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    # The source folder too: torch rebuilds a named extension whose include paths changed, so two checkouts sharing
    # one name would rebuild each other's build at every switch (seen: a 33 s rebuild in the first training step).
    digest.update(str(directory.resolve()).encode())
    prefix = "splitz_fast_native" if sources == SOURCES else f"splitz_fast_{Path(sources[0]).stem}"
    return f"{prefix}_{digest.hexdigest()[:16]}"


@functools.cache
def native_module() -> ModuleType | None:
    """The compiled noise extension (csrc/noise_cpu.cpp), built if needed; ``None`` (after one warning) where it
    cannot be built, or when ``SPLITZ_NATIVE=0``."""
    return _load(SOURCES)


@functools.cache
def train_module() -> ModuleType | None:
    """The compiled training-step extension (csrc/train_cpu.cpp), built if needed; ``None`` (after one warning) where
    it cannot be built, or when ``SPLITZ_NATIVE=0``."""
    return _load(TRAIN_SOURCES)


@functools.cache
def conv_module() -> ModuleType | None:
    """The compiled convolution + ReLU + pool extension (csrc/conv_pool_cpu.cpp), built if needed; ``None`` (after one
    warning) where it cannot be built, or when ``SPLITZ_NATIVE=0``."""
    return _load(CONV_SOURCES)


_MODULE_OF_SOURCES = {SOURCES: native_module, TRAIN_SOURCES: train_module, CONV_SOURCES: conv_module}


def _cflags(sources: tuple[str, ...]) -> tuple[str, ...]:
    return MODULE_CFLAGS.get(sources, CFLAGS)


def extensions_root() -> Path:
    """torch's extension cache for this Python and torch build, as ``torch.utils.cpp_extension`` lays it out
    (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py311_cu130`` and the like), found without importing
    that module."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    base = Path(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")))
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    return base / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"


def load_built(name: str) -> ModuleType | None:
    """The extension ``name`` imported from a finished build in torch's cache, or ``None`` when there is none (never
    built, a build in progress, the file does not import): then ``cpp_extension.load`` builds or waits. ``name``
    digests the sources, flags and torch version (:func:`_build_name`), so a finished build of that name is the build
    ``load`` would make.

    A build in progress is told by the cache folder's ``lock`` file without ever creating it, because torch's builders
    read that file two ways: newer ones hold an OS lock on it while they build (the file stays afterwards), older ones
    (torch 2.11) create it to build and delete it when done, so to them a file left behind means "being built" and
    they wait for it forever. Here the file, where it exists, is opened read-only and locked shared (``flock``) while
    the module is imported: a newer builder's exclusive lock makes that fail (``None``), and a builder cannot start
    replacing the library mid-import. Several processes load at once without excluding each other."""
    directory = extensions_root() / name
    library = directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    if not library.is_file():
        return None
    try:
        with _shared_build_lock(directory / "lock"):
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except Exception:  # being built (the lock is held), no flock (Windows), a damaged file: the builder decides
        return None
    return module


@contextlib.contextmanager
def _shared_build_lock(lock: Path):
    """Hold a shared ``flock`` on ``lock`` if the file exists (raises ``BlockingIOError`` while a builder holds it);
    never creates the file."""
    import fcntl  # POSIX only: elsewhere ImportError, and load_built leaves it to the builder

    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)  # releases the lock


def builder(name: str):
    """``torch.utils.cpp_extension.load``, imported only now that something is built (its import prints torch's "No
    CUDA runtime" warning on machines without a GPU). Where torch's builder is the older kind (torch 2.11) and the
    cache folder of ``name`` holds a ``lock`` file, it warns first, naming the file: that builder waits, without a
    word and for as long as the file exists, for whoever made it — another process building now, or a build that was
    killed (Ctrl-C during the first build), whose file is never removed."""
    from torch.utils import cpp_extension

    lock = extensions_root() / name / "lock"
    if hasattr(cpp_extension, "FileBaton") and lock.exists():  # the older builder's lock: a file while it builds
        warnings.warn(f"splitz_fast: waiting for {lock} before building the native kernels: another process is "
                      "building them; if none is (an earlier build was interrupted), delete that file.", RuntimeWarning,
                      stacklevel=3)
    return cpp_extension.load


def _load(sources: tuple[str, ...]) -> ModuleType | None:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    try:
        directory = csrc_dir()
        build = _build_name(directory, sources)  # digests the sources: once
        built = load_built(build)
        if built is not None:
            return built
        return builder(build)(
            name=build,
            sources=[str(directory / name) for name in sources],
            extra_include_paths=[str(directory)],
            extra_cflags=list(_cflags(sources)),
            extra_ldflags=list(LDFLAGS),
            verbose=False,
        )
    except Exception as exc:  # any build or load failure: the reference path is correct, only slower
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"splitz_fast: the native CPU kernels (csrc/) could not be built ({reason[:300]}); the PyTorch reference "
            "path runs instead (same noise stream and results, slower). Install a C++ compiler (g++) and ninja to get "
            f"them, or set {NATIVE_ENV}=0 to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def native_available(op: str = "noisy_latents") -> bool:
    """Whether the native module holding ``op`` is built and loaded (builds it on the first call)."""
    if op not in OP_SOURCES:
        raise ValueError(f"op {op!r} has no native kernel; native ops: {sorted(OP_SOURCES)}")
    return _MODULE_OF_SOURCES[OP_SOURCES[op]]() is not None


def main() -> int:
    """``python -m splitz_fast.kernels.native``: build (or find) the extension and say where it stands."""
    for label, module in (("noise", native_module()), ("training step", train_module()),
                          ("convolution + pool", conv_module())):
        if module is None:
            print(f"splitz_fast native {label} kernels: not available (see the warning above); the PyTorch reference "
                  "path is used")
        else:
            print(f"splitz_fast native {label} kernels: ready ({Path(module.__file__).name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
