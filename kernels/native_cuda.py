"""Build and load the CUDA kernels of ``csrc/`` (noise stream and vote counts), the ``native`` backend on CUDA tensors.

A Python module of its own, separate from the CPU extension of :mod:`splitz_fast.kernels.native` (one
``PYBIND11_MODULE`` per ``load``; a failure in one leaves the other usable), built from

* ``csrc/noise_votes_cuda.cu``: the kernels and raw-pointer launchers (no torch header, so nvcc compiles it in seconds;
  contract in ``csrc/noise_votes_cuda.h`` and ``csrc/philox.h``);
* ``csrc/noise_votes_cuda_bind.cpp``: the binding (tensor checks, device guard, current stream).

:func:`cuda_module` builds it on first use with ``torch.utils.cpp_extension.load`` (ninja, nvcc for the architecture of
the visible GPU or ``TORCH_CUDA_ARCH_LIST``), cached per source digest, flags and torch version in torch's extension
cache, and only where ``torch.cuda.is_available()``: elsewhere it returns ``None`` without building or warning. A
failing build warns once and returns ``None``; ``SPLITZ_NATIVE=0`` turns it off, as for the CPU kernels.

The CUDA kernels are reachable by name (``SPLITZ_BACKEND=native`` on CUDA tensors, or ``noisy_latents_cuda`` /
``count_votes_cuda`` of :mod:`splitz_fast.kernels.noise` and :mod:`splitz_fast.kernels.votes`); ``auto`` keeps
Triton on CUDA until a GPU measurement (benchmarks/test_bench_kernels.py) shows the CUDA kernels faster
(``AUTO_CUDA_NATIVE_OPS`` in :mod:`splitz_fast.kernels`).

CI has nvcc but no GPU: :func:`nvcc_compile_command` is the compile-only command for ``noise_votes_cuda.cu`` (the same
nvcc flags as the JIT build), which tests/kernels/test_native_cuda.py runs so that the CUDA sources cannot rot;
:func:`binding_syntax_command` checks the binding with the host compiler (slow suite: it parses torch's headers).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .native import NATIVE_ENV, builder, csrc_dir, load_built

CUDA_OPS: frozenset[str] = frozenset({"noisy_latents", "count_votes"})  # ops with a CUDA kernel in csrc/
CUDA_SOURCES = ("noise_votes_cuda_bind.cpp", "noise_votes_cuda.cu")
CUDA_HEADERS = ("noise_votes_cuda.h", "philox.h")
KERNEL_SOURCE = "noise_votes_cuda.cu"
BINDING_SOURCE = "noise_votes_cuda_bind.cpp"
CXX_FLAGS = ("-O3",)
# --fmad=false: no FMA contraction anywhere (the kernels also spell their roundings with __fmul_rn / __fadd_rn), so the
# float32 roundings are the ones philox.h writes down. Never --use_fast_math: ln / sin / cos must stay accurate.
NVCC_FLAGS = ("-O3", "--fmad=false")
DEFAULT_CHECK_ARCHS = ("sm_90",)  # H100 / H200, the GPUs this project is measured on


def _build_name(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in CUDA_SOURCES + CUDA_HEADERS:
        digest.update((directory / name).read_bytes())
    digest.update(" ".join(CXX_FLAGS + NVCC_FLAGS).encode())
    digest.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return f"splitz_fast_cuda_{digest.hexdigest()[:16]}"


@functools.cache
def cuda_module() -> ModuleType | None:
    """The compiled CUDA extension, built if needed; ``None`` without CUDA (no warning), with ``SPLITZ_NATIVE=0``, or
    (after one warning) where it cannot be built."""
    if os.environ.get(NATIVE_ENV, "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        directory = csrc_dir()
        build = _build_name(directory)  # digests the sources: once
        built = load_built(build)
        if built is not None:
            return built
        return builder(build)(
            name=build,
            sources=[str(directory / name) for name in CUDA_SOURCES],
            extra_include_paths=[str(directory)],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(NVCC_FLAGS),
            with_cuda=True,
            verbose=False,
        )
    except Exception as exc:  # any build or load failure: Triton and the reference stay correct
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"splitz_fast: the CUDA kernels (csrc/noise_votes_cuda.cu) could not be built ({reason[:300]}); the Triton "
            "kernels and the PyTorch references remain (SPLITZ_BACKEND=auto|triton|reference). Install the CUDA "
            f"toolkit (nvcc) matching torch.version.cuda and ninja to get them, or set {NATIVE_ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def cuda_native_available() -> bool:
    """Whether the CUDA kernels are built and loaded (builds them on the first call where CUDA is available)."""
    return cuda_module() is not None


# --------------------------------------------------------------------------------------- compile-only checks (CI)
def nvcc_path() -> str | None:
    """nvcc on ``PATH``, else under ``CUDA_HOME`` / ``CUDA_PATH`` / ``/usr/local/cuda``; ``None`` if not found."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cxx_standard() -> str:
    """The C++ standard torch's headers need (torch >= 2.10 requires C++20; older releases build with C++17)."""
    from torch.utils.cpp_extension import include_paths

    for root in include_paths():
        header = Path(root) / "ATen" / "ATen.h"
        if header.is_file():
            return "c++20" if "202002L" in header.read_text(errors="replace") else "c++17"
    return "c++17"


