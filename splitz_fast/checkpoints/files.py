"""What both checkpoint readers (:mod:`.splitz`, :mod:`.cohen`) share about a file that ``torch.load`` could not read."""
from __future__ import annotations

import zipfile
from pathlib import Path


def unreadable_reason(path: Path) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in a few words (torch's own messages run to many lines)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        return "the file is not a torch.save archive (damaged, truncated, or another kind of file)"
    return "the archive is damaged, or holds Python objects other than tensors and plain values"
