"""Datasets: MNIST, CIFAR-10, ImageNet, foolbox samples, Adult, Law School (:mod:`.datasets`), read from the offline
packages (:mod:`.packages`) or a user's folder.

``splitz_fast.data`` was one module before 0.2: its names are handed on here."""
from .packages import (
    MNIST_PACKAGE, MNIST_PIN, MNIST_FILE, DatasetUnavailableError, package_file, load_mnist
                       )

__all__ = [
    "MNIST_PACKAGE", "MNIST_PIN", "MNIST_FILE", "DatasetUnavailableError", "package_file", "load_mnist",
]
