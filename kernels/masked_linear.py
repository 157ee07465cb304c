"""Masked products of a ``Linear`` layer for a batch, with the masks applied inside a tiled Triton matmul.

For ``W: [out, in]`` and, per sample ``b``, an output mask ``m_out_b: [out]``, an input mask ``m_in_b: [in]`` and a
shared input scale ``s: [in]`` (the folded ``1/sd``), the operator of :class:`splitz_fast.bounds.operators.MaskedAffine`
is ``A_b = diag(m_out_b) · W · diag(s ⊙ m_in_b)``. This op computes, for the whole batch in one launch,

* ``transpose=False`` (``matvec``):  ``y_b = m_out_b ⊙ (W (s ⊙ m_in_b ⊙ v_b))``,   ``v: [B, in] → y: [B, out]``;
* ``transpose=True``  (``rmatvec``): ``v_b = s ⊙ m_in_b ⊙ (Wᵀ (m_out_b ⊙ u_b))``, ``u: [B, out] → v: [B, in]``.

The input-side mask and scale are multiplied into the operand tile as it is loaded, the output-side ones into the
accumulator before the store, so no masked copy of ``v`` or ``W`` is ever materialized.

:class:`MaskedLinearFunction` (an ``autograd.Function``) differentiates w.r.t. ``W`` and the vector: the vector
gradient is the same op with ``transpose`` flipped, and the weight gradient
``∂L/∂W = Σ_b (m_out_b ⊙ p_b)(s ⊙ m_in_b ⊙ q_b)ᵀ`` (``p`` the out-side vector, ``q`` the in-side one) is a second
masked Triton kernel that reduces over the batch. Masks and scale get no gradient (they are hard indicators /
buffers); passing ones that require grad is an error rather than a silently missing gradient.

Shapes and dtypes: ``weight [out, in]`` float32/float64 (any strides); the vector ``[B, in]`` / ``[B, out]`` in the
weight's dtype, ``B ≥ 1``; masks ``None``, ``[B, n]``, or ``[1, n]`` / ``[n]`` shared by the batch (trailing dims are
flattened, so ``[B, C, H, W]`` masks of a Linear after a flatten are fine), bool / uint8 / float; ``scale`` ``None``
or anything with ``in`` elements. float32 uses ``tl.dot`` (IEEE fp32 by default, ``allow_tf32=True`` for TF32 tensor
cores); float64 uses an explicit multiply-and-reduce instead of ``tl.dot`` (fp64 ``tl.dot`` is missing or unreliable
in the Triton releases we support).
"""
from __future__ import annotations

import functools

import torch

from . import interpreting

__all__ = [
    "MaskedLinearFunction",
    "launch_masked_linear",
    "launch_masked_weight_grad",
    "masked_linear",
    "masked_linear_reference",
    "masked_linear_triton",
]

OP_NAME = "masked_linear"


# --------------------------------------------------------------------------------------------------------------------
# Argument normalization
# --------------------------------------------------------------------------------------------------------------------

