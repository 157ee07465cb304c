"""Measured decisions remembered per machine and model, so that a second run does not measure again: the batch-size
tuner's fastest batch, and each measured choice's verdict (a CUDA graph, a compiled, fused or cast copy of ``f_R``:
used or not, and the times that decided it).

The tuner (:func:`~splitz_fast.sampling.engine._measure_batch_size`) spends up to its time budget before the first
input (seconds for LeNet, the whole budget for a ResNet on a CPU) to find the fastest batch of ``f_R``; a measured
choice (:class:`~splitz_fast.sampling.choices.MeasuredChoice`) prepares a candidate (a graph capture, a compilation,
a fused kernel built for the layer's shape — cuDNN's runtime-fused plans compile per shape), checks its scores and
times both sides. Their answers depend on how fast the machine runs that network, never on what the network
computes, so each is kept in a small JSON file in ``$SPLITZ_CACHE_DIR`` (default ``~/.cache/splitz_fast``):
``batch_sizes.json`` and ``choices.json``, under a key of everything the answer depends on: the device (type, and the
GPU's or the CPU's model name), torch's thread count, torch's version, and what the engine passes in (``f_R``'s
structure — its ``repr``: layer kinds and shapes —, the latent shape, the precision, the batch, the copy...). The
weights' values are not in the key: they do not change how long a pass takes.

What a remembered answer changes. A batch size changes no certificate — the noise of an input does not depend on the
batch size (:mod:`~splitz_fast.sampling.engine`) — only, by rounding, a vote that sits on a class boundary, as any
batch size may. A remembered verdict skips only the timing: a candidate remembered as slower is not prepared at all
(the engine runs what it runs without it, always a correct base classifier); one remembered as faster is prepared
and its scores checked against the baseline exactly as when measured, then used. Failures are never remembered:
they are reported in every run.

The files are written atomically (a temporary file in the same folder, then ``os.replace``), so a run killed while
writing leaves the old file or the new one. A damaged file (not JSON, or not a mapping of keys to the values it
holds) is ignored with one warning and replaced by the next decision. ``SPLITZ_MEMORY=0`` turns the memory off: every
process measures; a folder that cannot be written warns once and the run goes on with what it measured. Delete the
files to measure again (e.g. after a run under heavy load).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

CACHE_DIR_VARIABLE = "SPLITZ_CACHE_DIR"
SWITCH_VARIABLE = "SPLITZ_MEMORY"  # "0": off
KEY_TEXT_MAX = 200
_warned: set[str] = set()  # the kinds of trouble already warned of in this process


def cache_dir() -> Path:
    """The folder of the remembered decisions: ``$SPLITZ_CACHE_DIR``, else ``~/.cache/splitz_fast``."""
    given = os.environ.get(CACHE_DIR_VARIABLE)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "splitz_fast"


def enabled() -> bool:
    """Whether decisions are remembered: unless ``SPLITZ_MEMORY=0``."""
    return os.environ.get(SWITCH_VARIABLE, "1").strip() != "0"


def machine_key(device: torch.device) -> list:
    """What of the machine a decision's speed depends on: the device type and model name, torch's thread count
    (the CPU's work is split over them) and torch's version (its kernels)."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    return [device.type, name, torch.get_num_threads(), torch.__version__]


@dataclass(frozen=True)
class Memory:
    """One file of remembered decisions: ``file_name`` in :func:`cache_dir`, holding values that ``valid`` accepts;
    ``what`` names them in warnings."""

    file_name: str
    what: str
    valid: Callable[[object], bool]

    def recall(self, key: tuple, device: torch.device) -> object | None:
        """The value remembered for ``key`` (the caller's description of what was decided) on this machine, or
        ``None`` (nothing remembered, or the memory off)."""
        if not enabled():
            return None
        return self._read().get(_key_text(key, device))

    def remember(self, key: tuple, device: torch.device, value: object) -> None:
        """Remember ``value`` for ``key`` on this machine (where the memory is on)."""
        if enabled():
            known = self._read()
            known[_key_text(key, device)] = value
            self._write(known)

    @property
    def path(self) -> Path:
        return cache_dir() / self.file_name

    def _read(self) -> dict:
        """The decisions in the file: ``{}`` when it does not exist, and (one warning) when it is damaged."""
        path = self.path
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):  # nothing yet (a folder that cannot be is warned of later)
            return {}
        except OSError as err:
            _warn_once(f"read {path}", f"the remembered {self.what} in {path} cannot be read ({err.strerror}): "
                       "measuring again")
            return {}
        try:
            known = json.loads(text)
            if not isinstance(known, dict) or not all(map(self.valid, known.values())):
                raise ValueError(f"not a mapping of keys to {self.what}")
        except ValueError as err:
            _warn_once(f"damaged {path}", f"the remembered {self.what} in {path} are damaged ({str(err)[:80]}): "
                       "ignored, measured again and the file rewritten")
            return {}
        return known

    def _write(self, known: dict) -> None:
        """``known`` written to the file atomically (a temporary file beside it, then ``os.replace``)."""
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as out:
                    json.dump(known, out, indent=0, sort_keys=True)
                os.replace(temporary, path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as err:
            _warn_once(f"write {path.parent}", f"the measured {self.what} cannot be remembered in {path.parent} "
                       f"({err.strerror}); set {CACHE_DIR_VARIABLE} to a writable folder, or SPLITZ_MEMORY=0 to "
                       "measure in every run")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _verdict(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("used"), bool) and isinstance(value.get("reason"), str)


BATCH_SIZES = Memory("batch_sizes.json", "batch sizes", _positive_int)
#: A measured choice's verdict: ``{"used": bool, "reason": str, "baseline_s": float | None, "candidate_s": ...}``.
VERDICTS = Memory("choices.json", "choices", _verdict)


def remembered_batch(engine_key: tuple, device: torch.device, measure: Callable[[], int]) -> int:
    """The batch size remembered for ``engine_key`` (the engine's description of ``f_R`` and the call, see the module
    docstring) on this machine, or ``measure()``'s, which is then remembered."""
    chosen = BATCH_SIZES.recall(engine_key, device)
    if chosen is None:
        chosen = measure()
        BATCH_SIZES.remember(engine_key, device, chosen)
    return chosen


def _key_text(key: tuple, device: torch.device) -> str:
    return json.dumps([*machine_key(device), *map(_plain, key)])


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, stacklevel=4)


def _plain(part: object) -> object:
    """A key part as JSON has it: tuples (shapes) as lists, other values other than numbers, strings, booleans and
    None as their ``str``; a string longer than :data:`KEY_TEXT_MAX` (``f_R``'s ``repr``: tens of kB for a ResNet-50)
    as its SHA-256, so the files stay small and the rest of a key readable."""
    if isinstance(part, (tuple, list)):
        return [_plain(p) for p in part]
    if not (part is None or isinstance(part, (bool, int, float, str))):
        part = str(part)
    if isinstance(part, str) and len(part) > KEY_TEXT_MAX:
        return "sha256:" + hashlib.sha256(part.encode()).hexdigest()
    return part


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says of the processor."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


__all__ = ["BATCH_SIZES", "Memory", "VERDICTS", "cache_dir", "enabled", "machine_key", "remembered_batch"]
