"""Model builders: the LeNets, CIFAR ResNets, the ImageNet ResNet-50 and the tabular MLP (:mod:`.models`), and the
pretrained LeNet-5 weights (:mod:`.pretrained`).

``splitz_fast.zoo`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .pretrained import (
    ADVERTORCH_PIN, ADVERTORCH_LENET5, lenet5, pretrained_lenet5
)

__all__ = [
    "ADVERTORCH_PIN", "ADVERTORCH_LENET5", "lenet5", "pretrained_lenet5",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.zoo``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
