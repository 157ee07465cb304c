"""Fused kernels of splitz_fast, shipped as ``splitz_fast.kernels``, and the backend dispatch.

One op per file (Triton kernels, launcher, ``autograd.Function`` where gradients are needed) with its pure-PyTorch
reference beside it — the reference is both the CPU path and the test oracle:

* ``noise``: ``noisy_latents`` (Philox noise added to a broadcast latent in float32, optional bf16/channels_last
  store) and ``noisy_latents_maxpool2`` (the same draw through a 2x2 max pool in one pass, for an ``f_R`` that starts
  with one); ``votes``: ``count_votes`` (row argmax + histogram on the device) — both used by the sampling engine;
  ``philox_reference``: the Philox stream in PyTorch, the oracle the noise references (and the tests) draw from;
* ``first_layer_bounds``: standardization, the first affine layer (conv as an implicit GEMM, or linear), its exact
  l2-ball bound with the rounding margin, the varying mask, ``f_L(x)`` and the clipped interval, in one pass over the
  input — layer 1 of ``bounds.ball_bounds``;
* ``interval_clip``: the fused elementwise step of the bound propagation (interval, varying mask, clipped interval
  for the next layer; float64 without FMA for certificates) — used by ``bounds.ball_bounds``;
* ``masked_linear``: ``m_out ⊙ W (s ⊙ m_in ⊙ v)`` and its transpose with the masks inside a tiled matmul, an
  ``autograd.Function`` (gradient w.r.t. ``W``) — the ``Linear`` factors of the power iterations.

* ``masked_conv2d``: ``m ⊙ W(f ⊙ v)`` and ``f ⊙ Wᵀ(m ⊙ u)`` for a convolution, an implicit GEMM with the masks
  inside, an ``autograd.Function`` — the ``Conv2d`` factors of the power iterations.
* ``conv_relu_pool``: ``conv_relu_maxpool2``, a ``Conv2d`` + ``ReLU`` + 2x2 ``MaxPool2d`` of ``f_R`` as one implicit
  GEMM on tensor cores whose epilogue pools, adds the bias and applies the ReLU (inference; the sampling engine's
  prepared ``f_R`` on CUDA, where selected).

Native (C++) kernels live in ``csrc/`` and are built and loaded by ``native`` (:mod:`splitz_fast.kernels.native`):

* ``noisy_latents`` on CPU tensors (``csrc/noise_cpu.cpp``): the same Philox stream as the Triton kernel, 4.5x
  ``torch.randn`` + add on 2 cores (benchmarks/RESULTS.md); and ``noisy_latents_maxpool2``, the same draw
  followed by a 2x2 max pool in one pass.
* the SPLITZ training step on CPU tensors (``csrc/train_cpu.cpp``, a second module): ``conv_power``
  (``conv_power.py``: the masked convolution power step and norm of the Lipschitz estimate, fused per image, with the
  weight gradient), ``clip_mask`` (``clip_mask.py``: the first layer's clipped ReLU and varying mask in one pass, with
  its backward), ``train_noise`` (``train_noise.py``: the training noise from the Philox stream, a seed per step).
* ``conv_relu_maxpool2`` on CPU tensors (``csrc/conv_pool_cpu.cpp``, a third module): a thin convolution of ``f_R``
  (LeNet's first layer) with its ReLU and 2x2 max pool in one pass that writes only the pooled activation; the
  sampling engine's fused copy of ``f_R`` uses it at a site where it measures faster (``epilogues.FusionChoice``).

Dispatch is explicit: Triton for CUDA tensors where an op has a kernel that beats its reference there
(``AUTO_TRITON_OPS``), the native kernel for CPU tensors where an op has one (``NATIVE_OPS``) and it could be built,
the reference elsewhere; ``SPLITZ_BACKEND`` (``auto`` | ``reference`` | ``triton`` | ``native``) forces one. Forcing
Triton for an op without a Triton kernel is an error, never a silent fallback; ``native`` runs the native kernel of the
ops that have one (an error where it cannot be built) and the reference of the others — on CUDA tensors the CUDA
kernels of ``csrc/noise_votes_cuda.cu`` (``noisy_latents``, ``count_votes``; :mod:`splitz_fast.kernels.native_cuda`),
which ``auto`` leaves to Triton (measured on an H100: ``AUTO_CUDA_NATIVE_OPS``). On a machine without a
GPU, ``SPLITZ_BACKEND=triton`` with ``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter on CPU tensors
(slow; for tests).
"""
from __future__ import annotations

