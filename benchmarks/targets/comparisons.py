"""The native part of the target table (stage 2 of scripts/gpu_checks.sh): A/B rows of CERTIFY for the settings not
yet decided by a GPU (fused ``f_R`` copy, ``torch.compile``, ``gamma_batch``, the exact bound's pieces, the fused
noise + max-pool kernel, CUDA graphs), then the CUDA kernels of csrc/ against the Triton ones."""
from __future__ import annotations

import contextlib
import json
import time
import traceback

import torch

import splitz_fast as sz
from splitz_fast.bounds.gram import factor_gram
# benchmarks/ is on sys.path (the package's __init__ puts it there): the benchmark modules by bare name
from floor import measure_copy_bandwidth, write_bandwidth

from .measure import Recorder, device_name, error_text, measure_group, synchronize
from .workloads import FULL, QUICK


def _comparison(recorder: Recorder, what: str, settings: dict, speedup_key: str, images: int, device: torch.device,
                quick: bool, deadline: float, precision: str, workload: int = 0, split: int = 1) -> None:
    """One row: CERTIFY of ``(QUICK or FULL)[workload]`` at ``split`` timed under each of ``settings`` (label →
    ``(context manager factory that sets it up, keyword arguments of measure_group)``), in order, and
    ``speedup_key`` = the first setting's time over the second's."""
    chosen = (QUICK if quick else FULL)[workload]
    row = dict(what=f"{chosen.label} s={split} CERTIFY n={chosen.n:,} {precision}: {what}", device=device_name(device),
               images=images)
    try:
        for label, (setting, group_options) in settings.items():
            if time.monotonic() > deadline:
                raise TimeoutError("the part's --budget was spent")
            with setting():
                (measured,) = measure_group(chosen, split, images, device, quick, precisions=(precision,),
                                            naive=False, **group_options)
            if measured.get("status") != "ok":
                raise RuntimeError(measured.get("error"))
            row[f"{label}_s_per_image"] = measured["ours_s_per_image"]
            if measured.get("cuda_graphs"):
                row[f"{label}_cuda_graphs"] = measured["cuda_graphs"]
        first, second = settings
        row.update(status="ok", compared=[first, second], speedup_key=speedup_key,
                   **{speedup_key: row[f"{first}_s_per_image"] / row[f"{second}_s_per_image"]})
    except Exception as exc:
        traceback.print_exc()
        row.update(status="error", error=error_text(exc))
    print("  " + json.dumps(row, default=str), flush=True)
    recorder.add(row)


@contextlib.contextmanager
def _without_auto_triton(op: str):
    """``op`` out of ``AUTO_TRITON_OPS`` for the block (``auto`` runs its reference on CUDA)."""
    import splitz_fast.kernels as kernels

    default = kernels.AUTO_TRITON_OPS
    kernels.AUTO_TRITON_OPS = default - {op}
    try:
        yield
    finally:
        kernels.AUTO_TRITON_OPS = default


