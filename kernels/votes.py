"""Vote counting of the sampling engine (SPEC §2 soundness, §5 speed): ``count_votes_triton``, a Triton kernel with
its launcher, beside the pure-PyTorch reference ``count_votes_reference`` (the test oracle and the fallback path), and
``count_votes_cuda``, the launcher of the CUDA kernel of ``csrc/noise_votes_cuda.cu`` (``SPLITZ_BACKEND=native`` on
CUDA tensors; ``auto`` uses the Triton kernel there until measured otherwise). The noise draws of the same engine are
:mod:`splitz_fast.kernels.noise`.

``count_votes_triton(logits [b, C], counts [C])``
    ``counts += bincount(argmax(logits, 1), minlength=C)`` in place, on the device, without a host sync: ties go to
    the lowest index and a NaN counts as the maximum (the first NaN of a row wins), both as ``torch.argmax``.

Where the kernels run: CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before the first launch (the
kernels are jitted lazily at their first launch, so importing this module never imports Triton and never fails
where Triton is missing). Only Triton features present in Triton 3.6 are used.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ._utils import check_launch_device

OPS = ("count_votes",)  # op names for splitz_fast.kernels.TRITON_OPS
COUNT_DTYPES = (torch.int64, torch.int32)

tl = None  # triton.language, bound by _kernels() at the first launch (the jitted functions resolve it as a global)


# ---------------------------------------------------------------------------------------------------- Triton kernels
# Plain functions here, wrapped by triton.jit in _kernels(): Triton decides between the compiler and the interpreter
# (TRITON_INTERPRET) when a function is wrapped, so wrapping happens at the first launch, not at import.

def _count_votes_kernel(
    logits_ptr, counts_ptr, rows, classes, stride_r, stride_c,
    VALUE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    LOCAL_HIST: tl.constexpr,
):
    """Row argmax of ``BLOCK_R`` rows (scan over column chunks of ``BLOCK_C``), then either one block-local
    histogram of ``BLOCK_H >= classes`` bins added with one masked atomic per non-empty bin (``LOCAL_HIST``) or one
    atomic per row. ``VALUE`` is the comparison dtype (float32, or float64 for float64 logits)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    row_ptr = logits_ptr + r.to(tl.int64)[:, None] * stride_r
    best = tl.full([BLOCK_R], float("-inf"), VALUE)
    best_idx = tl.zeros([BLOCK_R], dtype=tl.int32)
    first_nan = tl.zeros([BLOCK_R], dtype=tl.int32) + classes
    for start in range(0, classes, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        valid = rmask[:, None] & (cols < classes)[None, :]
        x = tl.load(row_ptr + cols.to(tl.int64)[None, :] * stride_c, mask=valid, other=float("-inf")).to(VALUE)
        is_nan = (x != x) & valid
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols[None, :], classes), axis=1))
        ordinary = valid & (x == x)
        x = tl.where(ordinary, x, float("-inf"))
        chunk_max = tl.max(x, axis=1)
        chunk_idx = tl.min(tl.where(ordinary & (x == chunk_max[:, None]), cols[None, :], classes), axis=1)
        better = chunk_max > best  # strict: an equal maximum in a later chunk keeps the lower index
        best = tl.where(better, chunk_max, best)
        best_idx = tl.where(better, chunk_idx, best_idx)
    vote = tl.where(first_nan < classes, first_nan, best_idx)  # all -inf rows keep index 0, like torch.argmax
    if LOCAL_HIST:
        bins = tl.arange(0, BLOCK_H)
        hist = tl.sum(((vote[:, None] == bins[None, :]) & rmask[:, None]).to(tl.int32), axis=0)
        tl.atomic_add(counts_ptr + bins, hist.to(counts_ptr.dtype.element_ty), mask=(hist > 0) & (bins < classes),
                      sem="relaxed")
    else:
        ones = tl.full([BLOCK_R], 1, dtype=counts_ptr.dtype.element_ty)
        tl.atomic_add(counts_ptr + vote, ones, mask=rmask, sem="relaxed")


