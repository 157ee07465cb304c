"""The least time a certification can take on a card: ``f_R``'s FLOPs and activation bytes per sample, counted, and
the compute and memory floors per image that follow from the card's peak figures (benchmarks/targets/' columns).

**What is counted** (:func:`count_cost`): one forward of ``f_R`` (the part of the model the noise samples go through;
at s = 0 the whole model, standardization included) on one sample (batch 1; every count here is proportional to the
batch), in float32 without autocast, under ``torch.no_grad``, once per (model, split) and outside every timed region.

* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (2 per multiply-accumulate of convolutions and matrix products;
  it counts 0 for elementwise ops, BatchNorm and pools). Kept apart: convolution FLOPs (cuDNN) and matrix-product
  FLOPs (cuBLAS), which fp32 runs at different peaks (PyTorch's TF32 switches are separate for the two).
* activation elements, **unfused** (every op's output written once and read once, as eager PyTorch runs it): the sum,
  over every aten op dispatched in that forward (a ``TorchDispatchMode``), of the element count of the op's first
  tensor output, for the ops that write memory — ops with a fresh output (convolution, addmm, batch norm,
  out-of-place add/ReLU/sub/div, pools) and in-place ops (``relu_``, ``add_``: they rewrite their input). Not counted:
  views and other aliases (``view``, ``t``, ``Flatten``'s reshape: they write nothing), the outputs after the first
  (BatchNorm's saved statistics, max-pool indices: bookkeeping), ops without tensor inputs (allocations such as the
  ``empty`` inside BatchNorm's composite), ``f_R``'s input (the noisy latent: the noise kernel's output, which a
  fused kernel could draw inside the first layer; recorded apart as ``input_elements``) and weights (read once per
  batch, not per sample).
* activation elements, **fused** (what a conv + BN + ReLU (+ pool) / conv + BN + residual add + ReLU fusion writes):
  the same ops grouped into chains: an op that is not an epilogue starts a chain; an epilogue op whose input is the
  chain's latest output (through views) extends it — epilogues are pointwise ops (``torch.Tag.pointwise``: bias or
  residual add, ReLU, standardization's sub/div, ...), inference BatchNorm and pooling (max/avg pools, the global
  mean); each chain writes only its last output. This is the targets' "fused floor": 0.28–0.30 of the unfused
  elements on the ResNets (SPEC §5's "about a third"), 0.11 on LeNet, whose 2×2 pools end every conv chain and shrink
  its output 4×.

SPEC §5's reference counts for the whole models (s = 0): LeNet 8.9 MFLOP and 88 k elements, ResNet-110 (32×32)
0.51 GFLOP and 3.7 M, ResNet-50 (224×224) 8.2 GFLOP and 32 M. Counted here: 8.94 MFLOP / 85,082, 0.506 GFLOP /
3,692,618 and 8.18 GFLOP / 37,860,840. The FLOPs agree. SPEC's element counts are sums of the outputs of *leaf
modules* (88,218 / 3,677,258 / 32,190,952 with forward hooks): they count LeNet's ``Flatten`` (a view: 3,136) and a
CIFAR block's identity shortcut (an empty ``nn.Sequential``, the size of the residual add it happens to stand in for),
count ``Standardize`` as one tensor where its sub and div write two (ResNet-50: 150,528), and miss the residual
additions, which are not modules (ResNet-50: 16 of them, 5,519,360 elements; ResNet-110: the two after a projection
shortcut, 12,288).

**Floors per image** (:func:`floors`) with ``S = n0 + n`` samples per image on a card of :data:`CARDS`:

* compute floor = S × FLOPs / the card's dense peak for the row's precision, which is how the engine runs ``f_R``
  (``Smoother(precision=...)``): bf16/fp16 rows at the bf16 tensor-core peak, ``tf32`` rows at the TF32 tensor-core
  peak, ``float32`` rows at the fp32 (non-tensor-core) peak — the engine samples float32 as IEEE float32, with cuDNN's
  TF32 switched off;
* memory floor = S × 2 × activation elements × element size (4 B fp32, 2 B bf16: each activation written once and read
  once) / copy bandwidth, unfused and fused; the bandwidth is measured at run time on CUDA
  (:func:`measure_copy_bandwidth`), else the card table's figure;
* floor = max(compute floor, memory floor); fused floor = max(compute floor, fused memory floor).

On a CPU, or a card not in :data:`CARDS`, the floors are ``None`` ("—" in the tables); the counts are still made.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class Card:
    """Peak figures of one card: dense FLOP/s per kind of arithmetic and the memory bandwidth the floors use where
    none was measured in the run."""

    name: str
    bf16_flops: float  # tensor cores, bf16/fp16 inputs, fp32 accumulation, dense (no 2:4 sparsity)
    tf32_flops: float  # tensor cores, TF32, dense
    fp32_flops: float  # CUDA cores, no tensor cores
    bandwidth: float  # bytes/s
    bandwidth_source: str
    source: str


# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 / TF32 989 TFLOP/s *with sparsity*, i.e. 989 / 495
# dense; FP32 67 TFLOP/s; HBM3 3.35 TB/s. PCIe: 1,513 / 756 with sparsity, i.e. 756 / 378 dense; FP32 51 TFLOP/s;
# HBM2e 2.0 TB/s); NVIDIA H200 datasheet (SXM: the same compute as the H100 SXM; HBM3e 4.8 TB/s). SPEC §5: ≈ 3 TB/s
# measured copy bandwidth on the H100 SXM (the figure the SPEC's floors use; 3.35 TB/s is the nominal one).
H100_SXM = Card("H100 SXM", 989e12, 495e12, 67e12, 3.0e12, "measured copy bandwidth (SPEC §5; nominal 3.35 TB/s)",
                "NVIDIA H100 datasheet (SXM5), dense")
H100_PCIE = Card("H100 PCIe", 756e12, 378e12, 51e12, 2.0e12, "nominal (HBM2e)", "NVIDIA H100 datasheet (PCIe), dense")
H200_SXM = Card("H200 SXM", 989e12, 495e12, 67e12, 4.8e12, "nominal (HBM3e)", "NVIDIA H200 datasheet (SXM), dense")
CARDS = (H100_SXM, H100_PCIE, H200_SXM)


def card_for(device_name: str | None) -> Card | None:
    """The card of ``torch.cuda.get_device_name()`` (e.g. ``NVIDIA H100 80GB HBM3`` is the SXM H100), or ``None`` for
    a CPU or a card whose figures are not in :data:`CARDS` (the NVL boards run at other clocks)."""
    name = (device_name or "").upper()
    if "NVL" in name:
        return None
    if "H200" in name:
        return H200_SXM
    if "H100" in name:
        return H100_PCIE if "PCIE" in name else H100_SXM
    return None


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device memory bandwidth in bytes/s as ``dst.copy_(src)`` of ``nbytes`` achieves it (read + write counted),
    timed with CUDA events after one warm-up copy; ``None`` off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * repeats / seconds


def measure_normal_rate(device: torch.device, count: int = 1 << 25, repeats: int = 5) -> float:
    """Standard normals per second that torch's generator writes on ``device`` (``Tensor.normal_`` into float32:
    Philox on CUDA, the CPU generator on the CPU), the best of ``repeats`` after a warm-up: the RNG floor of a row
    (every sample draws as many normals as its latent has elements)."""
    device = torch.device(device)
    buffer = torch.empty(count, dtype=torch.float32, device=device)
    buffer.normal_()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.normal_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return count / best


def rng_floor(noise_per_sample: int, samples: int, normal_rate: float) -> dict:
    """The RNG fields of a row: normals per sample, the measured rate and the seconds per image drawing them takes."""
    return dict(noise_per_sample=noise_per_sample, normal_rate=normal_rate,
                rng_floor_s=samples * noise_per_sample / normal_rate)


# ------------------------------------------------------------------------------------------------------ counting
_NORMALIZATIONS = ("batch_norm",)  # aten names containing these: inference BatchNorm (native / cudnn / _legit ...)
_POOLS = ("pool",)  # max_pool2d(_with_indices), avg_pool2d, adaptive_avg_pool2d, ...


def _is_epilogue(func) -> bool:
    name = str(func)
    return (torch.Tag.pointwise in func.tags or any(k in name for k in _NORMALIZATIONS + _POOLS)
            or func is torch.ops.aten.mean.dim)


class _ActivationCounter(TorchDispatchMode):
    """Counts the activation elements an op-by-op forward writes, unfused and fused (module docstring)."""

    def __init__(self):
        super().__init__()
        self.unfused = 0
        self.fused = 0
        self.ops: dict[str, int] = {}  # aten op → elements written (unfused), for the record
        self._chain = None  # the latest output of the open chain
        self._chain_elements = 0

    def _close(self) -> None:
        self.fused += self._chain_elements
        self._chain, self._chain_elements = None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        returns = func._schema.returns
        if not isinstance(first, torch.Tensor) or not returns:
            return out
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if not tensors or first.numel() == 0:  # a factory (``empty`` inside BatchNorm's composite): no activation
            return out
        alias = returns[0].alias_info
        reads_chain = self._chain is not None and any(t is self._chain for t in tensors)
        if alias is not None and not alias.is_write:  # a view: writes nothing; a view of the chain is the chain
            if reads_chain:
                self._chain = first
            return out
        elements = first.numel()
        self.unfused += elements
        key = str(func)
        self.ops[key] = self.ops.get(key, 0) + elements
        if not (reads_chain and _is_epilogue(func)):
            self._close()  # the open chain's last output is written; this op starts a new chain
        self._chain, self._chain_elements = first, elements
        return out

    def __exit__(self, *exc):
        self._close()
        return super().__exit__(*exc)


@dataclass
class Cost:
    """Per-sample cost of ``f_R``'s forward (module docstring: what is counted)."""

    flops: float
    conv_flops: float
    matmul_flops: float
    activation_elements: int
    fused_activation_elements: int
    input_elements: int
    elements_by_op: dict

    def record(self) -> dict:
        return {f"{k}_per_sample" if k != "elements_by_op" else k: v for k, v in asdict(self).items()}


