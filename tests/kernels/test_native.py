"""The native (C++) kernels of csrc/: they build where a compiler exists, do not depend on the thread count, and
their absence degrades to the reference path with one clear warning — never a crash. Their values are checked
against the references in tests/kernels/test_kernels_noise_votes.py (every noise test runs on the native kernel too)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from splitz_fast.kernels import select_backend
from splitz_fast.kernels.native import NATIVE_ENV, native_available
from splitz_fast.kernels.noise import noisy_latents_native, noisy_latents_reference

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_native_kernels_build_where_a_compiler_exists():
    if os.environ.get(NATIVE_ENV) == "0":
        pytest.skip(f"{NATIVE_ENV}=0 turns the native kernels off")
    assert native_available(), "csrc/ did not build although a C++ compiler exists (see the warning)"
    assert select_backend("noisy_latents", torch.device("cpu")) == "native"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_draws_do_not_depend_on_the_thread_count():
    if not native_available():
        pytest.skip("native kernels unavailable")
    latent = torch.randn(8, 10, 10)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(noisy_latents_native(latent, 37, 0.5, 9, 5, channels_last=True))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_native_launcher_refuses_non_cpu_tensors_and_bad_arguments():
    if not native_available():
        pytest.skip("native kernels unavailable")
    latent = torch.randn(3, 4)
    with pytest.raises(ValueError, match="sigma"):
        noisy_latents_native(latent, 2, float("nan"), 1, 0)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        noisy_latents_native(latent, 2, 1.0, 1, 2**64 // 12 - 1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            noisy_latents_native(latent.cuda(), 2, 1.0, 1, 0)


def test_without_a_compiler_the_reference_path_runs_after_one_warning(tmp_path):
    """A fresh process with the compiler hidden (CXX points nowhere, empty extension cache): one RuntimeWarning that
    says what to install, the reference dispatch, and certification still works (torch generator stream)."""
    script = textwrap.dedent("""
        import warnings, torch
        import splitz_fast as sz
        from splitz_fast.kernels import select_backend
        from splitz_fast.sampling.engine import NoiseStream
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert select_backend("noisy_latents", torch.device("cpu")) == "reference"
            assert select_backend("noisy_latents", torch.device("cpu")) == "reference"
            assert NoiseStream(0, "cpu").source == "torch-cpu"
        messages = [str(w.message) for w in caught if "native CPU kernels" in str(w.message)]
        assert len(messages) == 1, messages
        assert "C++ compiler" in messages[0] and "reference" in messages[0], messages[0]
        print("OK")
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop(NATIVE_ENV, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_native_matches_reference_on_a_lenet_sized_latent():
    """The shape the engine draws most (LeNet split 1, 32 x 28 x 28, channels_last): native = reference stream."""
    if not native_available():
        pytest.skip("native kernels unavailable")
    latent = torch.randn(32, 28, 28)
    native = noisy_latents_native(latent, 3, 0.25, 2**63 + 5, 7, channels_last=True)
    reference = noisy_latents_reference(latent, 3, 0.25, 2**63 + 5, 7, channels_last=True)
    assert native.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(native, reference, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(32, 28, 28), (3, 4, 6), (1, 2, 2)])
