"""Checkpoints written by ``splitz train`` / :func:`splitz_fast.training.loop.train`: save, load, digest, and the model rebuilt.

A checkpoint is a ``torch.save`` archive of one dict holding only tensors and plain Python values, so it loads with
``torch.load(..., weights_only=True)`` (nothing in it can run code): ``format`` (:data:`CHECKPOINT_FORMAT`), ``model``
(the state_dict), ``model_spec`` (``{"name", "kwargs", "dataset", ...}``: how :func:`~splitz_fast.zoo.models.build_model`
rebuilds the architecture), ``config`` (the :class:`~splitz_fast.training.config.TrainConfig` as a dict, σ included), and
the training state (``optimizer``, ``epoch``, ``power_vectors``, ``history``, ``best_epoch``, ...). No wall times, so
identical runs write identical files; :func:`checkpoint_digest` identifies a model by content.

For users, :func:`load_checkpoint` is the one call::

    ckpt = sz.load_checkpoint("runs/mnist-splitz/best.pt")       # device="cpu" by default
    smoother = sz.Smoother(ckpt.model, ckpt.sigma)                # the σ it was trained at

``format="cohen"`` reads the randomized-smoothing checkpoints of Cohen et al.'s code (and SmoothAdv, consistency
training, ... built on it) instead: :mod:`splitz_fast.checkpoints.cohen`; ``format="macer"`` MACER's, with the input
normalisation stated: :mod:`splitz_fast.checkpoints.macer`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .._checks import check_device, check_positive
from ..zoo.models import build_model
from ..model.modules import SplitModel
from .cohen import build_cohen_model, read_cohen_checkpoint
from .macer import InputNormalization, read_macer_checkpoint
from .files import looks_like, unreadable_reason

CHECKPOINT_FORMAT = 1

#: What ``format=`` of :func:`load_checkpoint` (and ``splitz certify --checkpoint-format``) accepts: ``"splitz"``,
#: written by ``splitz train``; ``"cohen"``, Cohen et al.'s randomized-smoothing checkpoints (:mod:`splitz_fast.checkpoints.cohen`);
#: ``"macer"``, MACER's, behind an input normalisation the caller states (:mod:`splitz_fast.checkpoints.macer`).
CHECKPOINT_FORMATS = ("splitz", "cohen", "macer")


def _check_format(format: str) -> str:
    if format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; valid formats: {', '.join(CHECKPOINT_FORMATS)}")
    return format


def save_checkpoint(obj: dict, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` atomically: to ``PATH.tmp``, then renamed over ``path`` (a crash mid-write
    leaves the previous checkpoint intact)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


_EXPECTED_CHECKPOINT = (f"expected a splitz_fast checkpoint (format {CHECKPOINT_FORMAT}) written by `splitz train` or "
                        "splitz_fast.train()")


def load_checkpoint_file(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                         format: str = "splitz", input_normalization: str | InputNormalization | None = None) -> dict:
    """Load a checkpoint with ``weights_only=True`` and check its format; one-line errors for anything else.
    ``format="cohen"``: a Cohen et al. checkpoint in this layout (:func:`~splitz_fast.checkpoints.cohen.read_cohen_checkpoint`),
    so :func:`checkpoint_digest` of it identifies either kind; ``format="macer"``: a MACER checkpoint behind
    ``input_normalization``, which only that format takes and which it requires
    (:func:`~splitz_fast.checkpoints.macer.read_macer_checkpoint`)."""
    check_device("device", str(device))  # else torch.load's error reads as a damaged file
    if _check_format(format) == "macer":
        return read_macer_checkpoint(path, device, normalization=input_normalization)
    if input_normalization is not None:
        raise ValueError(f"input_normalization belongs to format='macer'; a {format} checkpoint holds its own "
                         "normalisation in its model")
    if format == "cohen":
        return read_cohen_checkpoint(path, device)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint {path} is a folder; give a checkpoint file ({path / 'best.pt'} or "
                                f"{path / 'last.pt'} of a `splitz train` run)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception:  # pickle errors, truncated files, foreign objects
        raise ValueError(f"{path} is not a splitz_fast checkpoint: {unreadable_reason(path)}; "
                         f"{_EXPECTED_CHECKPOINT}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT or "model" not in ckpt:
        raise ValueError(f"{path} is not a splitz_fast checkpoint: {_EXPECTED_CHECKPOINT}{looks_like(ckpt)}")
    return ckpt


def checkpoint_digest(ckpt: dict) -> str:
    """SHA-256 identifying a checkpoint's model: its weights and the settings that made them, never file bytes.

    Covers the ``model`` state_dict tensors, sorted by name (name, dtype, shape, then the raw bytes), and the JSON
    (sorted keys) of ``model_spec`` and ``config``. Two bit-identical trainings give the same digest.
    """
    digest = hashlib.sha256()
    for name in sorted(ckpt["model"]):
        tensor = ckpt["model"][name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    settings = {"model_spec": ckpt.get("model_spec"), "config": ckpt.get("config")}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


#: What :func:`checkpoint_digest` covers, recorded beside it in certification sidecars.
CHECKPOINT_DIGEST_COVERS = ("sha256 over the model state_dict tensors sorted by name (name, dtype, shape, bytes) "
                            "and the JSON of model_spec and training config; not the file bytes")


def load_state_into(model: nn.Module, checkpoint: dict) -> nn.Module:
    """Load a checkpoint's weights into a model built from its ``model_spec``; a mismatch is one line saying how."""
    saved, expected = checkpoint["model"], model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        first = (missing or unexpected or reshaped)[0]
        raise ValueError(
            f"checkpoint weights do not fit the model {checkpoint.get('model_spec')} as this version builds it "
            f"({len(missing)} missing, {len(unexpected)} unexpected, {len(reshaped)} reshaped tensors, e.g. "
            f"{first!r}): it was written for another split or architecture")
    model.load_state_dict(saved)
    return model