def count_cost(right: nn.Module, sample: torch.Tensor) -> Cost:
    """Count ``right``'s forward on one sample ``[*latent_shape]`` (a copy of it in eval mode; float32, no autocast)."""
    net = copy.deepcopy(right).eval().float()
    x = sample.detach().clone().float().unsqueeze(0)  # a normal tensor (f_L's output may be an inference tensor)
    flop_counter = FlopCounterMode(display=False)
    acts = _ActivationCounter()
    with torch.no_grad(), flop_counter, acts:
        net(x)
    conv = matmul = 0
    for op, flops in flop_counter.get_flop_counts().get("Global", {}).items():
        if "conv" in str(op):
            conv += flops
        else:
            matmul += flops
    return Cost(flops=float(flop_counter.get_total_flops()), conv_flops=float(conv), matmul_flops=float(matmul),
                activation_elements=acts.unfused, fused_activation_elements=acts.fused, input_elements=x.numel(),
                elements_by_op=dict(sorted(acts.ops.items(), key=lambda kv: -kv[1])))


# ------------------------------------------------------------------------------------------------------ floors
ELEMENT_SIZE = {"float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2}


def peak_for(card: Card, precision: str) -> tuple[float, str]:
    """``(FLOP/s, label)``: the dense peak of ``card`` for an ``f_R`` run in ``precision`` (module docstring)."""
    if precision in ("bfloat16", "float16"):
        return card.bf16_flops, f"{precision} {card.bf16_flops / 1e12:.0f} TFLOP/s"
    if precision == "tf32":
        return card.tf32_flops, f"TF32 {card.tf32_flops / 1e12:.0f} TFLOP/s"
    return card.fp32_flops, f"FP32 {card.fp32_flops / 1e12:.0f} TFLOP/s"


def floors(cost: Cost, precision: str, samples: int, card: Card | None, bandwidth: float | None = None,
           rng_floor_s: float = 0.0) -> dict:
    """The floor fields of a row: bytes per sample always; with a known ``card``, the compute floor, the memory floors
    (unfused, fused), the floor and the fused floor in seconds per image of ``samples`` samples. ``bandwidth``: a
    measured copy bandwidth (bytes/s), else the card's figure. ``rng_floor_s``: the seconds per image that drawing the
    noise takes (:func:`rng_floor`); the generator's arithmetic runs on the same units as ``f_R``'s, so it adds to
    the compute floor: floor = max(compute + RNG, memory)."""
    size = ELEMENT_SIZE[precision]
    row = dict(samples_per_image=samples, element_size=size,
               activation_bytes_per_sample=cost.activation_elements * size,
               fused_activation_bytes_per_sample=cost.fused_activation_elements * size,
               card=None, peak=None, bandwidth_Bps=None, bandwidth_source=None, compute_floor_s=None,
               memory_floor_s=None, fused_memory_floor_s=None, floor_s=None, fused_floor_s=None)
    if card is None:
        return row
    peak, label = peak_for(card, precision)
    compute = samples * cost.flops / peak
    measured = bandwidth is not None
    bandwidth = bandwidth if measured else card.bandwidth
    memory = samples * 2 * cost.activation_elements * size / bandwidth
    fused_memory = samples * 2 * cost.fused_activation_elements * size / bandwidth
    row.update(card=card.name, peak=label, bandwidth_Bps=bandwidth,
               bandwidth_source="measured copy_ in this run" if measured else card.bandwidth_source,
               compute_floor_s=compute, memory_floor_s=memory, fused_memory_floor_s=fused_memory,
               floor_s=max(compute + rng_floor_s, memory), fused_floor_s=max(compute + rng_floor_s, fused_memory))
    return row


# The noise kernel, where it must write the noisy batch, at ≥ this fraction of the card's measured copy bandwidth.
WRITE_BANDWIDTH_TARGET = 0.70


def write_bandwidth(bytes_written: int, milliseconds: dict[str, float], copy_bandwidth: float | None) -> dict:
    """The bandwidth fields of a kernel row that writes ``bytes_written`` bytes, for each kernel timed
    (``milliseconds``, e.g. ``{"cuda": 1.2, "triton": 1.1}``): ``{kernel}_write_Bps`` (bytes written ÷ time) and,
    with a measured ``copy_bandwidth`` (bytes/s, :func:`measure_copy_bandwidth`), ``{kernel}_of_copy_bandwidth`` and
    ``write_bandwidth_met``: whether the best kernel reaches :data:`WRITE_BANDWIDTH_TARGET` of it (``None`` without a
    measurement)."""
    row = dict(bytes_written=bytes_written, copy_bandwidth_Bps=copy_bandwidth)
    for kernel, ms in milliseconds.items():
        row[f"{kernel}_write_Bps"] = bytes_written / (ms / 1e3)
        row[f"{kernel}_of_copy_bandwidth"] = row[f"{kernel}_write_Bps"] / copy_bandwidth if copy_bandwidth else None
    row["write_bandwidth_met"] = (max(row[f"{k}_of_copy_bandwidth"] for k in milliseconds) >= WRITE_BANDWIDTH_TARGET
                                  if copy_bandwidth else None)
    return row


__all__ = ["CARDS", "Card", "Cost", "ELEMENT_SIZE", "WRITE_BANDWIDTH_TARGET", "card_for", "count_cost", "floors",
           "measure_copy_bandwidth", "peak_for", "write_bandwidth"]