def test_fused_max_pool_equals_pooling_the_noisy_batch(shape, dtype):
    """max_pool2d(noisy_latents_triton(...), 2) drawn in one pass: bitwise the same values (same float32 sums, the max
    commutes with the monotone cast), channels_last, and the PyTorch reference within float32 rounding."""
    if not native_available():
        pytest.skip("native kernels unavailable")
    from splitz_fast.kernels.noise import noisy_latents_maxpool2_native, noisy_latents_maxpool2_reference

    latent = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    fused = noisy_latents_maxpool2_native(latent, 5, 0.5, 2**40 + 3, 11, dtype)
    pooled = torch.nn.functional.max_pool2d(noisy_latents_native(latent, 5, 0.5, 2**40 + 3, 11, dtype,
                                                                 channels_last=True), 2)
    assert fused.is_contiguous(memory_format=torch.channels_last) and fused.dtype == dtype
    assert torch.equal(fused, pooled)
    reference = noisy_latents_maxpool2_reference(latent, 5, 0.5, 2**40 + 3, 11, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_fused_max_pool_propagates_nan_and_refuses_odd_sizes():
    if not native_available():
        pytest.skip("native kernels unavailable")
    from splitz_fast.kernels.noise import noisy_latents_maxpool2_native

    latent = torch.randn(4, 6, 6)
    latent[1, 2, 3] = float("nan")
    fused = noisy_latents_maxpool2_native(latent, 3, 0.5, 1, 0)
    assert fused[:, 1, 1, 1].isnan().all() and fused.isnan().sum() == 3  # the window (rows 2-3, cols 2-3) of channel 1
    with pytest.raises(ValueError, match="even"):
        noisy_latents_maxpool2_native(torch.randn(4, 5, 6), 3, 0.5, 1, 0)


def test_no_extension_builder_import_unless_something_is_built():
    """Importing torch.utils.cpp_extension prints torch's "No CUDA runtime is found, using CUDA_HOME=..." on machines
    with a CUDA toolkit but no GPU; splitz_fast imports it only to build. Here: `import splitz_fast`, `splitz --help`
    and loading already-built native modules from torch's cache, each in a fresh process."""
    built = HAS_COMPILER and os.environ.get(NATIVE_ENV) != "0" and native_available("noisy_latents") and \
        native_available("conv_power")  # built into the cache by this process, if they can be
    load = ("from splitz_fast.kernels import native; assert native.native_module() is not None; "
            "assert native.train_module() is not None; " if built else "")
    script = textwrap.dedent(f"""
        import sys
        import splitz_fast
        from splitz_fast.cli.main import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        {load}
        print("builder imported:", "torch.utils.cpp_extension" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "builder imported: False" in done.stdout and "No CUDA runtime" not in done.stderr, done.stderr


def _finished_build_copy(root, module) -> str:
    """A copy of a finished build of ``module`` (its library alone, no lock file) in the cache folder ``root``: as a
    build leaves it under torch's older builder, which deletes its lock file when done."""
    from splitz_fast.kernels import native

    name = module.__name__
    (root / name).mkdir(parents=True)
    shutil.copy(module.__file__, root / name / os.path.basename(module.__file__))
    assert native.extensions_root() == root
    return name


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_loading_a_finished_build_never_creates_the_builders_lock_file(tmp_path, monkeypatch):
    """torch 2.11's builder (the GPU machines') creates ``lock`` to build and deletes it when done, and waits forever
    while it exists: a loader that created it (an OS file lock does) hung every later build of that name, e.g. the
    second torchrun rank that found the first one loading. Loading must leave no file behind, and torch's older lock
    must still be free."""
    from torch.utils.file_baton import FileBaton

    from splitz_fast.kernels import native

    if os.environ.get(NATIVE_ENV) == "0" or native.native_module() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = _finished_build_copy(tmp_path, native.native_module())
    assert native.load_built(name) is not None
    lock = tmp_path / name / "lock"
    assert not lock.exists()
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # what the older builder does first: it would build (a no-op), not wait
    baton.release()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_a_build_in_progress_is_left_to_the_builder(tmp_path, monkeypatch):
    """While a newer torch builder holds its OS lock on ``lock`` (it may be rewriting the library), the loader does not
    import the library: ``None``, and ``cpp_extension.load`` waits for the build. A ``lock`` file nobody holds (left by
    a finished newer build) does not stop it."""
    from filelock import FileLock

    from splitz_fast.kernels import native

    if os.environ.get(NATIVE_ENV) == "0" or native.train_module() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = _finished_build_copy(tmp_path, native.train_module())
    with FileLock(str(tmp_path / name / "lock")):
        assert native.load_built(name) is None
    assert (tmp_path / name / "lock").exists()
    assert native.load_built(name) is not None


@pytest.mark.parametrize("older_builder", [True, False])
def test_a_leftover_lock_file_is_named_before_torchs_older_builder_waits_on_it(tmp_path, monkeypatch, older_builder):
    """torch 2.11's builder waits silently for as long as the cache folder's ``lock`` file exists, and an interrupted
    build never removes it: the loader names the file and what to do before handing over. The newer builder (an OS
    lock; the file stays after every build) gets no warning."""
    import warnings

    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    from splitz_fast.kernels import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    if older_builder:
        monkeypatch.setattr(cpp_extension, "FileBaton", FileBaton, raising=False)
    else:
        monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)
    built = object()
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built)  # the build itself is not under test
    lock = tmp_path / native._build_name(native.csrc_dir()) / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native._load(native.SOURCES) is built
    named = [w for w in caught if str(lock) in str(w.message)]
    assert len(named) == (1 if older_builder else 0), [str(w.message) for w in caught]
    if older_builder:
        assert "delete that file" in str(named[0].message)


def _largest_pause_of_python_while(run) -> tuple[float, float]:
    """``(longest stretch without a step of a Python loop on this thread, seconds run() took on another thread)``:
    a native call that holds the GIL stops this thread's Python for as long as the call runs."""
    import threading
    import time

    started, took = threading.Event(), []

    def worker():
        started.set()
        start = time.perf_counter()
        run()
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=worker)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, this loop on the other
    try:
        thread.start()
        started.wait()
        last, pause = time.perf_counter(), 0.0
        while thread.is_alive():
            now = time.perf_counter()
            pause, last = max(pause, now - last), now
        thread.join()
    finally:
        torch.set_num_threads(before)
    return pause, took[0]


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("op", ["noisy_latents", "conv_relu_maxpool2"])
def test_native_kernels_release_the_gil_while_they_run(op):
    """The sampling engine runs its CPU batches on several worker threads; a kernel that held the GIL would run them
    one at a time (measured: the second core then gave nothing to the conv + pool kernel). While one long call runs on
    another thread, this thread's Python keeps running: its longest pause is a small part of the call. (The noise
    call writes 260 MB: long enough to tell.)"""
    if not native_available(op):
        pytest.skip("native kernels unavailable")
    if op == "noisy_latents":
        latent = torch.zeros(16, 32, 32)
        run = lambda: noisy_latents_native(latent, 4000, 1.0, 0, 0)  # noqa: E731 — 65 M normals
    else:
        from splitz_fast.kernels.conv_relu_pool import conv_relu_maxpool2_native

        x, weight = torch.rand(200, 64, 28, 28), torch.randn(32, 64, 3, 3)
        run = lambda: conv_relu_maxpool2_native(x, weight, None, (1, 1))  # noqa: E731
    run()  # built and warm
    pause, took = _largest_pause_of_python_while(run)
    assert took > 0.05, f"the call took {took:.3f} s: too short to tell"
    # released: pauses of about 0.1 ms here; held: the C++ part of the call, half or more of it
    assert pause < 0.25 * took, f"Python paused {pause:.3f} s of the {took:.3f} s call: the kernel holds the GIL"