def load_model(checkpoint: str | os.PathLike, device: str | torch.device = "cpu", *,
               format: str = "splitz",
               input_normalization: str | InputNormalization | None = None) -> tuple[SplitModel, dict]:
    """``(model, checkpoint dict)``: the model of a checkpoint written by ``splitz train`` (or, ``format="cohen"``,
    by Cohen et al.'s code; ``format="macer"``, by MACER's, behind ``input_normalization``), rebuilt from its
    ``model_spec``, on ``device`` and in eval mode (loaded with ``weights_only=True``)."""
    ckpt = load_checkpoint_file(checkpoint, device, format=format, input_normalization=input_normalization)
    if format in ("cohen", "macer"):
        try:
            return build_cohen_model(ckpt).to(device).eval(), ckpt
        except ValueError as err:
            raise ValueError(f"{checkpoint}: {err}") from None
    spec = ckpt.get("model_spec") or {}
    if "name" not in spec:
        raise ValueError(f"{checkpoint} does not name a model of the zoo (its model_spec has no 'name': e.g. written "
                         "by sz.train() for your own model); build that model, then model.load_state_dict("
                         "torch.load(path, weights_only=True)['model']) — its σ is checkpoint['config']['sigma']")
    try:
        model = load_state_into(build_model(spec["name"], **spec.get("kwargs", {})), ckpt)
    except ValueError as err:
        raise ValueError(f"{checkpoint}: {err}") from None
    return model.to(device).eval(), ckpt