def nvcc_compile_command(output: str | os.PathLike, archs: tuple[str, ...] = DEFAULT_CHECK_ARCHS,
                         nvcc: str | None = None) -> list[str]:
    """``nvcc -c csrc/noise_votes_cuda.cu -o output`` with the JIT build's device flags (torch's common nvcc flags,
    :data:`NVCC_FLAGS`, torch's C++ standard) for the given real architectures (e.g. ``("sm_90",)``): compile only,
    no GPU needed."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda)")
    directory = csrc_dir()
    gencode = []
    for arch in archs:
        number = arch.removeprefix("sm_")
        gencode += ["-gencode", f"arch=compute_{number},code=sm_{number}"]
    return [nvcc, "-c", str(directory / KERNEL_SOURCE), "-o", str(output), f"-std={cxx_standard()}",
            f"-I{directory}", *COMMON_NVCC_FLAGS, *NVCC_FLAGS, *gencode, "--compiler-options", "-fPIC"]


def cuda_include_dir(nvcc: str | None = None) -> str | None:
    """The CUDA toolkit's include folder (with ``cuda_runtime_api.h``), found beside nvcc or under the usual roots."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = nvcc or nvcc_path()
    if nvcc:
        candidates.insert(0, str(Path(nvcc).resolve().parent.parent))
    for root in candidates:
        if root and (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return str(Path(root) / "include")
    return None


def binding_syntax_command(cxx: str = "c++") -> list[str]:
    """``c++ -fsyntax-only csrc/noise_votes_cuda_bind.cpp`` with the include paths and defines of the JIT build: the
    binding against the installed torch's C++ API and CUDA headers, without compiling code or needing a GPU."""
    from torch.utils.cpp_extension import include_paths

    include = cuda_include_dir()
    if include is None:
        raise FileNotFoundError("the CUDA headers (cuda_runtime_api.h) were not found beside nvcc or in CUDA_HOME")
    directory = csrc_dir()
    system = [*include_paths(), include, sysconfig.get_path("include")]
    return [cxx, "-fsyntax-only", f"-std={cxx_standard()}", f"-I{directory}",
            *[flag for root in system for flag in ("-isystem", root)],
            "-DTORCH_EXTENSION_NAME=splitz_fast_cuda_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
            str(directory / BINDING_SOURCE)]


def main() -> int:
    """``python -m splitz_fast.kernels.native_cuda``: build (or find) the CUDA extension and say where it stands; exit
    status 1 where CUDA is available but the extension could not be built."""
    if not torch.cuda.is_available():
        print("splitz_fast CUDA kernels: no CUDA device here, nothing built")
        return 0
    module = cuda_module()
    if module is None:
        print("splitz_fast CUDA kernels: not available (see the warning above); Triton and the references remain")
        return 1
    print(f"splitz_fast CUDA kernels: ready ({Path(module.__file__).name}) on {torch.cuda.get_device_name(0)}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