def _check_weight_and_vector(x: torch.Tensor, weight: torch.Tensor, transpose: bool) -> None:
    if weight.ndim != 2:
        raise ValueError(f"weight must be [out, in], got {tuple(weight.shape)}")
    if weight.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"weight must be float32 or float64, got {weight.dtype}")
    if x.dtype != weight.dtype:
        raise TypeError(f"the vector ({x.dtype}) and the weight ({weight.dtype}) must have the same dtype")
    n = weight.shape[0] if transpose else weight.shape[1]
    if x.ndim != 2 or x.shape[1] != n or x.shape[0] < 1:
        side = "[B, out]" if transpose else "[B, in]"
        raise ValueError(f"the vector must be {side} = [B, {n}] with B >= 1, got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError("the vector and the weight must be on the same device")


def _mask_2d(name: str, mask: torch.Tensor | None, batch: int, n: int) -> torch.Tensor | None:
    """``[B, n]`` or ``[1, n]`` view of a mask (no dtype change)."""
    if mask is None:
        return None
    if mask.numel() == n:
        m = mask.reshape(1, n)
    elif mask.numel() == batch * n and mask.shape[0] == batch:
        m = mask.reshape(batch, n)
    else:
        raise ValueError(f"{name} must have {n} or {batch}×{n} elements ([B, n], [1, n] or [n]), "
                         f"got shape {tuple(mask.shape)}")
    return m


def _scale_1d(scale: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor | None:
    if scale is None:
        return None
    if scale.numel() != n:
        raise ValueError(f"scale must have {n} elements (one per input feature), got shape {tuple(scale.shape)}")
    return scale.reshape(n).to(device=like.device, dtype=like.dtype)


def _check_no_grad(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(f"masked_linear gives no gradient w.r.t. {name}; pass it detached")


# --------------------------------------------------------------------------------------------------------------------
# Reference (the CPU path and the test oracle; differentiable through plain autograd)
# --------------------------------------------------------------------------------------------------------------------

def masked_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_mask: torch.Tensor | None = None,
    in_mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
) -> torch.Tensor:
    """Pure-PyTorch ``A x`` (``transpose=False``, ``x = v: [B, in]``) or ``Aᵀ x`` (``x = u: [B, out]``)."""
    _check_weight_and_vector(x, weight, transpose)
    batch = x.shape[0]
    n_out, n_in = weight.shape
    mo = _mask_2d("out_mask", out_mask, batch, n_out)
    mi = _mask_2d("in_mask", in_mask, batch, n_in)
    s = _scale_1d(scale, n_in, weight)
    in_factor = None
    if mi is not None:
        in_factor = mi.to(weight.dtype)
    if s is not None:
        in_factor = s.view(1, -1) if in_factor is None else in_factor * s.view(1, -1)
    mo = None if mo is None else mo.to(weight.dtype)
    if not transpose:
        v = x if in_factor is None else x * in_factor
        y = v @ weight.T
        return y if mo is None else y * mo
    u = x if mo is None else x * mo
    v = u @ weight
    return v if in_factor is None else v * in_factor


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels (built lazily: importing this module never imports triton)
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def masked_mm_kernel(
        X, PRE, PRE_S, W, POST, POST_S, Y,
        M, N, K,
        stride_xm, stride_xk, stride_pm, stride_pk, stride_wk, stride_wn, stride_qm, stride_qn, stride_ym, stride_yn,
        HAS_PRE: tl.constexpr, HAS_PRE_S: tl.constexpr, HAS_POST: tl.constexpr, HAS_POST_S: tl.constexpr,
        USE_DOT: tl.constexpr, ALLOW_TF32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Y[m, n] = POST[m, n]·POST_S[n] · Σ_k X[m, k]·PRE[m, k]·PRE_S[k] · W[k, n] (W given by its strides)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K).to(tl.int64)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=Y.dtype.element_ty)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            xk_ok = m_ok[:, None] & k_ok[None, :]
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=xk_ok, other=0.0)
            if HAS_PRE:
                p = tl.load(PRE + rm[:, None] * stride_pm + kk[None, :] * stride_pk, mask=xk_ok, other=0)
                x = x * p.to(x.dtype)
            if HAS_PRE_S:
                s = tl.load(PRE_S + kk, mask=k_ok, other=0.0)
                x = x * s[None, :]
            w = tl.load(W + kk[:, None] * stride_wk + rn[None, :] * stride_wn, mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            if USE_DOT:
                if ALLOW_TF32:
                    acc = tl.dot(x, w, acc, input_precision="tf32")
                else:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        mn_ok = m_ok[:, None] & n_ok[None, :]
        if HAS_POST:
            q = tl.load(POST + rm[:, None] * stride_qm + rn[None, :] * stride_qn, mask=mn_ok, other=0)
            acc = acc * q.to(acc.dtype)
        if HAS_POST_S:
            t = tl.load(POST_S + rn, mask=n_ok, other=0.0)
            acc = acc * t[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc, mask=mn_ok)

    @triton.jit
    def masked_outer_kernel(
        P, PM, Q, QM, QS, C,
        M, N, K,
        stride_pk, stride_pm, stride_pmk, stride_pmm, stride_qk, stride_qn, stride_qmk, stride_qmn,
        stride_cm, stride_cn,
        HAS_PM: tl.constexpr, HAS_QM: tl.constexpr, HAS_QS: tl.constexpr,
        USE_DOT: tl.constexpr, ALLOW_TF32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """C[m, n] = QS[n] · Σ_k P[k, m]·PM[k, m] · Q[k, n]·QM[k, n]  (k runs over the batch)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K).to(tl.int64)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=C.dtype.element_ty)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            pk_ok = m_ok[:, None] & k_ok[None, :]
            p = tl.load(P + kk[None, :] * stride_pk + rm[:, None] * stride_pm, mask=pk_ok, other=0.0)  # [BM, BK]
            if HAS_PM:
                pm = tl.load(PM + kk[None, :] * stride_pmk + rm[:, None] * stride_pmm, mask=pk_ok, other=0)
                p = p * pm.to(p.dtype)
            qk_ok = k_ok[:, None] & n_ok[None, :]
            q = tl.load(Q + kk[:, None] * stride_qk + rn[None, :] * stride_qn, mask=qk_ok, other=0.0)  # [BK, BN]
            if HAS_QM:
                qm = tl.load(QM + kk[:, None] * stride_qmk + rn[None, :] * stride_qmn, mask=qk_ok, other=0)
                q = q * qm.to(q.dtype)
            if USE_DOT:
                if ALLOW_TF32:
                    acc = tl.dot(p, q, acc, input_precision="tf32")
                else:
                    acc = tl.dot(p, q, acc, input_precision="ieee")
            else:
                acc += tl.sum(p[:, :, None] * q[None, :, :], axis=1)
        if HAS_QS:
            s = tl.load(QS + rn, mask=n_ok, other=0.0)
            acc = acc * s[None, :]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc, mask=m_ok[:, None] & n_ok[None, :])

    return masked_mm_kernel, masked_outer_kernel


def _blocks(dtype: torch.dtype, m: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)``: tl.dot tiles (≥ 16 each) for float32, a small multiply-and-reduce
    tile for float64 (its [BM, BK, BN] product lives in registers)."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 32, True
    return 16, 32, 8, False


def _kernel_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask the kernel can load: bool as a zero-copy uint8 view, uint8 as is, anything else in ``dtype``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    if mask.dtype in (torch.uint8, dtype):
        return mask
    return mask.to(dtype)


def _strides_2d(t: torch.Tensor | None, batch: int) -> tuple[int, int]:
    """Strides of a ``[B or 1, n]`` tensor; a ``[1, n]`` one is broadcast with batch stride 0."""
    if t is None:
        return 0, 0
    return (0 if t.shape[0] == 1 and batch != 1 else t.stride(0)), t.stride(1)


def _require_triton_device(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{what} needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


@torch.no_grad()
def launch_masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_mask: torch.Tensor | None = None,
    in_mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    allow_tf32: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Triton launch of ``A x`` / ``Aᵀ x`` (no autograd). ``out``: optional contiguous preallocated result."""
    _check_weight_and_vector(x, weight, transpose)
    _require_triton_device(x, "launch_masked_linear")
    batch = x.shape[0]
    n_out, n_in = weight.shape
    dtype = weight.dtype
    mo = _kernel_mask(_mask_2d("out_mask", out_mask, batch, n_out), dtype)
    mi = _kernel_mask(_mask_2d("in_mask", in_mask, batch, n_in), dtype)
    s = _scale_1d(scale, n_in, weight)
    if s is not None:
        s = s.contiguous()
    if not transpose:  # Y[b, o] = mo[b, o] · Σ_i x[b, i]·mi[b, i]·s[i] · W[o, i]
        n, k = n_out, n_in
        pre, pre_s, post, post_s = mi, s, mo, None
        stride_wk, stride_wn = weight.stride(1), weight.stride(0)
    else:  # Y[b, i] = mi[b, i]·s[i] · Σ_o x[b, o]·mo[b, o] · W[o, i]
        n, k = n_in, n_out
        pre, pre_s, post, post_s = mo, None, mi, s
        stride_wk, stride_wn = weight.stride(0), weight.stride(1)
    if out is None:
        out = torch.empty(batch, n, dtype=dtype, device=x.device)
    elif tuple(out.shape) != (batch, n) or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"out must be a {dtype} tensor of shape {(batch, n)} on {x.device}")
    if k == 0 or n == 0:
        out.zero_()
        return out
    block_m, block_n, block_k, use_dot = _blocks(dtype, batch)
    mm_kernel, _ = _kernels()
    import triton  # the launch path only: importing this module never imports triton

    grid = (triton.cdiv(batch, block_m), triton.cdiv(n, block_n))
    dummy = weight
    mm_kernel[grid](
        x, dummy if pre is None else pre, dummy if pre_s is None else pre_s, weight,
        dummy if post is None else post, dummy if post_s is None else post_s, out,
        batch, n, k,
        x.stride(0), x.stride(1), *_strides_2d(pre, batch), stride_wk, stride_wn, *_strides_2d(post, batch),
        out.stride(0), out.stride(1),
        HAS_PRE=pre is not None, HAS_PRE_S=pre_s is not None, HAS_POST=post is not None,
        HAS_POST_S=post_s is not None, USE_DOT=use_dot, ALLOW_TF32=bool(allow_tf32 and use_dot),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


@torch.no_grad()
def launch_masked_weight_grad(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    out_mask: torch.Tensor | None = None,
    in_mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    allow_tf32: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``G[o, i] = Σ_b (out_mask ⊙ p)[b, o] · (in_mask ⊙ q)[b, i] · scale[i]`` for ``p: [B, out]``, ``q: [B, in]``
    — the weight gradient of both directions of the op. ``out``: optional preallocated ``[out, in]`` result."""
    if p.ndim != 2 or q.ndim != 2 or p.shape[0] != q.shape[0] or p.dtype != q.dtype:
        raise ValueError(f"p [B, out] and q [B, in] must share B and dtype, got {tuple(p.shape)}, {tuple(q.shape)}")
    _require_triton_device(p, "launch_masked_weight_grad")
    batch, n_out = p.shape
    n_in = q.shape[1]
    dtype = p.dtype
    mo = _kernel_mask(_mask_2d("out_mask", out_mask, batch, n_out), dtype)
    mi = _kernel_mask(_mask_2d("in_mask", in_mask, batch, n_in), dtype)
    s = _scale_1d(scale, n_in, p)
    if s is not None:
        s = s.contiguous()
    if out is None:
        out = torch.empty(n_out, n_in, dtype=dtype, device=p.device)
    elif tuple(out.shape) != (n_out, n_in) or out.dtype != dtype or out.device != p.device:
        raise ValueError(f"out must be a {dtype} tensor of shape {(n_out, n_in)} on {p.device}")
    if n_out == 0 or n_in == 0:
        return out
    block_m, block_n, block_k, use_dot = _blocks(dtype, n_out)
    if use_dot:
        block_m, block_k = 32, 16
    _, outer_kernel = _kernels()
    import triton  # the launch path only

    grid = (triton.cdiv(n_out, block_m), triton.cdiv(n_in, block_n))
    dummy = p
    pm_k, pm_m = _strides_2d(mo, batch)
    qm_k, qm_n = _strides_2d(mi, batch)
    outer_kernel[grid](
        p, dummy if mo is None else mo, q, dummy if mi is None else mi, dummy if s is None else s, out,
        n_out, n_in, batch,
        p.stride(0), p.stride(1), pm_k, pm_m, q.stride(0), q.stride(1), qm_k, qm_n, out.stride(0), out.stride(1),
        HAS_PM=mo is not None, HAS_QM=mi is not None, HAS_QS=s is not None,
        USE_DOT=use_dot, ALLOW_TF32=bool(allow_tf32 and use_dot),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


class MaskedLinearFunction(torch.autograd.Function):
    """``autograd.Function`` over the Triton launches: forward ``A x`` / ``Aᵀ x``; backward gives the gradients
    w.r.t. the vector and the weight (masks and scale are constants)."""

    @staticmethod
    def forward(ctx, x, weight, out_mask, in_mask, scale, transpose, allow_tf32):
        y = launch_masked_linear(x, weight, out_mask=out_mask, in_mask=in_mask, scale=scale, transpose=transpose,
                                 allow_tf32=allow_tf32)
        ctx.transpose = transpose
        ctx.allow_tf32 = allow_tf32
        ctx.save_for_backward(x, weight, out_mask, in_mask, scale)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, out_mask, in_mask, scale = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = launch_masked_linear(grad, weight, out_mask=out_mask, in_mask=in_mask, scale=scale,
                                          transpose=not ctx.transpose, allow_tf32=ctx.allow_tf32)
        if ctx.needs_input_grad[1]:
            # p: the out-side vector ([B, out]), q: the in-side one ([B, in]).
            p, q = (grad, x) if not ctx.transpose else (x, grad)
            grad_w = launch_masked_weight_grad(p, q, out_mask=out_mask, in_mask=in_mask, scale=scale,
                                               allow_tf32=ctx.allow_tf32)
        return grad_x, grad_w, None, None, None, None, None


def masked_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_mask: torch.Tensor | None = None,
    in_mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """Triton ``A x`` / ``Aᵀ x`` with autograd (gradients w.r.t. ``x`` and ``weight``)."""
    _check_weight_and_vector(x, weight, transpose)
    _check_no_grad(out_mask=out_mask, in_mask=in_mask, scale=scale)
    batch = x.shape[0]
    n_out, n_in = weight.shape
    mo = _mask_2d("out_mask", out_mask, batch, n_out)
    mi = _mask_2d("in_mask", in_mask, batch, n_in)
    s = _scale_1d(scale, n_in, weight)
    mo = None if mo is None else mo.detach()
    mi = None if mi is None else mi.detach()
    s = None if s is None else s.detach()
    return MaskedLinearFunction.apply(x, weight, mo, mi, s, bool(transpose), bool(allow_tf32))


def masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_mask: torch.Tensor | None = None,
    in_mask: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    allow_tf32: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Dispatching entry point: ``backend`` ``"triton"`` / ``"reference"``, or ``None`` for
    ``splitz_fast.kernels.select_backend("masked_linear", x.device)`` (``SPLITZ_BACKEND`` overrides).
    ``allow_tf32`` only affects the Triton float32 path."""
    if backend is None:
        from . import select_backend

        backend = select_backend(OP_NAME, x.device)
    if backend == "triton":
        return masked_linear_triton(x, weight, out_mask=out_mask, in_mask=in_mask, scale=scale, transpose=transpose,
                                    allow_tf32=allow_tf32)
    if backend == "reference":
        return masked_linear_reference(x, weight, out_mask=out_mask, in_mask=in_mask, scale=scale,
                                       transpose=transpose)
    raise ValueError(f"backend must be 'triton', 'reference' or None, got {backend!r}")
