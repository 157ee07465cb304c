"""Randomized-smoothing checkpoints in Cohen et al.'s format, read into this library's models at split 0.

Cohen et al. (2019, github.com/locuslab/smoothing) and the code built on it (SmoothAdv, consistency training,
...) save ``torch.save({"epoch": epoch + 1, "arch": ARCH, "state_dict": model.state_dict(), "optimizer": ...})`` where
``model = Sequential(NormalizeLayer(dataset's mean, std), net)``:

* the normalisation comes first and keeps its means/sds as plain tensor attributes, not buffers, so the state_dict
  holds only the network's tensors, every key starting with ``1.``;
* ``arch`` is ``cifar_resnet20`` or ``cifar_resnet110`` (CIFAR-10: the bearpaw CIFAR ResNet, the same layers as
  :class:`~splitz_fast.zoo.models.CifarResNet` with the shortcut ``Sequential(1×1 conv, BatchNorm)`` named
  ``downsample`` where ours is ``shortcut``), or ``resnet50`` (ImageNet: torchvision's ResNet-50 inside
  ``DataParallel``, so its keys start with ``1.module.``);
* the CIFAR-10 normalisation is mean (0.4914, 0.4822, 0.4465), std (0.2023, 0.1994, 0.2010) -- not the per-pixel
  std (0.2470, 0.2435, 0.2616) that :func:`~splitz_fast.zoo.models.cifar_resnet` uses by default -- and ImageNet's is
  mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225);
* σ is not recorded anywhere: it must be given to the :class:`~splitz_fast.certify.smoothing.Smoother`.

:func:`read_cohen_checkpoint` reads such a file (``weights_only=True``) into the layout of this library's
checkpoints (``model``: the network's state_dict under this library's names; ``model_spec``: how
:func:`~splitz_fast.zoo.models.build_model` rebuilds it, with Cohen et al.'s normalisation as the model's
:class:`~splitz_fast.model.modules.Standardize`), so :func:`~splitz_fast.checkpoints.splitz.checkpoint_digest` identifies it the
same way; :func:`build_cohen_model` builds and loads the model. Users call
``sz.load_checkpoint(path, format="cohen")``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .files import load_archive, macer_hint, some_keys
from ..zoo.models import IMAGENET_MEAN, IMAGENET_STD, build_model
from ..model.modules import SplitModel

COHEN_FORMAT = "cohen"

#: Cohen et al.'s CIFAR-10 normalisation (their datasets.py); the std differs from
#: :data:`~splitz_fast.zoo.models.CIFAR10_STD`.
COHEN_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
COHEN_CIFAR10_STD = (0.2023, 0.1994, 0.2010)


@dataclass(frozen=True)
class CohenArch:
    """How one of Cohen et al.'s ``arch`` names becomes a model of this library.

    Attributes:
        model: the registered model name (:data:`~splitz_fast.zoo.models.MODELS`).
        dataset: the dataset it is trained and certified on; the ``-samples`` subset of it is accepted too.
        num_classes: the classes of that dataset (the output width of ``fc``).
        mean, std: the normalisation Cohen et al.'s code puts in front of the network for that dataset.
        renames: ``(theirs, ours)`` substrings of the state-dict keys that differ between the two networks.
    """

    model: str
    dataset: str
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    renames: tuple[tuple[str, str], ...] = ()

    def accepts(self, dataset: str) -> bool:
        """Whether this library's dataset ``dataset`` is the one the checkpoint was trained for."""
        return dataset in (self.dataset, f"{self.dataset}-samples")


_BEARPAW = ((".downsample.", ".shortcut."),)

#: Cohen et al.'s ``arch`` names (their architectures.py ``ARCHITECTURES``) and how each is read.
COHEN_ARCHS: dict[str, CohenArch] = {
    "cifar_resnet20": CohenArch("cifar_resnet20", "cifar10", 10, COHEN_CIFAR10_MEAN, COHEN_CIFAR10_STD, _BEARPAW),
    "cifar_resnet110": CohenArch("cifar_resnet110", "cifar10", 10, COHEN_CIFAR10_MEAN, COHEN_CIFAR10_STD, _BEARPAW),
    "resnet50": CohenArch("imagenet_resnet50", "imagenet", 1000, IMAGENET_MEAN, IMAGENET_STD),
}

#: Whose network a checkpoint format's ``arch`` names, for messages.
_WHOSE = {COHEN_FORMAT: "Cohen et al.'s", "macer": "MACER's"}

_EXPECTED = ("expected Cohen et al.'s torch.save({'epoch', 'arch', 'state_dict', 'optimizer'}) of "
             "Sequential(NormalizeLayer, net) (locuslab/smoothing train.py and code built on it)")


def _our_names(state_dict: dict[str, Any], arch: CohenArch, path: Path) -> dict[str, torch.Tensor]:
    """The network's tensors under this library's names: ``1.`` (the Sequential's second entry) and DataParallel's
    ``module.`` (around the network, ``1.module.``, or around the whole Sequential, ``module.1.``) stripped, bearpaw's
    names renamed."""
    renamed = {}
    for key, value in state_dict.items():
        if isinstance(key, str) and key.startswith("module.1."):  # DataParallel around the whole Sequential
            key = key[len("module."):]
        if not isinstance(key, str) or not key.startswith("1.") or not isinstance(value, torch.Tensor):
            raise ValueError(f"{path} is not a Cohen et al. checkpoint: state_dict entry {key!r} is not a tensor "
                             "under '1.' (the network after the NormalizeLayer, whose means/sds are not in the "
                             f"state_dict); {_EXPECTED}")
        name = key[len("1."):]
        if name.startswith("module."):
            name = name[len("module."):]
        for theirs, ours in arch.renames:
            name = name.replace(theirs, ours)
        renamed[name] = value
    return renamed


