"""The GPU smoke stage: every GPU-only path once, on small shapes, before anything long runs on a lent GPU.

Each check is one ``gpu`` test of the suite (the path against its reference), run in a child pytest process that
writes one verdict line the moment the check ends, flushed to disk: ``ok``, ``wrong`` (an assertion failed: the
assertion's message, which names the difference), ``failed`` (any other exception: where it was raised), ``skipped``
(why) or ``timed out``. Every check has a watchdog of its own: when its limit passes, ``faulthandler`` writes every
thread's stack and ends the child; the harness records the check as timed out with those stacks and starts a new child
for the checks after it. So a kernel that hangs costs its limit, not the stage, and a path that falls back to eager
inside the library still shows up here as the test's failure, not as a silent slowdown.

Run: ``python -m benchmarks.smoke --out DIR`` (stage 0b of scripts/gpu_checks.sh); DIR/smoke.jsonl gets one JSON object
per check (``name``, ``test``, ``verdict``, ``seconds``, ``detail``). Other node ids than :data:`SMOKE` may be given
(``--test NODEID``, each with the default limit). Loaded with ``-p benchmarks.smoke`` the same module is the child's
plugin: it reads the checks' names and limits and the output path from the environment the harness sets.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIMIT_S = 30
# name -> (the gpu test that checks the path against its reference, its watchdog limit in seconds)
SMOKE = {
    "conv+ReLU+pool Triton kernel, autotuned, at a sampling batch":
        ("tests/kernels/test_kernels_conv_relu_pool.py::test_kernel_at_a_sampling_batch_in_every_precision", 60),
    "cuDNN fused conv+bias+ReLU":
        ("tests/sampling/test_epilogues.py::test_fused_cudnn_calls_match_the_unfused_kernels[False-float32]", 30),
    "cuDNN fused conv+bias+add+ReLU":
        ("tests/sampling/test_epilogues.py::test_fused_cudnn_calls_match_the_unfused_kernels[True-float32]", 30),
    "CUDA graph capture and replay":
        ("tests/sampling/test_graphs.py::test_replay_scores_what_is_in_the_input_buffer_like_eager[float32]", 30),
    "compiled f_R (compile=None after the threshold)":
        ("tests/sampling/test_compiled.py::test_compile_none_on_cuda_compiles_after_the_threshold_and_certifies_like_eager"
         "[None]", 90),
    "fused noise + 2x2 pool, Triton":
        ("tests/kernels/test_kernels_noise_votes.py::test_pooled_draw_is_the_unfused_draw_max_pooled"
         "[triton-cuda-dtype0-shape0-5-1099511627779-11]", 30),
    "noise, Triton": ("tests/kernels/test_kernels_noise_votes.py::test_every_backend_draws_the_reference_stream"
                      "[triton-cuda-0-shape0-False]", 30),
    "votes, Triton": ("tests/kernels/test_kernels_noise_votes.py::test_count_votes_matches_argmax_bincount"
                      "[triton-cuda-count_dtype0-dtype0-3-37]", 30),
    "noise, native CUDA": ("tests/kernels/test_native_cuda.py::test_cuda_noise_matches_triton_and_reference_on_engine_shapes"
                           "[dtype0-shape0-True]", 90),
    "votes, native CUDA": ("tests/kernels/test_native_cuda.py::test_cuda_votes_on_large_batches_and_many_classes"
                           "[300000-10]", 30),
    "exact bound on CUDA (squaring certificate) vs the CPU certificate":
        ("tests/bounds/test_lipschitz.py::test_exact_bound_on_cuda_matches_the_cpu_certificate[0-auto]", 20),
    "certify_many on CUDA, radius searches overlapped on a side stream":
        ("tests/certify/test_host_syncs.py::test_certify_many_on_cuda_matches_one_by_one_up_to_batch_rounding", 60),
    "host synchronisations of certify_many": (
        "tests/certify/test_host_syncs.py::test_host_syncs_per_image_do_not_grow_with_the_model_or_the_batches", 60),
    "f_L in IEEE float32 on CUDA":
        ("tests/certify/test_model_as_run.py::test_the_latent_on_cuda_is_ieee_float32_even_with_tf32_enabled", 20),
}
_OUT_ENV, _CHECKS_ENV, _STACKS_ENV = "SPLITZ_SMOKE_OUT", "SPLITZ_SMOKE_CHECKS", "SPLITZ_SMOKE_STACKS"


# ---------------------------------------------------------------------------------------------- the child's plugin
def _write(line: dict) -> None:
    """Append one verdict to the output file and make it durable at once (a watchdog may end the process next)."""
    with open(os.environ[_OUT_ENV], "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
        out.flush()
        os.fsync(out.fileno())
    # on a line of its own: pytest -q writes its progress characters without a newline
    print(f"\nSMOKE {line['verdict']:9} {line['seconds']:6.1f} s  {line['name']}: {line['detail'][:200]}", flush=True)


_started: dict[str, float] = {}
_stacks = None


def pytest_runtest_setup(item) -> None:
    global _stacks
    if _OUT_ENV not in os.environ:
        return
    limit = json.loads(os.environ[_CHECKS_ENV]).get(item.nodeid, [item.nodeid, DEFAULT_LIMIT_S])[1]
    _stacks = _stacks or open(os.environ[_STACKS_ENV], "w", encoding="utf-8")
    _stacks.write(f"--- {item.nodeid}\n")
    _stacks.flush()
    _started[item.nodeid] = time.perf_counter()
    faulthandler.dump_traceback_later(limit, exit=True, file=_stacks)


def pytest_runtest_teardown(item) -> None:
    if _OUT_ENV in os.environ:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report) -> None:
    """One verdict per test: from its call, or from its setup where that failed or skipped."""
    if _OUT_ENV not in os.environ or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    name = json.loads(os.environ[_CHECKS_ENV]).get(report.nodeid, [report.nodeid])[0]
    now = time.perf_counter()
    seconds = now - _started.get(report.nodeid, now)  # 0 for a check skipped before its setup hook ran
    if report.passed:
        verdict, detail = "ok", ""
    elif report.skipped:
        verdict, detail = "skipped", str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        verdict = "wrong" if message.startswith(("AssertionError", "assert")) else "failed"
        where = f" ({crash.path}:{crash.lineno})" if crash is not None else ""
        detail = message.strip() + where
    _write({"name": name, "test": report.nodeid, "verdict": verdict,
            "seconds": round(seconds, 3), "detail": detail})


# ---------------------------------------------------------------------------------------------- the harness
def run_checks(checks: dict[str, tuple[str, float]], out: Path, *, python: str = sys.executable,
               rootdir: Path = ROOT, budget_s: float = 600) -> list[dict]:
    """Run every check (name -> (pytest node id, limit in seconds)) and return their verdicts in order; each is
    appended to ``out/smoke.jsonl`` as it ends. A child that stops before its checks are done (its watchdog fired, or
    it crashed) leaves the check it was running recorded as ``timed out`` (with every thread's stack) or ``failed``
    (:func:`_stopped_in`), and a new child runs the rest. Checks still waiting when ``budget_s`` is spent are
    recorded as not run."""
    out.mkdir(parents=True, exist_ok=True)
    results, stacks = out / "smoke.jsonl", out / "smoke-stacks.txt"
    results.write_text("")
    tests = {test: (name, limit) for name, (test, limit) in checks.items()}
    waiting, deadline = list(tests), time.monotonic() + budget_s
    env = dict(os.environ, **{_OUT_ENV: str(results), _STACKS_ENV: str(stacks),
                              _CHECKS_ENV: json.dumps(tests),
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    while waiting and time.monotonic() < deadline:
        command = [python, "-m", "pytest", "-q", "-p", "benchmarks.smoke", "-p", "no:cacheprovider", "--rootdir",
                   str(rootdir), *waiting]
        try:
            returncode = subprocess.run(command, cwd=rootdir, env=env,
                                        timeout=max(1.0, deadline - time.monotonic()) + 30).returncode
        except subprocess.TimeoutExpired:  # past the stage's budget (the child is killed): what it wrote stands
            returncode = -9
        done = {line["test"] for line in _read(results)}
        unfinished = [test for test in waiting if test not in done]
        if unfinished:
            _append(results, _stopped_in(unfinished[0], tests[unfinished[0]], stacks, returncode))
            unfinished.pop(0)
        waiting = unfinished
    for test in waiting:
        _append(results, {"name": tests[test][0], "test": test, "verdict": "not run", "seconds": 0.0,
                          "detail": f"the stage's {budget_s:.0f} s were spent"})
    by_test = {line["test"]: line for line in _read(results)}
    return [by_test[test] for test in tests if test in by_test]


def _stopped_in(test: str, name_limit: tuple[str, float], stacks: Path, returncode: int) -> dict:
    """The verdict of the check a child did not finish: its watchdog fired (a stack was written after the check's
    header), the process died in it, or pytest never ran it (no header: an unknown node id)."""
    name, limit = name_limit
    stack = _stack_of(stacks, test)
    if stack:
        verdict, seconds, detail = "timed out", limit, f"after {limit} s; every thread's stack:\n{stack}"
    elif f"--- {test}\n" in (stacks.read_text(encoding="utf-8") if stacks.exists() else ""):
        verdict, seconds, detail = "failed", 0.0, f"the test process ended with rc {returncode} inside this check"
    else:
        verdict, seconds, detail = "failed", 0.0, f"pytest did not run it (rc {returncode}: no such test?)"
    return {"name": name, "test": test, "verdict": verdict, "seconds": seconds, "detail": detail}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _append(path: Path, line: dict) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    print(f"SMOKE {line['verdict']:9} {line['seconds']:6.1f} s  {line['name']}: {line['detail'][:200]}", flush=True)


def _stack_of(stacks: Path, test: str) -> str:
    """What the watchdog wrote while ``test`` ran (empty when it did not fire)."""
    text = stacks.read_text(encoding="utf-8") if stacks.exists() else ""
    part = text.rpartition(f"--- {test}\n")[2] if f"--- {test}\n" in text else ""
    return part.split("\n--- ", 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-out"), help="folder for smoke.jsonl (default gpu-out)")
    parser.add_argument("--budget", type=float, default=120, help="seconds for the whole stage (default 120)")
    parser.add_argument("--test", action="append", default=[], metavar="NODEID",
                        help="check this pytest node id instead of the default list (repeatable)")
    args = parser.parse_args(argv)
    checks = {test: (test, DEFAULT_LIMIT_S) for test in args.test} or SMOKE
    verdicts = run_checks(checks, args.out, budget_s=args.budget)
    counts = {v: sum(line["verdict"] == v for line in verdicts) for v in dict.fromkeys(d["verdict"] for d in verdicts)}
    print("SMOKE summary: " + ", ".join(f"{n} {v}" for v, n in counts.items()), flush=True)
    return 0 if all(line["verdict"] in ("ok", "skipped") for line in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
