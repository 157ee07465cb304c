"""MACER's checkpoints (Zhai et al., ICLR 2020, github.com/RuntianZ/macer), read into this library's CIFAR ResNets at
split 0, behind an input normalisation the user states.

MACER's ``main.py`` saves ``torch.save({"net": base_model.state_dict(), "epoch": epoch})`` (``epoch`` counts the
epochs done, from 1), the network itself without a DataParallel prefix. Its CIFAR-10 network is the CIFAR ResNet-110
with this library's layer names except the shortcut ``Sequential(1×1 conv, BatchNorm)``, named ``downsample`` where
ours is ``shortcut``; its ``AvgPool2d(8)`` equals our global average pool on 32×32 inputs (8×8 feature maps).

MACER trains on ``ToTensor`` images with **no normalisation layer**, and the file does not say so: nothing in it
tells a network trained on raw [0, 1] pixels from one trained behind some mean and std. So the normalisation is a
required argument (:func:`input_normalization`): ``"none"`` for MACER's own training, ``"cohen-cifar10"`` for a network
trained behind Cohen et al.'s CIFAR-10 mean and std, or ``"MEAN,STD"`` numbers. It becomes the model's
:class:`~splitz_fast.model.modules.Standardize` (mean 0, std 1 for ``"none"``: ``(x − 0)/1`` is ``x`` exactly) and is
recorded in ``model_spec`` (so :func:`~splitz_fast.checkpoints.splitz.checkpoint_digest` covers it) and in a run's
sidecar. Users call ``sz.load_checkpoint(path, format="macer", input_normalization="none")``.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cohen import COHEN_CIFAR10_MEAN, COHEN_CIFAR10_STD
from .files import load_archive, looks_like, some_keys

MACER_FORMAT = "macer"
MACER_DATASET = "cifar10"
_CHANNELS = 3
#: The depths of the registered CIFAR ResNets (splitz_fast.zoo.models.MODELS); MACER's own is 110.
_DEPTHS = (20, 56, 110)

_EXPECTED = ("expected MACER's torch.save({'net': state_dict, 'epoch'}) of its CIFAR ResNet (RuntianZ/macer "
             "main.py)")


@dataclass(frozen=True)
class InputNormalization:
    """The ``(x − mean)/std`` put in front of a checkpoint's network, per input channel.

    Attributes:
        name: how it was stated, canonical: ``"none"``, ``"cohen-cifar10"`` or ``"m1,m2,m3,s1,s2,s3"``.
        mean, std: one value per channel.
    """

    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


#: The normalisations that have a name.
NAMED_NORMALIZATIONS = {
    "none": InputNormalization("none", (0.0,) * _CHANNELS, (1.0,) * _CHANNELS),
    "cohen-cifar10": InputNormalization("cohen-cifar10", COHEN_CIFAR10_MEAN, COHEN_CIFAR10_STD),
}

_CHOICES = "none (MACER's own training: raw [0, 1] pixels), cohen-cifar10, or MEAN,STD (2 or 6 numbers)"


def input_normalization(text: str | InputNormalization) -> InputNormalization:
    """The normalisation a text states: a name of :data:`NAMED_NORMALIZATIONS`, ``"MEAN,STD"`` (the same for every
    channel) or ``"M1,M2,M3,S1,S2,S3"``; every std finite and > 0. ``ValueError`` in one line otherwise."""
    if isinstance(text, InputNormalization):
        return text
    if not isinstance(text, str):
        raise TypeError(f"input normalisation must be a string ({_CHOICES}), got {type(text).__name__}")
    if text in NAMED_NORMALIZATIONS:
        return NAMED_NORMALIZATIONS[text]
    parts = [part.strip() for part in text.split(",")]
    try:
        numbers = [float(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 2 * _CHANNELS) or not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"input normalisation {text!r} is not {_CHOICES}")
    half = len(numbers) // 2
    mean, std = numbers[:half], numbers[half:]
    if half == 1:
        mean, std = mean * _CHANNELS, std * _CHANNELS
    if any(s <= 0 for s in std):
        raise ValueError(f"input normalisation {text!r}: every std must be > 0")
    return InputNormalization(",".join(map(repr, mean + std)), tuple(mean), tuple(std))


def _our_names(net: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """The network's tensors under this library's names (``downsample`` → ``shortcut``; a DataParallel ``module.``
    stripped)."""
    renamed = {}
    for key, value in net.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{path} is not a MACER checkpoint: its 'net' entry {key!r} is not a tensor; {_EXPECTED}")
        name = key[len("module."):] if key.startswith("module.") else key
        renamed[name.replace(".downsample.", ".shortcut.")] = value
    return renamed


def _depth(weights: dict[str, torch.Tensor], path: Path) -> int:
    """The CIFAR ResNet's depth, ``6n + 2`` for ``n`` blocks per stage (counted in ``layer1``)."""
    conv1 = weights.get("conv1.weight")
    if conv1 is not None and tuple(conv1.shape[:2]) == (20, 1):
        raise ValueError(f"{path} holds MACER's MNIST LeNet; only its CIFAR ResNet (CIFAR-10) is supported")
    blocks = {m.group(1) for key in weights if (m := re.match(r"layer1\.(\d+)\.", key))}
    if conv1 is None or tuple(conv1.shape[:2]) != (16, _CHANNELS) or not blocks:
        raise ValueError(f"{path}: its 'net' is not MACER's CIFAR ResNet (no conv1 3→16 and layer1 blocks; "
                         f"{some_keys(weights)}); {_EXPECTED}")
    depth = 6 * len(blocks) + 2
    if depth not in _DEPTHS:
        raise ValueError(f"{path}: its CIFAR ResNet has depth {depth}; supported depths: "
                         f"{', '.join(map(str, _DEPTHS))}")
    return depth