def read_cohen_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a Cohen et al. checkpoint with ``torch.load(..., weights_only=True)`` into this library's checkpoint
    layout, refusing anything else in one line.

    Returns the file's dict without ``state_dict``, plus ``format`` (``"cohen"``), ``model`` (the network's tensors
    under this library's names: those of ``model.right.network`` of the split-0 model), ``model_spec``
    (``{"name", "format": "cohen", "arch", "dataset", "kwargs"}``; ``kwargs`` hold split 0, the classes and Cohen
    et al.'s normalisation, so ``build_model(spec["name"], **spec["kwargs"])`` rebuilds the model), ``config``
    (``{}``: no training settings, no σ) and ``epoch`` made 0-based (Cohen et al. store ``epoch + 1``).
    """
    path = Path(path)
    raw = load_archive(path, device, "a Cohen et al. checkpoint", _EXPECTED)
    if not isinstance(raw, dict) or "arch" not in raw or not isinstance(raw.get("state_dict"), dict):
        found = some_keys(raw) if isinstance(raw, dict) else f"a {type(raw).__name__}"
        raise ValueError(f"{path} is not a Cohen et al. checkpoint: it holds {found}, not a dict with 'arch' and "
                         f"'state_dict'; {_EXPECTED}{macer_hint(raw)}")
    name = raw["arch"]
    if name not in COHEN_ARCHS:
        raise ValueError(f"{path}: unknown Cohen et al. arch {name!r}; supported: {', '.join(COHEN_ARCHS)}")
    arch = COHEN_ARCHS[name]
    weights = _our_names(raw["state_dict"], arch, path)
    fc = weights.get("fc.weight")
    if fc is not None and fc.ndim == 2 and fc.shape[0] != arch.num_classes:
        raise ValueError(f"{path}: its {name} has {fc.shape[0]} classes (fc {fc.shape[1]}→{fc.shape[0]}), Cohen et "
                         f"al.'s {name} has {arch.num_classes} ({arch.dataset}); other heads are not supported: "
                         "the file does not record their input normalisation")
    spec = {"name": arch.model, "format": COHEN_FORMAT, "arch": name, "dataset": arch.dataset,
            "kwargs": {"split_index": 0, "num_classes": arch.num_classes, "mean": list(arch.mean),
                       "std": list(arch.std)}}
    ckpt = {key: value for key, value in raw.items() if key != "state_dict"}
    epoch = raw.get("epoch")
    ckpt.update(format=COHEN_FORMAT, model=weights, model_spec=spec, config={},
                epoch=epoch - 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else None)
    return ckpt


def build_cohen_model(ckpt: dict[str, Any]) -> SplitModel:
    """The split-0 model of a checkpoint read by :func:`read_cohen_checkpoint` (or
    :func:`~splitz_fast.checkpoints.macer.read_macer_checkpoint`), its weights loaded strictly (a
    missing, unexpected or reshaped tensor is a one-line ``ValueError``); on the CPU, in training mode."""
    spec = ckpt["model_spec"]
    model = build_model(spec["name"], **spec["kwargs"])
    network = model.right.network
    saved, expected = ckpt["model"], network.state_dict()
    # BatchNorm fills a missing num_batches_tracked itself (files of PyTorch < 0.4.1); it does not affect eval mode.
    missing = [k for k in expected if k not in saved and not k.endswith(".num_batches_tracked")]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        first = (missing or unexpected or reshaped)[0]
        what = "missing" if missing else "unexpected" if unexpected else (
            f"{tuple(saved[first].shape)} where {spec['arch']} has {tuple(expected[first].shape)}")
        raise ValueError(f"its state_dict does not fit {_WHOSE[spec['format']]} {spec['arch']} ({len(missing)} "
                         f"missing, {len(unexpected)} unexpected, {len(reshaped)} reshaped tensors, e.g. {first!r} "
                         f"{what}): another architecture or depth than 'arch' says")
    network.load_state_dict(saved, strict=True)
    return model


def check_cohen_dataset(ckpt: dict[str, Any], dataset: str) -> None:
    """Refuse certifying a Cohen et al. (or MACER) checkpoint on another dataset than its ``arch`` was trained
    for."""
    spec = ckpt["model_spec"]
    name, trained = spec["arch"], spec.get("dataset") or COHEN_ARCHS[spec["arch"]].dataset
    if dataset not in (trained, f"{trained}-samples"):
        article = "an" if trained[:1].lower() in "aeiou" else "a"
        raise ValueError(f"{_WHOSE[spec.get('format', COHEN_FORMAT)]} {name} is {article} {trained} model, not one "
                         f"for {dataset!r}; certify it on {trained} (or {trained}-samples)")


__all__ = ["COHEN_ARCHS", "COHEN_CIFAR10_MEAN", "COHEN_CIFAR10_STD", "COHEN_FORMAT", "CohenArch", "build_cohen_model",
           "check_cohen_dataset", "read_cohen_checkpoint"]
