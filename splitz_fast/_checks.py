"""Input validation shared by every public entry point.

Each check raises ``ValueError`` (or ``TypeError``) with a message that names the argument and says what to fix.
"""
from __future__ import annotations

import json
import math
import numbers
import operator
import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


def _real(name: str, value) -> float:
    """``value`` as a Python float: any real number (NumPy scalars and 0-d tensors of a real dtype included), not a
    bool."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_complex and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_positive(name: str, value: float) -> float:
    value = _real(name, value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_nonnegative(name: str, value: float, allow_inf: bool = False) -> float:
    value = _real(name, value)
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number >= 0, got {value}")
    return float(value)


def check_probability(name: str, value: float) -> float:
    value = _real(name, value)
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")
    return float(value)


def check_count(name: str, value: int, minimum: int = 1) -> int:
    """``value`` as a Python int (NumPy and 0-d integer tensors included), at least ``minimum``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_tensor(
    name: str,
    x: torch.Tensor,
    *,
    ndim: int | Sequence[int] | None = None,
    shape_tail: Sequence[int] | None = None,
    finite: bool = True,
) -> torch.Tensor:
    """Check type, floating dtype, rank, trailing shape and finiteness of ``x``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}; convert it with .float()")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(x.shape)}")
    if shape_tail is not None:
        tail = tuple(x.shape[x.ndim - len(shape_tail):])
        if tail != tuple(shape_tail):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, but the model expects inputs of shape {tuple(shape_tail)} "
                f"(optionally with a leading batch dimension)"
            )
    if finite and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf values; clean the input before certifying")
    return x


def dataset_pair(item: object, index: int | None = None) -> tuple[object, object]:
    """``(input, label)`` of one dataset item, refused with what to change unless the item is such a pair whose input
    is a tensor or an array (``index``: the item's index in the dataset, for the message, where known). A torchvision
    dataset without ``transforms.ToTensor()`` gives PIL images; a dataset of dicts or of bare inputs gives no pair."""
    where = "a dataset item" if index is None else f"dataset item {index}"
    if isinstance(item, dict):
        raise TypeError(f"{where} is a dict with keys {sorted(map(str, item))}; the library reads (input, label) pairs: "
                        "wrap the dataset so that dataset[i] returns (input_tensor, label), e.g. a Dataset whose "
                        "__getitem__ returns (item['image'], item['label'])")
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        what = (f"a {type(item).__name__} of {len(item)} elements" if isinstance(item, (tuple, list))
                else f"a {type(item).__name__}")
        raise TypeError(f"{where} is {what}; the library reads (input, label) pairs: dataset[i] must return "
                        "(input_tensor, label)")
    x, label = item
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        advice = ("add transforms.ToTensor() to the dataset's transform (torchvision datasets give PIL images "
                  "without it)" if kind.startswith("PIL.") else "make dataset[i] return the input as a tensor")
        raise TypeError(f"the input of {where} is a {kind}, not a tensor: {advice}")
    return x, label


def check_certify_counts(n0: int | None, n: int, alpha: float, batch_size: int | None,
                         n_name: str = "n") -> tuple[int | None, int, float, int | None]:
    """CERTIFY's sampling arguments: ``n0`` selection draws (``None``: PREDICT has none) ≤ ``n`` estimation draws
    (called ``n_name``, e.g. ``budget``), ``0 < alpha < 1``, ``batch_size ≥ 1`` or ``None`` (measured). Returns them as
    Python numbers (a NumPy or tensor count would otherwise reach results and settings files as such)."""
    n = check_count(n_name, n)
    if n0 is not None:
        n0 = check_count("n0", n0)
        if n0 > n:
            raise ValueError(f"n0 ({n0}) must not exceed {n_name} ({n}); n0 only selects the class")
    alpha = check_probability("alpha", alpha)
    if batch_size is not None:
        batch_size = check_count("batch_size", batch_size)
    return n0, n, alpha, batch_size


def available_devices() -> list[str]:
    """The devices this machine can run on: ``cpu``, then ``cuda`` and ``cuda:N`` for each GPU CUDA sees."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def check_device(name: str, value: str) -> str:
    """Refuse a device string that is not a device, or a device this machine does not have (before any work)."""
    valid = available_devices()
    if value in valid:
        return value
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} {value!r} is not a device; valid here: {', '.join(valid)}") from None
    raise ValueError(f"{name} {value!r} is unavailable on this machine; valid here: {', '.join(valid)}")


def _nearest_existing(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def check_output_file(name: str, path: str | os.PathLike) -> Path:
    """A file path that can be created: not a folder, and no existing file where a parent folder should be."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name} {str(path)!r} is a folder; give a file path, e.g. {str(path / 'out.tsv')!r}")
    parent = _nearest_existing(path)
    if not parent.is_dir():
        raise ValueError(f"cannot create {name} {str(path)!r}: {str(parent)!r} is a file, not a folder")
    _check_writable(name, path, parent)
    return path


def _check_writable(name: str, path: Path, folder: Path) -> None:
    """Refuse, naming ``path``, an output this user cannot write: a file is created in ``folder`` (the nearest
    existing folder on the path) and removed at once, and an existing ``path`` file is opened for appending. Trying is
    the only reliable test (``os.access`` says yes to root on /sys, /proc and read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".splitz-write-check-"):
            pass
    except OSError as err:
        raise ValueError(f"cannot write {name} {str(path)!r}: this user cannot create files in {str(folder)!r} "
                         f"({err.strerror or type(err).__name__}); choose another path") from None
    if path.is_file():
        try:
            with path.open("a"):
                pass
        except OSError as err:
            raise ValueError(f"cannot write {name} {str(path)!r}: this user cannot write to that file "
                             f"({err.strerror or type(err).__name__}); choose another path") from None


def check_input_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` when it names a file that exists; otherwise one line naming it (``what``: the file expected, e.g. "a
    certification TSV"): ``FileNotFoundError("out/x.tsv: no such file")``, ``IsADirectoryError`` for a folder."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a folder; give {what}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return path


def read_settings_file(path: str | os.PathLike) -> dict:
    """The settings a run's sidecar ``OUTFILE.json`` records (a JSON object). Raises ``ValueError`` with the problem
    in words after the file's name, for the caller to prefix: ``"out.tsv.json is missing"``, ``"... is not valid
    JSON (Expecting value: line 1 column 1 (char 0))"``, ``"... is not a text file"``, ``"... holds no settings"``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file") from None
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or type(err).__name__})") from None
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(settings, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(settings), "a number")
        raise ValueError(f"{path} holds no settings (a JSON object) but {kind}")
    return settings


def check_output_folder(name: str, path: str | os.PathLike) -> Path:
    """A folder path that exists as a folder or can be created (no file in the way)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {str(path)!r} is a file, not a folder")
    parent = _nearest_existing(path)
    if not path.exists() and not parent.is_dir():
        raise ValueError(f"cannot create {name} {str(path)!r}: {str(parent)!r} is a file, not a folder")
    _check_writable(name, path, path if path.is_dir() else parent)
    return path


def report_fallback(message: str, *, stacklevel: int = 3) -> None:
    """A path that is slower or stricter than the one asked for, taken because the fast one would not compute the
    same thing: a warning (callers warn once per engine and keep the reason where runs record it), or, under
    ``SPLITZ_STRICT=1``, a ``RuntimeError`` with the same cause."""
    if os.environ.get("SPLITZ_STRICT") == "1":
        raise RuntimeError(f"{message} (SPLITZ_STRICT=1 makes every fallback an error)")
    warnings.warn(message, stacklevel=stacklevel)
