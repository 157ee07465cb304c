"""Small reference networks and offline pretrained weights."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..data.packages import package_file

ADVERTORCH_PIN = "advertorch==0.2.3"
ADVERTORCH_LENET5 = "advertorch_examples/trained_models/mnist_lenet5_clntrained.pt"


def lenet5() -> nn.Sequential:
    """MNIST LeNet-5 as in advertorch: conv(1→32, 3, p1)-ReLU-pool-conv(32→64, 3, p1)-ReLU-pool-fc(3136→200)-ReLU-
    fc(200→10). Input ``[B, 1, 28, 28]`` in [0, 1]."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 200), nn.ReLU(), nn.Linear(200, 10),
    )


def pretrained_lenet5() -> nn.Sequential:
    """:func:`lenet5` with advertorch's clean-trained MNIST weights (98.89 % clean accuracy), read from the installed
    ``advertorch`` distribution (LGPL-3.0, not vendored) with ``weights_only=True``."""
    path = package_file("advertorch", ADVERTORCH_LENET5, ADVERTORCH_PIN)
    state = torch.load(path, map_location="cpu", weights_only=True)
    net = lenet5()
    names = {"conv1": 0, "conv2": 3, "linear1": 7, "linear2": 9}
    remapped = {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in state.items()}
    net.load_state_dict(remapped)
    return net.eval()
