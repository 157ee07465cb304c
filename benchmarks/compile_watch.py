"""Whether a timed region compiled or autotuned anything: benchmarks/targets/ times a row only after its warm-up,
and records here what the timed run still compiled (``compiled_in_timed_region`` and the counts behind it).

Observed in a region (:class:`CompileCounter`), the same way on torch 2.11 / triton 3.6 and torch 2.14 / triton 3.8:

* **dynamo compiles**: ``torch._dynamo.utils.counters["frames"]["total"]`` (one per frame dynamo converts: a first
  compile or a recompile after a guard failure; cache hits do not count) and ``counters["stats"]["unique_graphs"]``
  (graphs handed to the backend, where Inductor generates and autotunes its kernels);
* **Triton JIT compiles**: calls of ``triton.runtime.jit.JITFunction._do_compile``, which a ``@triton.jit`` kernel
  reaches exactly when its in-memory cache misses (a new specialization: compiled, or loaded from the on-disk cache),
  counted by a wrapper installed on the class once per process (free on the hot path, which never calls it);
* **Triton cache files**: entries that appeared in Triton's cache directory (``triton.knobs.cache.dir``, else
  ``TRITON_CACHE_DIR`` or ``~/.triton/cache``) — fresh compiles anywhere, also in Inductor's compile workers. Counted
  towards the flag on CUDA only (no kernel of this process compiles on a CPU; other processes may share the
  directory).

cuDNN's benchmark-mode autotuning (the engine turns ``cudnn.benchmark`` on while sampling) cannot be observed: it runs
once per new convolution configuration, i.e. per new ``f_R`` input batch shape, dtype and layout. So
:class:`BatchShapes` records every batch the engine feeds ``f_R`` (shape, dtype, strides), from the batch-size
measurement and the warm-up on; a configuration first seen in the timed region means cuDNN may have autotuned there,
and counts as a compilation. The shapes are static after the warm-up: without ``compile`` the engine's batches are
full batches and the tail of each sampling window, and a window is one input wherever n0 + n samples fill
``WINDOW_BATCHES`` batches (every full-size workload), so one warm-up input sees them all; where a window holds
several inputs, benchmarks/targets/measure.py warms up on the timed set's own windows (the same inputs, other
seeds) as well.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch
import torch._dynamo.utils as _dynamo_utils  # imported here, not inside a timed region

_TRITON_LOCK = threading.Lock()


def _install_triton_counter() -> bool:
    """Wrap ``JITFunction._do_compile`` once per process so each call is counted (in the wrapper's ``calls``, so that
    every copy of this module reads the same count); ``False`` without Triton."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 — no Triton on this stack
        return False
    original = JITFunction.__dict__.get("_do_compile")
    if original is None:
        return False
    if hasattr(original, "calls"):
        return True

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        with _TRITON_LOCK:
            counted.calls += 1
        return original(self, *args, **kwargs)

    counted.calls = 0
    JITFunction._do_compile = counted
    return True


def _triton_compiles() -> int:
    from triton.runtime.jit import JITFunction

    return JITFunction.__dict__["_do_compile"].calls


def triton_cache_dir() -> Path | None:
    try:
        import triton

        knobs = getattr(triton, "knobs", None)
        configured = getattr(getattr(knobs, "cache", None), "dir", None)
    except Exception:  # noqa: BLE001
        configured = None
    where = configured or os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton",
                                                                                 "cache")
    return Path(where)


def _cache_entries() -> int:
    where = triton_cache_dir()
    try:
        return len(os.listdir(where)) if where is not None else 0
    except OSError:
        return 0


def _dynamo_counts() -> tuple[int, int]:
    counters = _dynamo_utils.counters
    return int(counters["frames"]["total"]), int(counters["stats"]["unique_graphs"])


class CompileCounter:
    """``with CompileCounter(device) as region: ...`` — afterwards ``region.counts`` holds what compiled inside:
    ``dynamo_frames``, ``dynamo_graphs``, ``triton_compiles`` (``None`` without Triton) and ``triton_cache_files``;
    ``region.compiled`` whether any of them (the cache files on CUDA only) is non-zero."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.triton = _install_triton_counter()
        self.counts: dict = {}

    def __enter__(self):
        self._frames, self._graphs = _dynamo_counts()
        self._triton = _triton_compiles() if self.triton else 0
        self._files = _cache_entries()
        return self

    def __exit__(self, *exc):
        frames, graphs = _dynamo_counts()
        self.counts = dict(dynamo_frames=frames - self._frames, dynamo_graphs=graphs - self._graphs,
                           triton_compiles=_triton_compiles() - self._triton if self.triton else None,
                           triton_cache_files=max(0, _cache_entries() - self._files))
        return False

    @property
    def compiled(self) -> bool:
        c = self.counts
        return bool(c["dynamo_frames"] or c["dynamo_graphs"] or c["triton_compiles"]
                    or (self.device.type == "cuda" and c["triton_cache_files"]))


def batch_signature(batch: torch.Tensor) -> tuple:
    """What selects a cuDNN algorithm for ``f_R``'s convolutions, as far as the batch decides: shape, dtype, strides."""
    return tuple(batch.shape), str(batch.dtype).replace("torch.", ""), tuple(batch.stride())


class BatchShapes:
    """Records the batches a :class:`~splitz_fast.sampling.engine.SamplingEngine` feeds ``f_R`` (:func:`batch_signature`),
    by wrapping the engine's scoring call (one set insertion per batch) while the context is open. ``freeze()`` ends
    the warm-up: signatures seen after it that were not seen before are ``new``."""

    def __init__(self, engine):
        self.engine = engine
        self.warm: set[tuple] = set()
        self.new: list[tuple] = []
        self._frozen = False
        self._lock = threading.Lock()

    def __enter__(self):
        scores = self.engine._scores  # the one call every f_R batch goes through (sampling, tuning, the probe)

        def recording(net, batch):
            signature = batch_signature(batch)
            with self._lock:
                if not self._frozen:
                    self.warm.add(signature)
                elif signature not in self.warm and signature not in self.new:
                    self.new.append(signature)
            return scores(net, batch)

        self.engine._scores = recording
        return self

    def freeze(self) -> None:
        self._frozen = True

    def __exit__(self, *exc):
        self.engine.__dict__.pop("_scores", None)
        return False


def timed_region_record(region: CompileCounter, shapes: BatchShapes | None = None, prefix: str = "") -> dict:
    """A row's fields for one timed region: ``{prefix}compiled_in_timed_region`` and the counts behind it (with
    ``shapes``: how many batch signatures the warm-up saw, and those first seen in the timed region)."""
    counts = dict(region.counts)
    if shapes is not None:
        counts.update(warmup_batch_shapes=len(shapes.warm),
                      new_batch_shapes=[{"shape": list(shape), "dtype": dtype, "stride": list(stride)}
                                        for shape, dtype, stride in shapes.new])
    return {f"{prefix}compiled_in_timed_region": region.compiled or bool(shapes is not None and shapes.new),
            f"{prefix}timed_region_compiles": counts}


__all__ = ["BatchShapes", "CompileCounter", "batch_signature", "timed_region_record", "triton_cache_dir"]
