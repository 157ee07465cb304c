"""What the checkpoint readers (:mod:`.splitz`, :mod:`.cohen`, :mod:`.macer`) say of a file that is not what they read."""
from __future__ import annotations

import zipfile
from pathlib import Path

import torch


def load_archive(path: Path, device: str | torch.device, what: str, expected: str) -> object:
    """``torch.load(path, weights_only=True)`` of a checkpoint file; a missing one is a ``FileNotFoundError`` and an
    unreadable one the ``ValueError`` "PATH is not WHAT: why; EXPECTED", each in one line."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception:  # pickle errors, truncated files, foreign objects
        raise ValueError(f"{path} is not {what}: {unreadable_reason(path)}; {expected}") from None


def unreadable_reason(path: Path) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in a few words (torch's own messages run to many lines)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        return "the file is not a torch.save archive (damaged, truncated, or another kind of file)"
    return "the archive is damaged, or holds Python objects other than tensors and plain values"


def some_keys(mapping: dict, shown: int = 5) -> str:
    """``mapping``'s keys for a one-line error: the first few sorted, then how many more (a ResNet's state_dict has
    hundreds)."""
    keys = sorted(map(str, mapping))
    more = f", … ({len(keys) - shown} more)" if len(keys) > shown else ""
    return f"{len(keys)} key{'s' if len(keys) != 1 else ''} ({', '.join(keys[:shown])}{more})"


def macer_hint(ckpt: object) -> str:
    """The hint to read a MACER checkpoint (``{'net': state_dict, 'epoch'}``) as one ("" for anything else)."""
    if isinstance(ckpt, dict) and isinstance(ckpt.get("net"), dict) and "arch" not in ckpt:
        return ("; it looks like a MACER checkpoint ('net' and 'epoch'): load it with format='macer' and its "
                "input_normalization (on the command line: --checkpoint-format macer --input-normalization ...)")
    return ""


def looks_like(ckpt: object) -> str:
    """What a dict that is not a checkpoint of the expected format looks like, as a hint of what to do instead ("" when
    it looks like nothing known)."""
    if not isinstance(ckpt, dict):
        return ""
    if "arch" in ckpt and isinstance(ckpt.get("state_dict"), dict):
        return ("; it looks like a Cohen et al. checkpoint ('arch' and 'state_dict'): load it with format='cohen' "
                "(on the command line: --checkpoint-format cohen)")
    if macer_hint(ckpt):
        return macer_hint(ckpt)
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return (f"; it holds a bare state_dict ({some_keys(ckpt)}) and nothing that names the model: build the model, "
                "then model.load_state_dict(torch.load(path, weights_only=True))")
    return ""