def read_macer_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                          normalization: str | InputNormalization | None) -> dict[str, Any]:
    """Read a MACER checkpoint with ``torch.load(..., weights_only=True)`` into this library's checkpoint layout
    (as :func:`~splitz_fast.checkpoints.cohen.read_cohen_checkpoint` does), refusing anything else in one line.

    ``normalization`` (required: the file does not record it) is :func:`input_normalization`'s text. Returns
    ``format`` (``"macer"``), ``model`` (the tensors of ``model.right.network`` of the split-0 model), ``model_spec``
    (``{"name": "cifar_resnet<depth>", "format": "macer", "arch", "dataset": "cifar10", "input_normalization",
    "kwargs"}``, the normalisation's mean and std in ``kwargs``), ``config`` (``{}``) and ``epoch`` 0-based."""
    if normalization is None:
        raise ValueError("MACER checkpoints store no input normalisation: pass input_normalization= "
                         f"{_CHOICES}")
    normalization = input_normalization(normalization)
    path = Path(path)
    raw = load_archive(path, device, "a MACER checkpoint", _EXPECTED)
    if not isinstance(raw, dict) or not isinstance(raw.get("net"), dict):
        found = some_keys(raw) if isinstance(raw, dict) else f"a {type(raw).__name__}"
        raise ValueError(f"{path} is not a MACER checkpoint: it holds {found}, not a dict with 'net'; "
                         f"{_EXPECTED}{looks_like(raw)}")
    weights = _our_names(raw["net"], path)
    depth = _depth(weights, path)
    fc = weights.get("fc.weight")
    classes = fc.shape[0] if fc is not None and fc.ndim == 2 else 10
    spec = {"name": f"cifar_resnet{depth}", "format": MACER_FORMAT, "arch": f"resnet{depth}",
            "dataset": MACER_DATASET, "input_normalization": normalization.name,
            "kwargs": {"split_index": 0, "num_classes": classes, "mean": list(normalization.mean),
                       "std": list(normalization.std)}}
    epoch = raw.get("epoch")
    ckpt = {key: value for key, value in raw.items() if key != "net"}
    ckpt.update(format=MACER_FORMAT, model=weights, model_spec=spec, config={},
                epoch=epoch - 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None)
    return ckpt


__all__ = ["InputNormalization", "MACER_FORMAT", "NAMED_NORMALIZATIONS", "input_normalization",
           "read_macer_checkpoint"]