import os

import torch

BACKEND_ENV = "SPLITZ_BACKEND"
BACKENDS = ("auto", "reference", "triton", "native")
# Ops with a Triton implementation.
TRITON_OPS: frozenset[str] = frozenset({"noisy_latents", "noisy_latents_maxpool2", "count_votes", "first_layer_bounds",
                                        "interval_clip", "masked_linear", "masked_conv2d", "conv_relu_maxpool2"})
# Ops that ``auto`` sends to Triton on CUDA: the ones measured faster than their reference there
# (benchmarks/test_bench_kernels.py, H200, batch 256). masked_conv2d is not: its implicit GEMM ran at 0.04–0.39x
# cuDNN's conv2d/conv_transpose2d with the masks as separate multiplies, so on CUDA it runs only when forced.
# noisy_latents_maxpool2 (the noise and f_R's leading 2x2 max pool in one pass) is: LeNet s = 1 CERTIFY on an H100
# (python -m benchmarks.targets --part native, n = 10⁵) 0.104 vs 0.117 s per image (tf32), 0.101 vs 0.112 (bf16).
# conv_relu_maxpool2 (a Conv2d + ReLU + 2x2 MaxPool2d of f_R in one kernel) runs only inside the fused copy of f_R,
# which the sampling engine uses where it measures it faster than the plain copy (epilogues.FusionChoice).
AUTO_TRITON_OPS: frozenset[str] = TRITON_OPS - {"masked_conv2d"}
# Ops that ``auto`` sends to the CUDA kernels of csrc/ (kernels/native_cuda.py: CUDA_OPS) on CUDA instead of Triton:
# none. On an H100 (benchmarks/test_bench_kernels.py cases, 10,000 LeNet latents) the CUDA noise kernel ran at
# 0.82–0.88x the Triton one; its vote count was 2x faster, but 0.02 ms per batch does not pay for building the
# extension at run time. ``SPLITZ_BACKEND=native`` reaches them on CUDA tensors.
AUTO_CUDA_NATIVE_OPS: frozenset[str] = frozenset()


def select_backend(op: str, device: torch.device) -> str:
    """``"triton"``, ``"native"`` or ``"reference"`` for ``op`` on ``device``; ``SPLITZ_BACKEND`` forces one (default
    ``auto``: Triton on CUDA for the ops in ``AUTO_TRITON_OPS``, the native kernel on the CPU for the ops in
    ``NATIVE_OPS`` where it could be built, the reference elsewhere)."""
    from .native import NATIVE_OPS, native_available
    from .native_cuda import CUDA_OPS, cuda_native_available

    choice = os.environ.get(BACKEND_ENV, "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if op not in TRITON_OPS:
            raise NotImplementedError(f"{BACKEND_ENV}=triton, but op {op!r} has no Triton kernel yet")
        return "triton"
    if choice == "native":
        if device.type == "cuda":  # the CUDA kernels of csrc/noise_votes_cuda.cu
            return "native" if op in CUDA_OPS else "reference"
        return "native" if op in NATIVE_OPS else "reference"
    if device.type == "cuda":
        if op in AUTO_CUDA_NATIVE_OPS and op in CUDA_OPS and cuda_native_available():
            return "native"
        return "triton" if op in AUTO_TRITON_OPS else "reference"
    return "native" if op in NATIVE_OPS and device.type == "cpu" and native_available(op) else "reference"


def select_composite(op: str, device: torch.device) -> str:
    """``"native"`` or ``"reference"`` for an op whose reference is built from other dispatched ops (the training
    step's ``conv_power``, ``clip_mask``, ``train_noise``): the native kernel where :func:`select_backend` picks it,
    the reference otherwise — also under ``SPLITZ_BACKEND=triton``, where the reference's own pieces (``masked_conv2d``,
    ``first_layer_bounds``, ``interval_clip``) run their Triton kernels, so forcing Triton is honoured, not refused."""
    if os.environ.get(BACKEND_ENV, "auto").lower() == "triton":
        return "reference"
    return "native" if select_backend(op, device) == "native" else "reference"


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``), i.e. kernels may take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
