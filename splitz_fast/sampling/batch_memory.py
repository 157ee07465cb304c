"""The batch-size tuner's decisions, remembered per machine and model so that a second run does not measure again.

The tuner (:func:`~splitz_fast.sampling.engine._measure_batch_size`) spends up to its time budget before the first
input (seconds for LeNet, the whole budget for a ResNet on a CPU) to find the fastest batch of ``f_R``. Its answer
depends on how fast the machine runs that network, never on what the network computes, so it is kept in a small
JSON file, ``batch_sizes.json`` in ``$SPLITZ_CACHE_DIR`` (default ``~/.cache/splitz_fast``), under a key of
everything the fastest batch depends on: the device (type, and the GPU's or the CPU's model name), torch's thread
count, torch's version, and what the engine passes in (``f_R``'s structure — its ``repr``: layer kinds and shapes —,
the latent shape, the cap, the precision, the compile setting, whether the pool is drawn with the noise). The weights'
values are not in the key: they do not change how long a pass takes. A remembered batch changes no certificate —
the noise of an input does not depend on the batch size (:mod:`~splitz_fast.sampling.engine`) — only, by rounding,
a vote that sits on a class boundary, as any batch size may.

The file is written atomically (a temporary file in the same folder, then ``os.replace``), so a run killed while
writing leaves the old file or the new one. A damaged file (not JSON, not a mapping of keys to positive batch sizes)
is ignored with one warning and replaced by the next decision. ``SPLITZ_BATCH_MEMORY=0`` turns the memory off (every
process measures, as before); a folder that cannot be written warns once and the run goes on with the measured batch.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

CACHE_DIR_VARIABLE = "SPLITZ_CACHE_DIR"
SWITCH_VARIABLE = "SPLITZ_BATCH_MEMORY"  # "0": off
FILE_NAME = "batch_sizes.json"
_warned: set[str] = set()  # the kinds of trouble already warned of in this process


def cache_dir() -> Path:
    """The folder of the remembered decisions: ``$SPLITZ_CACHE_DIR``, else ``~/.cache/splitz_fast``."""
    given = os.environ.get(CACHE_DIR_VARIABLE)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "splitz_fast"


def enabled() -> bool:
    """Whether decisions are remembered: unless ``SPLITZ_BATCH_MEMORY=0``."""
    return os.environ.get(SWITCH_VARIABLE, "1").strip() != "0"


def machine_key(device: torch.device) -> list:
    """What of the machine a batch size's speed depends on: the device type and model name, torch's thread count
    (the CPU's work is split over them) and torch's version (its kernels)."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    return [device.type, name, torch.get_num_threads(), torch.__version__]


def remembered_batch(engine_key: tuple, device: torch.device, measure: Callable[[], int]) -> int:
    """The batch size remembered for ``engine_key`` (the engine's description of ``f_R`` and the call, see the module
    docstring) on this machine, or ``measure()``'s, which is then remembered."""
    if not enabled():
        return measure()
    key = json.dumps([*machine_key(device), *map(_plain, engine_key)])
    path = cache_dir() / FILE_NAME
    known = _read(path)
    if key in known:
        return known[key]
    chosen = measure()
    known[key] = chosen
    _write(path, known)
    return chosen


def _read(path: Path) -> dict[str, int]:
    """The decisions in ``path``: ``{}`` when it does not exist, and (one warning) when it is damaged."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # nothing remembered yet (a folder that cannot be is warned of later)
        return {}
    except OSError as err:
        _warn_once("read", f"the remembered batch sizes in {path} cannot be read ({err.strerror}): measuring again")
        return {}
    try:
        known = json.loads(text)
        if not isinstance(known, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in known.values()):
            raise ValueError("not a mapping of keys to positive batch sizes")
    except ValueError as err:
        _warn_once("damaged", f"the remembered batch sizes in {path} are damaged ({str(err)[:80]}): ignored, the "
                   "batch size is measured again and the file rewritten")
        return {}
    return known


def _write(path: Path, known: dict[str, int]) -> None:
    """``known`` written to ``path`` atomically (a temporary file beside it, then ``os.replace``)."""
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
        _warn_once("write", f"the measured batch size cannot be remembered in {path.parent} ({err.strerror}); set "
                   f"{CACHE_DIR_VARIABLE} to a writable folder, or {SWITCH_VARIABLE}=0 to measure in every run")


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, stacklevel=4)


def _plain(part: object) -> object:
    """A key part as JSON has it: tuples (shapes) as lists, other values other than numbers, strings, booleans and
    None as their ``str``."""
    if isinstance(part, (tuple, list)):
        return [_plain(p) for p in part]
    return part if part is None or isinstance(part, (bool, int, float, str)) else str(part)


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


__all__ = ["cache_dir", "enabled", "machine_key", "remembered_batch"]
