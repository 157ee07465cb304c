"""The up-front check of a folder dataset's images: each image a run will read, opened and decoded before the first
certification, so that a damaged file stops the run at once, named, instead of when the run reaches it (for
ImageNet's 500 test images at N = 100,000, hours in).

It decodes with the dataset's own loader (torchvision's ``ImageFolder.loader``: PIL, converted to RGB), the very call
the run makes, so an image that passes is one the run can read. One decode costs milliseconds (about 4 ms for a
512×512 JPEG on one CPU core), a certification from seconds (a GPU) to minutes (a CPU): the check is on by default
(``splitz certify --no-check-images`` skips it).
"""
from __future__ import annotations

import sys
from typing import Sequence

from torch.utils.data import Dataset
from tqdm import tqdm


def image_files(dataset: Dataset) -> list[str] | None:
    """The file of each item of a torchvision folder dataset (``ImageFolder``, ``DatasetFolder``: its ``samples``),
    ``None`` for a dataset whose items are not files (tensors, CIFAR-10's batches: loaded whole, checked then)."""
    samples, loader = getattr(dataset, "samples", None), getattr(dataset, "loader", None)
    if not isinstance(samples, list) or not callable(loader):
        return None
    return [str(sample[0]) for sample in samples]


def check_images(dataset: Dataset, indices: Sequence[int], *, progress: bool = True) -> int:
    """Open and decode the images of ``indices`` with the dataset's loader; returns how many were checked (0 for a
    dataset without image files, :func:`image_files`). A file that does not decode (truncated, damaged, not an image)
    is a ``ValueError`` in one line naming it and the remedy."""
    files = image_files(dataset)
    if files is None or not indices:
        return 0
    for idx in tqdm(indices, desc="checking images", unit="img", file=sys.stderr, disable=not progress):
        try:
            dataset.loader(files[idx])
        except (OSError, SyntaxError, ValueError) as err:  # what PIL raises for a damaged or truncated file
            raise ValueError(f"image {files[idx]} (dataset item {idx}) cannot be decoded ({err}); repair or replace "
                             "that file (removing it would renumber the items after it), then rerun") from None
    return len(indices)


__all__ = ["check_images", "image_files"]
