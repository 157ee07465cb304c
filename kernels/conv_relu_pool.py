"""``maxpool2(relu(conv2d(x) + b))`` — a ``Conv2d`` (stride 1), its ``ReLU`` and the 2x2 ``MaxPool2d`` after it — in
one Triton kernel, for the noise-sample batches of ``f_R`` (inference only).

Eager PyTorch writes the convolution's full output, reads it back to pool it, then passes over the pooled values to add
the bias and apply the ReLU (LeNet's ``f_R`` on an H100 spends most of its time there, not in the arithmetic). Here the
convolution is an implicit GEMM on tensor cores (``tl.dot``): each program owns ``BLOCK_M`` *pooled* output pixels ×
``BLOCK_N`` output channels and keeps four accumulators, one per position of the 2x2 window; the epilogue takes their
maximum, adds the bias and applies the ReLU, and only the pooled activation is written, once.

Why the epilogue's order is the same function: for a bias constant over a channel, ``max_q(v_q) + b = max_q(v_q + b)``
and ``relu`` is monotone, so ``maxpool(relu(conv(x) + b)) = relu(maxpool(conv(x)) + b)`` — exactly on the float32
accumulators (rounding ``fl(v + b)`` is monotone in ``v``); the result is rounded to the output dtype once, where the
eager chain rounds the convolution's output and then the bias add (so bf16 results agree within bf16 rounding).

Layout: ``x`` is ``[B, C_in, H, W]`` with any strides; the weight is packed once per call as ``[KH·KW·C_in, C_out]``,
tap-major and channel-minor (the reduction index ``k = (ky·KW + kx)·C_in + c``), in ``x``'s dtype. Where ``C_in`` is a
multiple of the reduction step and the channels are contiguous (channels_last), each step reads one tap's consecutive
channels: row-vector loads that the compiler turns into asynchronous copies into shared memory, pipelined over three
stages (LeNet's second layer; checked in the PTX for sm_90). Otherwise (thin inputs, such as a first layer with one or
three channels, or NCHW strides) a step gathers across taps element by element. The reduction step is 32, or 16
where the general gather pads the reduction less with it (``tl.dot``'s smallest: LeNet's first layer, ``K = 9``
taps, pads to 16, not 32). Addresses are 32-bit where every offset the kernel forms fits
(thin inputs, sampling batches of small images), 64-bit otherwise. The output is ``[B, C_out, H_p, W_p]``
channels_last in ``x``'s dtype (``H_p = H_out // 2``: floor mode, as ``MaxPool2d(2)``). Precision: bf16/fp16 inputs
multiply in that type with float32 accumulation (as cuDNN does); float32 inputs multiply as IEEE float32, or as TF32
where ``tf32`` is asked (the engine's ``tf32`` precision, which turns on cuDNN's TF32 for the eager path).

Supported: ``groups=1``, stride 1, dilation 1, zero padding given as numbers; anything else is refused with the reason
(the chain rewrite in :mod:`splitz_fast.sampling.epilogues` only offers layers that qualify).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import interpreting

__all__ = ["conv_relu_maxpool2", "conv_relu_maxpool2_native", "conv_relu_maxpool2_reference",
           "conv_relu_maxpool2_triton", "check_geometry", "needs_int64", "reduction_step", "tuned_configs"]

OP_NAME = "conv_relu_maxpool2"
BLOCK_KS = (32, 16)  # reduction steps: one tap of 32 (or 16) channels, or several taps of a thin input
_INT32_LIMIT = 2 ** 31  # offsets at or beyond it need 64-bit address arithmetic
#: The batch changes with the last, shorter batch of a window: never a new specialisation inside a timed run.
UNSPECIALIZED_ARGS = ("rows",)
# (BLOCK_M pooled output pixels per program, num_warps): the launch configurations the autotuner times on a GPU, once
# per layer shape and dtype. Each holds four BLOCK_M x BLOCK_N float32 accumulators. By ``ptxas -v`` for sm_90a at
# BLOCK_N 64 (bf16 and TF32, Triton 3.6 and 3.8; table in benchmarks/RESULTS.md): the tap-aligned loop, whose
# operands go to shared memory by asynchronous copies, takes 80-140 registers at 16/4 to 64/8 and 192-242 at 128/8,
# none spilling; the general gather holds its operands in registers (up to 255 at 64/8, 20 bytes spilled there in TF32
# with Triton 3.8) and spills about 1 KB at 128/8, so 128/8 is timed for the tap-aligned loop only. The first is the
# one Triton's interpreter runs.
CONFIGS = ((64, 8), (32, 8), (16, 4), (128, 8))
GATHER_MAX_BLOCK_M = 64


def check_geometry(weight: torch.Tensor, stride, padding, dilation, groups: int) -> tuple[int, int]:
    """The padding ``(ph, pw)`` of a convolution this op computes; ``ValueError`` saying why for one it does not."""
    if weight.ndim != 4:
        raise ValueError(f"{OP_NAME} needs a 2-d convolution weight [C_out, C_in, KH, KW], got {tuple(weight.shape)}")
    if groups != 1 or tuple(stride) != (1, 1) or tuple(dilation) != (1, 1) or isinstance(padding, str):
        raise ValueError(f"{OP_NAME} supports groups=1, stride 1, dilation 1 and numeric zero padding; got groups="
                         f"{groups}, stride {tuple(stride)}, dilation {tuple(dilation)}, padding {padding!r}")
    return tuple(padding)


def _pooled_size(x: torch.Tensor, weight: torch.Tensor, padding: tuple[int, int]) -> tuple[int, int]:
    h_out = x.shape[2] + 2 * padding[0] - weight.shape[2] + 1
    w_out = x.shape[3] + 2 * padding[1] - weight.shape[3] + 1
    if h_out < 2 or w_out < 2:
        raise ValueError(f"the convolution's output ({h_out}x{w_out}) is smaller than the 2x2 pool window")
    return h_out // 2, w_out // 2


# --------------------------------------------------------------------------------------------------------------------
# Reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------------------------

def conv_relu_maxpool2_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 padding: tuple[int, int], tf32: bool = False) -> torch.Tensor:
    """The eager chain in ``x``'s dtype: ``max_pool2d(relu(conv2d(x, weight, bias, padding)), 2)``, channels_last.
    (``tf32`` is the kernel's switch; here the caller's cuDNN setting decides.)"""
    check_geometry(weight, (1, 1), padding, (1, 1), 1)
    _pooled_size(x, weight, padding)
    y = F.conv2d(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), padding=padding)
    return F.max_pool2d(F.relu(y), 2).contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernel (built lazily: importing this module never imports triton)
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # Module globals, not locals: Triton (compiled and interpreted) looks a kernel's callees up in its globals.
    global pixel_of, window_tile, tap_tile, multiply_add
    from ._conv_indexing import pixel_of

    @triton.jit
    def window_tile(X, b, c, oy, ox, ky, kx, ok, H, W, PH, PW, sx_b, sx_c, sx_h, sx_w):
        """The ``[BLOCK_M, BLOCK_K]`` operand of the convolution outputs at ``(oy, ox)``: input pixels under taps
        ``(ky, kx)`` and channels ``c``, zero outside the image (padding) and outside the problem (``ok``)."""
        iy = oy[:, None] + ky[None, :] - PH
        ix = ox[:, None] + kx[None, :] - PW
        inside = ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
        address = b[:, None] * sx_b + c[None, :] * sx_c + iy * sx_h + ix * sx_w
        return tl.load(X + address, mask=inside, other=0.0)

    @triton.jit
    def tap_tile(X, sample, c, iy, ix, m_in, H, W, sx_h, sx_w):
        """:func:`window_tile` for one tap and contiguous channels ``c`` (unit channel stride): every row reads
        ``BLOCK_K`` consecutive elements at one input pixel ``(iy, ix)`` (row vectors), one mask per row — loads
        the compiler vectorises and pipelines (asynchronous copies into shared memory)."""
        inside = m_in & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
        pixel = sample + iy * sx_h + ix * sx_w
        return tl.load(X + pixel[:, None] + c[None, :], mask=inside[:, None], other=0.0)

    @triton.jit
    def multiply_add(a, w, acc, IS_FP32: tl.constexpr, TF32: tl.constexpr, WIDEN: tl.constexpr):
        if WIDEN:  # exact: a product of two bf16/fp16 values fits a float32 mantissa
            return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        if IS_FP32:
            if TF32:
                return tl.dot(a, w, acc, input_precision="tf32")
            return tl.dot(a, w, acc, input_precision="ieee")
        return tl.dot(a, w, acc)

    def conv_relu_pool_kernel(
        X, WK, BIAS, OUT,
        rows, C_IN, H, W, HP, WP, C_OUT, K_TOTAL, KW, PH, PW, sx_b, sx_c, sx_h, sx_w,
        HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr, TF32: tl.constexpr, WIDEN: tl.constexpr,
        TAP_ALIGNED: tl.constexpr, INDEX64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        if INDEX64:  # pooled pixels (b, py, px), and every address formed from them, in 64 bits
            m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        else:  # every offset fits 32 bits (the caller checked): half the integer registers and instructions
            m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                # output channels
        m_in = m < rows
        n_in = n < C_OUT
        b, _, py, px = pixel_of(m, HP, WP)
        oy = 2 * py  # the window's top-left convolution output
        ox = 2 * px
        acc00 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc01 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc10 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc11 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_TOTAL, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if TAP_ALIGNED:  # C_IN a multiple of BLOCK_K, unit channel stride: one tap per step, its channels in a row
                tap = k0 // C_IN
                c = tl.multiple_of(k0 - tap * C_IN, BLOCK_K) + tl.arange(0, BLOCK_K)
                iy = oy + tap // KW - PH
                ix = ox + tap % KW - PW
                w = tl.load(WK + k[:, None] * C_OUT + n[None, :], mask=n_in[None, :], other=0.0)
                sample = b * sx_b
                a = tap_tile(X, sample, c, iy, ix, m_in, H, W, sx_h, sx_w)
                acc00 = multiply_add(a, w, acc00, IS_FP32, TF32, WIDEN)
                a = tap_tile(X, sample, c, iy, ix + 1, m_in, H, W, sx_h, sx_w)
                acc01 = multiply_add(a, w, acc01, IS_FP32, TF32, WIDEN)
                a = tap_tile(X, sample, c, iy + 1, ix, m_in, H, W, sx_h, sx_w)
                acc10 = multiply_add(a, w, acc10, IS_FP32, TF32, WIDEN)
                a = tap_tile(X, sample, c, iy + 1, ix + 1, m_in, H, W, sx_h, sx_w)
                acc11 = multiply_add(a, w, acc11, IS_FP32, TF32, WIDEN)
            else:  # the general gather: a step may span several taps (thin inputs such as LeNet's first layer)
                k_in = k < K_TOTAL
                tap = k // C_IN
                c = k - tap * C_IN
                ky = tap // KW
                kx = tap - ky * KW
                w = tl.load(WK + k[:, None] * C_OUT + n[None, :], mask=k_in[:, None] & n_in[None, :], other=0.0)
                ok = m_in[:, None] & k_in[None, :]
                a = window_tile(X, b, c, oy, ox, ky, kx, ok, H, W, PH, PW, sx_b, sx_c, sx_h, sx_w)
                acc00 = multiply_add(a, w, acc00, IS_FP32, TF32, WIDEN)
                a = window_tile(X, b, c, oy, ox + 1, ky, kx, ok, H, W, PH, PW, sx_b, sx_c, sx_h, sx_w)
                acc01 = multiply_add(a, w, acc01, IS_FP32, TF32, WIDEN)
                a = window_tile(X, b, c, oy + 1, ox, ky, kx, ok, H, W, PH, PW, sx_b, sx_c, sx_h, sx_w)
                acc10 = multiply_add(a, w, acc10, IS_FP32, TF32, WIDEN)
                a = window_tile(X, b, c, oy + 1, ox + 1, ky, kx, ok, H, W, PH, PW, sx_b, sx_c, sx_h, sx_w)
                acc11 = multiply_add(a, w, acc11, IS_FP32, TF32, WIDEN)
        pooled = tl.maximum(tl.maximum(acc00, acc01), tl.maximum(acc10, acc11))
        if HAS_BIAS:
            pooled += tl.load(BIAS + n, mask=n_in, other=0.0)[None, :]
        pooled = tl.maximum(pooled, 0.0)
        tl.store(OUT + m[:, None] * C_OUT + n[None, :], pooled.to(OUT.dtype.element_ty),
                 mask=m_in[:, None] & n_in[None, :])

    return triton.jit(conv_relu_pool_kernel, do_not_specialize=UNSPECIALIZED_ARGS)


@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    """:func:`_kernel` under Triton's autotuner over :data:`CONFIGS`, keyed by the layer's shape and the precision
    (tensor dtypes are part of the key), never by the batch: the last, shorter batch of a window, or a CUDA graph
    capture after the first call, never times configurations again."""
    import triton

    configs = [triton.Config({"BLOCK_M": block_m}, num_warps=warps, num_stages=3) for block_m, warps in CONFIGS]
    keys = ["C_IN", "H", "W", "C_OUT", "K_TOTAL", "KW", "PH", "PW", "TF32", "TAP_ALIGNED"]
    return triton.autotune(configs, key=keys, prune_configs_by={"early_config_prune": _timed_configs})(_kernel())


def tuned_configs() -> list[dict]:
    """The launch configuration the autotuner chose for each layer shape it has timed in this process (the tuned
    key's values, then ``BLOCK_M`` and ``num_warps``); empty where the compiled kernel never ran. For the GPU records:
    which tiles won on the card says which of :data:`CONFIGS` to keep."""
    if _tuned_kernel.cache_info().currsize == 0:
        return []
    tuner = _tuned_kernel()
    return [dict(key=[str(v) for v in key], BLOCK_M=config.kwargs["BLOCK_M"], num_warps=config.num_warps)
            for key, config in getattr(tuner, "cache", {}).items()]  # a record: never fail the row that asks


def _timed_configs(configs: list, named_args: dict, **launch) -> list:
    """The configurations worth timing for a launch: the largest tiles only for the tap-aligned loop (see
    :data:`CONFIGS`)."""
    return [c for c in configs if launch["TAP_ALIGNED"] or c.kwargs["BLOCK_M"] <= GATHER_MAX_BLOCK_M]


def _block_n(c_out: int) -> int:
    return max(16, min(64, 1 << (c_out - 1).bit_length()))


def reduction_step(c_in: int, k_total: int, unit_channel_stride: bool) -> tuple[int, bool]:
    """``(BLOCK_K, tap_aligned)`` for a layer: the tap-aligned loop with a step of 32 where 32 divides ``C_in`` (channels
    contiguous), else the general gather with the step of :data:`BLOCK_KS` that pads ``K_total`` least (ties: the
    larger step, fewer iterations). Not a 16-wide tap-aligned loop: for sm_90 its bf16 operand rows (32 bytes) are
    not pipelined as asynchronous copies (the compile test reads that off the kernel's TTGIR)."""
    if unit_channel_stride and c_in % BLOCK_KS[0] == 0:
        return BLOCK_KS[0], True
    padded = {step: -(-k_total // step) * step for step in BLOCK_KS}
    return min(BLOCK_KS, key=lambda step: (padded[step], -step)), False


def needs_int64(x: torch.Tensor, out: torch.Tensor, block_m: int) -> bool:
    """Whether an offset the kernel forms can reach 2³¹: the farthest element of ``x`` its strides address, or the
    output's end plus one tile of rows past it (the rows of the last program, masked but still computed)."""
    x_span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride()))
    return max(x_span, out.numel() + block_m * out.shape[1]) >= _INT32_LIMIT


def conv_relu_maxpool2_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              padding: tuple[int, int], tf32: bool = False) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    import triton

    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{OP_NAME}'s Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.ndim != 4 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{OP_NAME} needs a float32/bfloat16/float16 input [B, {weight.shape[1]}, H, W], got "
                         f"{tuple(x.shape)} {x.dtype}")
    check_geometry(weight, (1, 1), padding, (1, 1), 1)
    hp, wp = _pooled_size(x, weight, padding)
    c_out, c_in, kh, kw = weight.shape
    packed = weight.detach().permute(2, 3, 1, 0).reshape(kh * kw * c_in, c_out).to(x.dtype).contiguous()
    bias_f32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
    out = torch.empty((x.shape[0], c_out, hp, wp), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    rows = x.shape[0] * hp * wp
    if rows == 0:
        return out
    block_n = _block_n(c_out)
    block_k, tap_aligned = reduction_step(c_in, kh * kw * c_in, x.stride(1) == 1)
    args = (x, packed, bias_f32 if bias_f32 is not None else packed, out, rows, c_in, x.shape[2], x.shape[3], hp, wp,
            c_out, kh * kw * c_in, kw, padding[0], padding[1], *x.stride())
    flags = dict(HAS_BIAS=bias is not None, IS_FP32=x.dtype == torch.float32, TF32=tf32, BLOCK_N=block_n,
                 BLOCK_K=block_k, TAP_ALIGNED=tap_aligned,
                 INDEX64=needs_int64(x, out, max(block_m for block_m, _ in CONFIGS)))
    if interpreting():
        # Triton's interpreter multiplies bf16 tiles wrongly (raw bits): widen to float32 there
        block_m, warps = CONFIGS[0]
        grid = (triton.cdiv(rows, block_m), triton.cdiv(c_out, block_n))
        _kernel()[grid](*args, **flags, WIDEN=x.dtype != torch.float32, BLOCK_M=block_m, num_warps=warps)
    else:
        _tuned_kernel()[lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(c_out, block_n))](
            *args, **flags, WIDEN=False)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Native CPU kernel (csrc/conv_pool_cpu.cpp)