def run_fused_pool(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 1 CERTIFY with f_R's leading 2x2 max pool drawn by the fused Triton noise kernel (``auto`` on CUDA)
    against the pool run in f_R (``noisy_latents_maxpool2`` taken out of ``AUTO_TRITON_OPS`` for the row): the
    measurement behind ``auto``'s choice. Same samples, same votes."""
    for precision in ("tf32", "bfloat16"):
        _comparison(recorder, "fused noise + max pool (Triton) vs pool in f_R",
                    {"unfused": (lambda: _without_auto_triton("noisy_latents_maxpool2"), {}),
                     "fused": (contextlib.nullcontext, {})},
                    "fused_speedup", images, device, quick, deadline, precision)


# (workload index, split, precision) of the fused-kernel comparison: LeNet (its conv + ReLU + pool layers as one Triton
# kernel) at both splits, then the ResNets (conv + bias + ReLU (+ shortcut) as one cuDNN call).
FUSED_COMPARISONS = ((0, 0, "bfloat16"), (0, 0, "tf32"), (0, 1, "bfloat16"), (1, 0, "bfloat16"), (1, 0, "tf32"),
                     (2, 0, "bfloat16"))


def run_fused_kernels_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """CERTIFY (:data:`FUSED_COMPARISONS`) through the plain prepared ``f_R`` (``fused_kernels=False``) against its
    fused copy (``fused_kernels=True``: :mod:`splitz_fast.sampling.epilogues`): what the default's run-time measurement
    (``fused_kernels=None``, recorded in stage 1's rows) should agree with. On the CPU, where nothing fuses, both
    settings sample the plain ``f_R`` (a smoke test of the row)."""
    forced = True if device.type == "cuda" else None
    for workload, split, precision in FUSED_COMPARISONS:
        _comparison(recorder, "fused kernels vs plain f_R",
                    {"plain_kernels": (contextlib.nullcontext, {"fused_kernels": False}),
                     "fused_kernels": (contextlib.nullcontext, {"fused_kernels": forced})},
                    "fused_kernels_speedup", images, device, quick, deadline, precision, workload, split)


# (workload index, split) of the CUDA graph comparison: the launch-bound LeNet at both splits, the deep ResNet-110.
GRAPH_COMPARISONS = ((0, 0), (0, 1), (1, 0))


def run_graph_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """CERTIFY with ``f_R`` eager (``cuda_graphs=False``) against replayed CUDA graphs (``cuda_graphs=True``) on the
    workloads of :data:`GRAPH_COMPARISONS` with a bf16 ``f_R`` (the fastest, so the most launch-bound): what the
    default's run-time measurement should agree with (the same votes either way)."""
    for workload, split in GRAPH_COMPARISONS:
        for precision in ("bfloat16",):
            _comparison(recorder, "CUDA graph vs eager f_R",
                        {"eager": (contextlib.nullcontext, {"cuda_graphs": False}),
                         "graph": (contextlib.nullcontext, {"cuda_graphs": True})},
                        "graph_speedup", images, device, quick, deadline, precision, workload, split)


def run_compile_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 0 CERTIFY (bf16) with ``f_R`` through ``torch.compile`` (static batch shapes; compilation in the
    warm-up, excluded) against eager: whether Inductor's fused pointwise and pool kernels close part of the gap to the
    fused memory floor, which eager cuDNN leaves (28x it on an H100)."""
    _comparison(recorder, "torch.compile vs eager f_R",
                {"eager": (contextlib.nullcontext, {"compile": False}),
                 "compiled": (contextlib.nullcontext, {"compile": True})},
                "compile_speedup", images, device, quick, deadline, "bfloat16", 0, 0)


def run_gamma_batch_comparison(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """LeNet s = 1 CERTIFY (bf16) with the classic bisection (``gamma_batch = 2``: one bound per pass, 5 passes)
    against ``gamma_batch = 4`` (three bounds per batched pass, 3 passes; never a smaller radius): fewer sequential
    passes and host synchronisations of the radius search against more bounds per pass."""
    _comparison(recorder, "gamma_batch 4 vs 2 (bisection)",
                {"bisection": (contextlib.nullcontext, {}),
                 "gamma_batch_4": (contextlib.nullcontext, {"bound_options": {"gamma_batch": 4}})},
                "gamma_batch_speedup", images, device, quick, deadline, "bfloat16")


@contextlib.contextmanager
def _dense_estimator(name: str):
    """``certificate.DEVICE_DENSE_ESTIMATOR = name`` for the block (what a GPU measurement would decide)."""
    import splitz_fast.bounds.certificate as certificate

    default = certificate.DEVICE_DENSE_ESTIMATOR
    certificate.DEVICE_DENSE_ESTIMATOR = name
    try:
        yield
    finally:
        certificate.DEVICE_DENSE_ESTIMATOR = default


def exact_bound_case(device: torch.device, repeats: int = 10) -> dict:
    """One exact bound of LeNet's first layer on the device (the masked Gram of d = 784 at γ = 0.5 on an MNIST-sized
    input): milliseconds of ``certified_lambda_max`` with each dense device estimate (median of ``repeats``), and how
    far apart the two proven bounds are."""
    from splitz_fast.bounds.lipschitz import masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    x = torch.rand(1, 1, 28, 28, device=device)
    bounds = sz.ball_bounds(left, x, 0.5)
    gram, terms = factor_gram(masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0], 0, sparse=False)
    row = dict(what=f"exact bound, LeNet conv1 Gram (d = {gram.shape[0]}): squaring vs eigvalsh estimate",
               device=device_name(device))
    values = {}
    for estimator in ("eigvalsh", "squaring"):
        with _dense_estimator(estimator):
            times = []
            for _ in range(repeats + 1):  # the first call loads the solver libraries and compiles nothing timed
                synchronize(device)
                start = time.perf_counter()
                values[estimator] = sz.certified_lambda_max(gram, terms)
                synchronize(device)
                times.append(time.perf_counter() - start)
            row[f"{estimator}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    row.update(status="ok", compared=["eigvalsh", "squaring"], speedup_key="squaring_vs_eigvalsh",
               squaring_vs_eigvalsh=row["eigvalsh_ms"] / row["squaring_ms"],
               bound_relative_difference=abs(values["squaring"] - values["eigvalsh"]) / values["eigvalsh"])
    return row


def gram_build_case(device: torch.device, repeats: int = 10) -> dict:
    """The masked Gram of LeNet's first layer (d = 784 at γ = 0.5, as :func:`exact_bound_case`) built with its half
    stencil gathered in one pass against summed tap by tap (``gram.GATHERED_STENCIL_DEVICES``): milliseconds per Gram
    (median of ``repeats``), and whether the two Grams agree to rounding."""
    from splitz_fast.bounds import gram as grams
    from splitz_fast.bounds.lipschitz import masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    x = torch.rand(1, 1, 28, 28, device=device)
    bounds = sz.ball_bounds(left, x, 0.5)
    op = masked_operators(left, bounds, (1, 28, 28), 1, bounds.input_scale)[0]
    row = dict(what="LeNet conv1 Gram built: gathered stencil vs tap by tap", device=device_name(device))
    built, default = {}, grams.GATHERED_STENCIL_DEVICES
    try:
        for label, devices in (("tapwise", frozenset()), ("gathered", frozenset({device.type}))):
            grams.GATHERED_STENCIL_DEVICES = devices
            times = []
            for _ in range(repeats + 1):  # the first call builds the gather's index (cached)
                synchronize(device)
                start = time.perf_counter()
                built[label] = factor_gram(op, 0, sparse=False)[0]
                synchronize(device)
                times.append(time.perf_counter() - start)
            row[f"{label}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    finally:
        grams.GATHERED_STENCIL_DEVICES = default
    difference = float((built["gathered"] - built["tapwise"]).abs().max() / built["tapwise"].abs().max())
    row.update(status="ok", compared=["tapwise", "gathered"], speedup_key="gathered_vs_tapwise",
               gathered_vs_tapwise=row["tapwise_ms"] / row["gathered_ms"], gram_relative_difference=difference)
    return row


def batched_bound_case(device: torch.device, repeats: int = 10) -> dict:
    """The Grams of one radius-search round (LeNet conv1 for 2 inputs at 3 γ's each): milliseconds of certifying them
    together (``certified_lambda_max_many``) and one by one (``certified_lambda_max`` each), median of ``repeats``,
    and how far apart the two sets of proven bounds are."""
    from splitz_fast.bounds.certificate import certified_lambda_max_many
    from splitz_fast.bounds.lipschitz import masked_operators

    torch.manual_seed(0)
    left = sz.lenet(split_index=1).left.to(device)
    xs = torch.rand(2, 1, 28, 28, device=device)
    grams = []
    for gamma in (0.2, 0.4, 0.6):
        bounds = sz.ball_bounds(left, xs, gamma)
        op = masked_operators(left, bounds, (1, 28, 28), 2, bounds.input_scale)[0]
        grams += [factor_gram(op, b) for b in range(2)]
    row = dict(what=f"exact bounds of one search round ({len(grams)} LeNet conv1 Grams): batched vs one by one",
               device=device_name(device))
    ways = {"batched": lambda: certified_lambda_max_many([g for g, _ in grams], [t for _, t in grams]),
            "one_by_one": lambda: [sz.certified_lambda_max(g, t) for g, t in grams]}
    values = {}
    for name, certify in ways.items():
        times = []
        for _ in range(repeats + 1):  # the first call loads the solver libraries
            synchronize(device)
            start = time.perf_counter()
            values[name] = certify()
            synchronize(device)
            times.append(time.perf_counter() - start)
        row[f"{name}_ms"] = 1e3 * sorted(times[1:])[repeats // 2]
    row.update(status="ok", compared=["one_by_one", "batched"], speedup_key="batched_vs_one_by_one",
               batched_vs_one_by_one=row["one_by_one_ms"] / row["batched_ms"],
               bound_relative_difference=max(abs(a - b) / b for a, b in zip(values["batched"], values["one_by_one"])))
    return row


@contextlib.contextmanager
def _certificates_one_by_one():
    """The radius search's exact factors certified one Gram at a time (as before they were batched)."""
    import splitz_fast.bounds.certificate as certificate
    import splitz_fast.bounds.lipschitz as lipschitz  # where the radius search's bounds read certified_lambda_max_many

    batched = lipschitz.certified_lambda_max_many
    lipschitz.certified_lambda_max_many = lambda grams, terms, estimator="auto": [
        certificate.certified_lambda_max(g, t, estimator) for g, t in zip(grams, terms)]
    try:
        yield
    finally:
        lipschitz.certified_lambda_max_many = batched


def run_bound_comparisons(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    """The exact bound on CUDA: one bound with the squaring vs the eigvalsh estimate (``DEVICE_DENSE_ESTIMATOR``), a
    round's Grams certified together vs one by one, then LeNet s = 1 CERTIFY (bf16) with batched vs one-by-one
    certificates."""
    for case in (gram_build_case, exact_bound_case, batched_bound_case):
        row = dict(what=case.__name__, device=device_name(device))
        try:
            row = case(device)
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)
    _comparison(recorder, "exact bounds of a round one by one vs batched",
                {"one_by_one": (_certificates_one_by_one, {}), "batched": (contextlib.nullcontext, {})},
                "batched_speedup", images, device, quick, deadline, "bfloat16")


def run_native(recorder: Recorder, images: int, device: torch.device, quick: bool, deadline: float):
    if device.type != "cuda":
        recorder.add(dict(what="native CUDA vs Triton", status="skipped", error="needs CUDA"))
        return
    # the undecided settings first (a part stopped by its budget keeps the rows it finished)
    run_fused_kernels_comparison(recorder, images, device, quick, deadline)
    run_compile_comparison(recorder, images, device, quick, deadline)
    run_gamma_batch_comparison(recorder, images, device, quick, deadline)
    run_bound_comparisons(recorder, images, device, quick, deadline)
    run_fused_pool(recorder, images, device, quick, deadline)
    run_graph_comparison(recorder, images, device, quick, deadline)
    from splitz_fast.kernels.native_cuda import cuda_native_available

    start = time.perf_counter()
    available = cuda_native_available()  # builds csrc/noise_votes_cuda.cu on first use (unless stage 2a did)
    recorder.add(dict(what="build or load csrc/noise_votes_cuda.cu", status="ok" if available else "error",
                      seconds=time.perf_counter() - start))
    if not available:
        return
    from test_bench_kernels import CUDA_KERNEL_CASES, cuda_kernel_case

    bandwidth = measure_copy_bandwidth(device)  # what the noise kernels' write bandwidth is a fraction of
    for case in CUDA_KERNEL_CASES:
        row = dict(what=f"kernel: {case}", device=device_name(device))
        try:
            result = cuda_kernel_case(case, 1000 if quick else 10_000)
            result.pop("run")  # the timed callable (pytest-benchmark's round)
            row.update(result, status="ok")
            if "bytes_written" in result:
                row.update(write_bandwidth(result["bytes_written"], dict(cuda=result["cuda_ms"],
                                                                         triton=result["triton_ms"]), bandwidth))
        except Exception as exc:
            traceback.print_exc()
            row.update(status="error", error=error_text(exc))
        print("  " + json.dumps(row, default=str), flush=True)
        recorder.add(row)
