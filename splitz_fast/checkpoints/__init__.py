"""Checkpoints: this library's format (:mod:`.splitz`) and Cohen et al.'s (:mod:`.cohen`).

``splitz_fast.checkpoints`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .splitz import (
    CHECKPOINT_DIGEST_COVERS, CHECKPOINT_FORMAT, CHECKPOINT_FORMATS, LoadedCheckpoint, checkpoint_digest,
    load_checkpoint, load_checkpoint_file, load_model, load_state_into, save_checkpoint
)

__all__ = [
    "CHECKPOINT_DIGEST_COVERS", "CHECKPOINT_FORMAT", "CHECKPOINT_FORMATS", "LoadedCheckpoint", "checkpoint_digest",
    "load_checkpoint", "load_checkpoint_file", "load_model", "load_state_into", "save_checkpoint",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.checkpoints``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