@dataclass(frozen=True, eq=False, repr=False)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns.

    Attributes:
        model: the :class:`~splitz_fast.model.modules.SplitModel`, weights loaded, on the requested device, in eval mode.
        sigma: the training noise σ (``config["sigma"]``): certify at this σ (the paper trains at the test σ).
            ``None`` for Cohen et al.'s and MACER's checkpoints, which do not record σ: give the Smoother the σ it
            was trained at yourself.
        dataset: the dataset name it was trained on (``model_spec["dataset"]``; ``None`` if not recorded).
        epoch: the 0-based epoch after which it was saved (``best.pt``: the best validation epoch so far).
        digest: :func:`checkpoint_digest` (what certification sidecars record as ``checkpoint_digest``).
        model_spec, config: how the model was built and trained (plain dicts, as stored).
        data: the whole checkpoint dict (optimizer state, history, ...).
    """

    model: SplitModel
    sigma: float | None
    dataset: str | None
    epoch: int | None
    digest: str
    model_spec: dict[str, Any]
    config: dict[str, Any]
    data: dict[str, Any]

    def __repr__(self) -> str:
        """One line: what was trained, where, and how far (the weights and the optimizer state are not printed)."""
        name = self.model_spec.get("name", type(self.model).__name__)
        on = f" on {self.dataset}" if self.dataset else ""
        parameters = sum(p.numel() for p in self.model.parameters())
        optimizer = "with" if self.data.get("optimizer") else "without"
        return (f"LoadedCheckpoint({name}{on}, split_index={self.model.split_index}, epoch={self.epoch}, "
                f"sigma={self.sigma}, {parameters:,} parameters, {optimizer} optimizer state, "
                f"digest={self.digest[:12]}…)")


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                    format: str = "splitz",
                    input_normalization: str | InputNormalization | None = None) -> LoadedCheckpoint:
    """Load a ``splitz train`` checkpoint (``best.pt`` / ``last.pt``) ready to certify: the model on ``device`` in
    eval mode, with its σ and training settings (:class:`LoadedCheckpoint`). Loaded with
    ``torch.load(..., weights_only=True)``; a missing, damaged or foreign file is a one-line ``ValueError`` /
    ``FileNotFoundError``.

    ``format="cohen"`` loads a randomized-smoothing checkpoint of Cohen et al.'s code (``checkpoint.pth.tar`` of
    locuslab/smoothing's train.py and of SmoothAdv, consistency training, ... built on it; ``arch`` ``cifar_resnet20``,
    ``cifar_resnet110`` or ``resnet50``) into ``cifar_resnet20`` / ``cifar_resnet110`` / ``imagenet_resnet50`` at
    split 0, with the normalisation of that code as the model's ``Standardize`` (:mod:`splitz_fast.checkpoints.cohen`).
    ``model_spec`` is ``{"name", "format": "cohen", "arch", "dataset", "kwargs"}``, ``config`` is empty, ``epoch``
    0-based (the file stores epoch + 1), ``data`` the file's dict with its ``state_dict`` under this library's names
    as ``model``, and ``sigma`` is ``None``: these files do not record σ, so give it to the Smoother.

    ``format="macer"`` loads MACER's ``{'net', 'epoch'}`` files of its CIFAR ResNet the same way. They record no input
    normalisation (MACER trains on raw [0, 1] pixels), so ``input_normalization`` is required: ``"none"``,
    ``"cohen-cifar10"`` or ``"MEAN,STD"`` (:func:`~splitz_fast.checkpoints.macer.input_normalization`); it becomes
    the model's ``Standardize`` and ``model_spec["input_normalization"]``, covered by the digest.

    Example::

        ckpt = sz.load_checkpoint("runs/mnist-splitz/best.pt")
        r = sz.Smoother(ckpt.model, ckpt.sigma).certify(x, n0=100, n=100_000, alpha=0.001, seed=0)

        rs = sz.load_checkpoint("models/cifar10/resnet110/noise_0.25/checkpoint.pth.tar", format="cohen")
        r = sz.Smoother(rs.model, 0.25).certify(x, n0=100, n=100_000, alpha=0.001, seed=0)

        macer = sz.load_checkpoint("ckpt/440.pth", format="macer", input_normalization="none")
    """
    model, ckpt = load_model(path, device, format=format, input_normalization=input_normalization)
    spec, config = dict(ckpt.get("model_spec") or {}), dict(ckpt.get("config") or {})
    sigma = config.get("sigma")
    if sigma is not None:
        try:
            sigma = check_positive("sigma", sigma)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path} records an invalid training noise level ({err}); the file was edited or written "
                             "by other code") from None
    return LoadedCheckpoint(model=model, sigma=sigma, dataset=spec.get("dataset"),
                            epoch=ckpt.get("epoch"), digest=checkpoint_digest(ckpt), model_spec=spec, config=config,
                            data=ckpt)


__all__ = ["CHECKPOINT_DIGEST_COVERS", "CHECKPOINT_FORMAT", "CHECKPOINT_FORMATS", "LoadedCheckpoint",
           "checkpoint_digest", "load_checkpoint", "load_checkpoint_file", "load_model", "load_state_into",
           "save_checkpoint"]
