"""Datasets: MNIST, CIFAR-10, ImageNet, foolbox samples, Adult, Law School (:mod:`.datasets`), read from the offline
packages (:mod:`.packages`) or a user's folder.

``splitz_fast.data`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .packages import (
    MNIST_PACKAGE, MNIST_PIN, MNIST_FILE, DatasetUnavailableError, package_file, load_mnist
)

__all__ = [
    "MNIST_PACKAGE", "MNIST_PIN", "MNIST_FILE", "DatasetUnavailableError", "package_file", "load_mnist",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.data``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