# --------------------------------------------------------------------------------------------------------------------

NATIVE_BLOCK = 32  # output channels per accumulator block of the C++ kernel (its kBlock)


def conv_relu_maxpool2_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              padding: tuple[int, int]) -> torch.Tensor:
    """The C++ kernel on CPU tensors (float32 or bfloat16 ``x``, any strides): per pooled pixel four accumulators per
    block of 32 output channels, float32 sums, only the pooled activation written (channels_last). Made for thin
    inputs (a first layer: LeNet's one channel, 3x3), where oneDNN's convolution runs far below its rate on wider
    ones; the sampling engine uses it at a site only where it measures faster (:class:`~splitz_fast.sampling.
    epilogues.FusionChoice`). The weight and bias are rounded to ``x``'s dtype first, as autocast and the reference
    round them, then packed as ``[ceil(C_out / 32), C_in·KH·KW, 32]`` float32 at every call (a few kB: the kernel
    always reads the module's current parameters)."""
    from .native import conv_module

    module = conv_module()
    if module is None:
        raise RuntimeError(f"{OP_NAME}'s native kernel could not be built (see the warning above)")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.ndim != 4 \
            or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{OP_NAME}'s native kernel needs a float32/bfloat16 CPU input [B, {weight.shape[1]}, H, W], "
                         f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    ph, pw = check_geometry(weight, (1, 1), padding, (1, 1), 1)
    hp, wp = _pooled_size(x, weight, padding)
    c_out, c_in, kh, kw = weight.shape
    blocks = -(-c_out // NATIVE_BLOCK)
    taps = c_in * kh * kw
    rows = torch.zeros(blocks * NATIVE_BLOCK, taps, dtype=torch.float32)
    rows[:c_out] = weight.detach().to(x.dtype).reshape(c_out, taps)  # tap k = (c·KH + ky)·KW + kx
    packed = rows.reshape(blocks, NATIVE_BLOCK, taps).transpose(1, 2).contiguous()
    padded_bias = torch.zeros(blocks * NATIVE_BLOCK, dtype=torch.float32)
    if bias is not None:
        padded_bias[:c_out] = bias.detach().to(x.dtype)
    out = torch.empty((x.shape[0], c_out, hp, wp), dtype=x.dtype, memory_format=torch.channels_last)
    module.conv_relu_maxpool2(x, packed, padded_bias, kh, kw, ph, pw, out)
    return out


def conv_relu_maxpool2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       padding: tuple[int, int], tf32: bool = False) -> torch.Tensor:
    """``maxpool2(relu(conv2d(x) + b))`` by the backend :func:`~splitz_fast.kernels.select_backend` picks for
    ``x``'s device (Triton on CUDA where this op is among ``AUTO_TRITON_OPS`` or forced; the C++ kernel on the CPU
    for float32/bfloat16 inputs where it was built; else the reference)."""
    from . import select_backend

    backend = select_backend(OP_NAME, x.device)
    if backend == "triton":
        return conv_relu_maxpool2_triton(x, weight, bias, padding, tf32)
    if backend == "native" and x.dtype in (torch.float32, torch.bfloat16):  # "native" only for CPU tensors
        return conv_relu_maxpool2_native(x, weight, bias, padding)
    return conv_relu_maxpool2_reference(x, weight, bias, padding, tf32)
