"""The fast side: ``f_R`` over noisy latents — the engine (:mod:`.engine`), the prepared copies (:mod:`.prepared`,
:mod:`.folding`, :mod:`.epilogues`), CUDA graphs (:mod:`.graphs`), ``torch.compile`` (:mod:`.compiled`), how the
engine measures which of them to use (:mod:`.choices`) and when a copy counts as the same classifier
(:mod:`.score_checks`). Nothing here imports the bound side.

``splitz_fast.sampling`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .engine import (
    NoiseStream, SamplingEngine, SamplingJob, PRECISIONS, NOISE_BLOCK, fold_batchnorm, unfolded_batchnorms
)

__all__ = [
    "NoiseStream", "SamplingEngine", "SamplingJob", "PRECISIONS", "NOISE_BLOCK", "fold_batchnorm",
    "unfolded_batchnorms",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.sampling``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
