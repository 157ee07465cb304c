"""Build and load the native (C++) kernels of ``csrc/``, the ``native`` backend of :func:`splitz_fast.kernels.select_backend`.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja), cached per source digest,
torch version and compiler flags under torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), so a later process only loads it. ``make install`` builds it ahead of time
(``python -m splitz_fast.kernels.native``). Where it cannot be built (no C++ compiler, no ninja, a failing build) the
loader warns once, says why and how to fix it, and returns ``None``: every op then runs its PyTorch reference, which
follows the same contract (the noise stream included), so results do not depend on whether a compiler was found —
only speed does. ``SPLITZ_NATIVE=0`` turns the extension off without a warning.

Ops: ``noisy_latents`` (CPU; csrc/noise_cpu.cpp, contract in csrc/philox.h and kernels/noise_votes.py) and
``philox_words`` (the integer half of the stream, for tests).
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

NATIVE_ENV = "SPLITZ_NATIVE"
NATIVE_OPS: frozenset[str] = frozenset({"noisy_latents"})  # ops with a native CPU kernel
SOURCES = ("noise_cpu.cpp",)
HEADERS = ("philox.h",)
# -ffp-contract=off: no FMA contraction, so the float32 roundings are the ones the contract writes down;
# -fno-math-errno: sqrtf without errno, so the loops vectorise; target_clones in the source picks the ISA at load time.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def csrc_dir() -> Path:
    """The C++/CUDA sources: ``csrc/`` of the source tree (editable installs), else the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"splitz_fast's C++ sources ({SOURCES[0]}) are neither in {here.parent / 'csrc'} nor in "
                            f"{here / 'csrc'}")


def _build_name(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((directory / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return f"splitz_fast_native_{digest.hexdigest()[:16]}"


@functools.cache
def native_module() -> ModuleType | None:
    """The compiled extension, built if needed; ``None`` (after one warning) where it cannot be built, or when
    ``SPLITZ_NATIVE=0``."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        directory = csrc_dir()
        return load(
            name=_build_name(directory),
            sources=[str(directory / name) for name in SOURCES],
            extra_include_paths=[str(directory)],
            extra_cflags=list(CFLAGS),
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
            stacklevel=2,
        )
        return None


def native_available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    return native_module() is not None


def main() -> int:
    """``python -m splitz_fast.kernels.native``: build (or find) the extension and say where it stands."""
    module = native_module()
    if module is None:
        print("splitz_fast native kernels: not available (see the warning above); the PyTorch reference path is used")
        return 0
    print(f"splitz_fast native kernels: ready ({Path(module.__file__).name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