#: The row count changes with the last, shorter batch of a window: never a new specialisation inside a timed run
#: (Triton specialises integers on ``== 1`` and on divisibility by 16).
UNSPECIALIZED_ARGS = ("rows",)


class _Kernels(NamedTuple):
    triton: object
    votes: object


@functools.cache
def _kernels() -> _Kernels:
    """The jitted kernel (built once, at the first launch)."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise RuntimeError("the Triton kernels of splitz_fast.kernels.votes need the `triton` package; use "
                           "count_votes_reference (SPLITZ_BACKEND=reference)") from exc
    tl = language
    return _Kernels(triton, triton.jit(_count_votes_kernel, do_not_specialize=UNSPECIALIZED_ARGS))


def _check_votes_args(logits, counts) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(counts, torch.Tensor):
        raise TypeError("logits and counts must be torch.Tensors")
    if logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [batch, num_classes] tensor, got shape "
                         f"{tuple(logits.shape)} and dtype {logits.dtype}")
    if counts.ndim != 1 or counts.dtype not in COUNT_DTYPES:
        raise ValueError(f"counts must be a 1-D int64 or int32 tensor, got shape {tuple(counts.shape)} and dtype "
                         f"{counts.dtype}")
    if counts.numel() != logits.shape[1] or counts.numel() == 0:
        raise ValueError(f"counts has {counts.numel()} bins but logits have {logits.shape[1]} classes (need >= 1)")
    if counts.device != logits.device:
        raise ValueError(f"counts ({counts.device}) and logits ({logits.device}) must be on the same device")
    if not counts.is_contiguous():
        raise ValueError("counts must be contiguous (it is updated in place)")


def count_votes_triton(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``counts += bincount(argmax(logits, dim=1), minlength=C)`` in place by the Triton kernel; returns ``counts``.

    Args:
        logits: ``[b, C]`` scores, any float dtype and strides. Ties go to the lowest class index; a NaN counts as the
            maximum (the row's first NaN wins), as ``torch.argmax``.
        counts: ``[C]`` int64 or int32 histogram, contiguous, on the logits' device; accumulated atomically.
    """
    _check_votes_args(logits, counts)
    rows, classes = logits.shape
    if rows == 0:
        return counts
    check_launch_device("logits", logits, _kernels().votes)
    triton, kernel = _kernels().triton, _kernels().votes
    block_c = min(triton.next_power_of_2(classes), 512)
    block_r = max(1, min(64, 4096 // block_c))
    block_h = triton.next_power_of_2(classes)
    value = tl.float64 if logits.dtype == torch.float64 else tl.float32
    kernel[(triton.cdiv(rows, block_r),)](
        logits, counts, rows, classes, logits.stride(0), logits.stride(1),
        VALUE=value, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_H=block_h, LOCAL_HIST=block_r * block_h <= 8192,
    )
    return counts


def count_votes_cuda(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`count_votes_triton` by the CUDA kernel of ``csrc/noise_votes_cuda.cu`` (CUDA tensors): same arguments, ties,
    NaN rule and in-place contract, no host sync. One thread per row up to 32 classes, one warp per row above; a
    shared-memory histogram per block. Selected by ``SPLITZ_BACKEND=native`` on CUDA tensors (``auto``: Triton)."""
    from .native_cuda import cuda_module

    _check_votes_args(logits, counts)
    if logits.device.type != "cuda":
        raise ValueError(f"logits are on {logits.device}: the CUDA vote kernel runs on CUDA tensors")
    if logits.shape[0] == 0:
        return counts
    module = cuda_module()
    if module is None:
        raise RuntimeError("the CUDA kernels of splitz_fast (csrc/noise_votes_cuda.cu) are not available here (see "
                           "the warning above); use count_votes_triton (Triton) or count_votes_reference")
    module.count_votes(logits.detach(), counts)
    return counts


def count_votes_reference(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of :func:`count_votes_triton` (``argmax`` + ``bincount``), same signature and in-place contract."""
    _check_votes_args(logits, counts)
    if logits.shape[0]:
        votes = torch.bincount(logits.argmax(dim=1), minlength=counts.numel())
        counts += votes.to(counts.dtype)
    return counts
