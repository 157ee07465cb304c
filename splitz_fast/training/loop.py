"""The resumable training loop: :func:`train` over epochs of :func:`training_step`, validation (:func:`evaluate`),
checkpoints, resume, and warm starts (:func:`warm_start_`). The loss it minimises: :mod:`splitz_fast.training.loss`.

A run lives in one folder: ``last.pt`` (written atomically after every epoch), ``best.pt`` (best validation noisy
accuracy: the paper's early stop), ``train.log`` (one JSON line per epoch, with its wall time). Checkpoints hold only
tensors and plain Python values, so they load with ``torch.load(..., weights_only=True)``, and no wall times, so
identical runs (same machine, torch version and thread count) write identical checkpoints
(:func:`~splitz_fast.checkpoints.splitz.checkpoint_digest` identifies them by content). The data order of epoch ``e`` depends only on
``(seed, e)``, so a run resumed from ``last.pt`` continues exactly as an uninterrupted one would
(:func:`~splitz_fast.training.batches.epoch_order`).

Data-parallel training (``torchrun ... -m splitz_fast train``): every rank takes its contiguous chunk of the same
global batch and the gradients are summed over the ranks, so the run follows the single-process run on the same
global batches (:class:`~splitz_fast.training.parallel.DataParallelGroup`); rank 0 writes the files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.data import Dataset
from tqdm import tqdm

from ..bounds.estimate import PowerIterationState, lipschitz_estimate
from ..data.datasets import class_names_of
from ..zoo.models import build_model
from ..model.modules import SplitModel
from ..checkpoints.splitz import CHECKPOINT_FORMAT, load_checkpoint_file, load_state_into, save_checkpoint
from .batches import _batches_of, _DatasetPart, _rank_batches, _smallest_batch, _split_train_val, epoch_order
from .config import TrainConfig, radius_weight_at
from .loss import splitz_loss
from .parallel import SINGLE_PROCESS, BatchRows, DataParallelGroup


@torch.no_grad()
def evaluate(model: SplitModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor, BatchRows]], config: TrainConfig,
             device: torch.device, group: DataParallelGroup = SINGLE_PROCESS) -> dict[str, float]:
    """Validation: accuracy under one draw of training noise, clean accuracy, and the mean training estimate L̂.

    ``batches``: ``(x, y, rows)`` — this rank's ``rows`` of each global validation batch (the whole batches in one
    process). The noise of a batch is drawn for the global batch and sliced, and the power iteration's random starts do
    not depend on the batch size, so every rank's rows get what one process would give them; the counts and sums are
    summed over ``group``, so every rank returns the same numbers, those of one process (L̂'s mean up to float
    rounding)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(config.seed + 10_000)
    correct_noisy = correct_clean = total = 0
    lip_sum = 0.0
    for x, y, rows in batches:
        latent = model.left(x)
        draws = torch.randn((rows.total, *latent.shape[1:]), device=device, generator=gen)[rows.start:rows.stop]
        noisy = latent + config.sigma * draws
        correct_noisy += int((model.right(noisy).argmax(1) == y).sum())
        correct_clean += int((model.right(latent).argmax(1) == y).sum())
        if model.split_index > 0:
            lip_sum += float(lipschitz_estimate(model.left, x, config.gamma_train, power_iters=config.power_iters,
                                                generator=gen).sum())
        total += len(y)
    model.train(was_training)
    sums = group.sum_(torch.tensor([correct_noisy, correct_clean, total, lip_sum], dtype=torch.float64,
                                   device=device)).tolist()
    correct_noisy, correct_clean, total, lip_sum = int(sums[0]), int(sums[1]), int(sums[2]), sums[3]
    return {"val_noisy_acc": correct_noisy / total, "val_clean_acc": correct_clean / total,
            "val_lip_estimate": lip_sum / total if model.split_index > 0 else 1.0}


def training_step(model: SplitModel, x: torch.Tensor, y: torch.Tensor, rows: BatchRows, config: TrainConfig,
                  lam: float, state: PowerIterationState, generator: torch.Generator,
                  optimizer: torch.optim.Optimizer,
                  group: DataParallelGroup = SINGLE_PROCESS, *,
                  gamma: float | None = None,
                  radius_weight: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimisation step of :func:`train` on this rank's ``rows`` of a global batch: the share's SPLITZ loss
    (:func:`~splitz_fast.training.loss.splitz_loss`), its gradient summed over ``group`` (the global batch's
    gradient), the optimizer step, the thresholds projected to ≥ 0. Returns the share's ``(loss, parts)``; summed
    over the ranks they are the batch's."""
    loss, parts = splitz_loss(model, x, y, config, lam, state, generator, rows=rows, gamma=gamma,
                              radius_weight=radius_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    group.sum_gradients(p for param_group in optimizer.param_groups for p in param_group["params"])
    optimizer.step()
    model.left.project_thresholds_()
    return loss, parts


@dataclass
class TrainResult:
    """What :func:`train` returns: every epoch's record (``history``), the best epoch (0-based, as ``train.log``'s
    ``epoch`` and a checkpoint's; ``-1`` before any) with its validation noisy accuracy, and the run folder."""

    history: list[dict[str, Any]] = field(default_factory=list)
    best_epoch: int = -1
    best_val_noisy_acc: float = -1.0
    out_dir: Path | None = None


#: The model_spec entries that ``splitz train`` wrote only off their default before it wrote every one: a spec without
#: them (a checkpoint of format 1 written before, or a spec given from Python) trained with these values.
MODEL_SPEC_DEFAULTS = {"split": "train", "recipe": None}


def _resume_(last_path: Path, config: TrainConfig, spec: dict[str, Any], model: SplitModel,
             optimizer: torch.optim.Optimizer, state, result: "TrainResult",
             device: torch.device) -> tuple[int, float, dict[str, Any]]:
    """Load ``last.pt`` into the model, optimizer, power-iteration state and history; returns the first epoch still to
    run, the Lagrangian's multiplier and the checkpoint. Refused, naming every difference, when it was written with other settings."""
    ckpt = load_checkpoint_file(last_path, device)
    # Fields added after a checkpoint was written read as their defaults (what that run effectively used); both
    # specs with the entries they leave out at their defaults, so that a spec recorded in full matches its earlier
    # form and a value off the default never matches an omission.
    previous = {**dataclasses.asdict(TrainConfig()), **ckpt["config"],
                "model_spec": {**MODEL_SPEC_DEFAULTS, **ckpt.get("model_spec", {})}}
    changed = [f"{key} ({previous.get(key)!r} in last.pt, {value!r} now)"
               for key, value in {**dataclasses.asdict(config), "model_spec": {**MODEL_SPEC_DEFAULTS, **spec}}.items()
               if previous.get(key) != value]
    if changed:
        raise ValueError(f"cannot resume {last_path}: it was written with another config or model: "
                         f"{'; '.join(changed)}; use the same settings or a new output folder")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    state.vectors = [v.to(device) for v in ckpt["power_vectors"]]
    result.history = list(ckpt["history"])
    result.best_epoch, result.best_val_noisy_acc = ckpt["best_epoch"], ckpt["best_val_noisy_acc"]
    return ckpt["epoch"] + 1, ckpt.get("multiplier", config.dual_init), ckpt


def _bring_in_line_with_last(out: Path, last: dict[str, Any] | None) -> None:
    """On resume (rank 0): the files that an interruption between an epoch's writes (:func:`_save_epoch`) left out of
    step with ``last.pt`` (``last``; ``None`` where the first epoch never finished) brought back in line with it.
    ``train.log`` loses its lines of later epochs (they are run again and logged again), cut off in place; ``best.pt``
    is written again where ``last.pt`` is the best epoch but ``best.pt`` is missing or older."""
    last_epoch = -1 if last is None else last["epoch"]
    log = out / "train.log"
    if log.exists():
        data, keep = log.read_bytes(), 0
        for line in data.splitlines(keepends=True):
            try:
                epoch = json.loads(line)["epoch"] if line.endswith(b"\n") else None
            except (ValueError, KeyError, TypeError):
                epoch = None
            if epoch is None or epoch > last_epoch:
                break
            keep += len(line)
        if keep < len(data):
            os.truncate(log, keep)
    best = out / "best.pt"
    if last is not None and last["best_epoch"] == last_epoch and (
            not best.exists() or load_checkpoint_file(best).get("epoch") != last_epoch):
        tmp = best.with_suffix(".pt.tmp")  # last.pt's bytes: the file best.pt would have been
        shutil.copyfile(out / "last.pt", tmp)
        os.replace(tmp, best)




def _train_epoch(model: SplitModel, train_part: "_DatasetPart", config: TrainConfig, epoch: int, multiplier: float,
                 state, optimizer: torch.optim.Optimizer, group: DataParallelGroup,
                 device: torch.device) -> tuple[dict[str, Any], float]:
    """One epoch's training steps; returns its record (losses summed over the ranks) and the multiplier after it.
    The epoch's data order and noise depend only on ``(seed, epoch)``, so a resumed run reproduces them."""
    lam = config.lambda_at(epoch)
    for param_group in optimizer.param_groups:
        param_group["lr"] = config.lr_at(epoch)
    # A loader (datasets with transforms) draws its workers' base seed from a generator seeded as the order's.
    order_seed = config.seed * 100_003 + epoch
    order = epoch_order(len(train_part), torch.Generator().manual_seed(order_seed))
    positions, rows = _rank_batches(_batches_of(order, config.batch_size, config.max_batches), group)
    noise_gen = torch.Generator(device=device).manual_seed(config.seed * 100_019 + epoch)
    model.train()
    sums = {"loss": 0.0, "ce": 0.0, "lip": 0.0, "stability": 0.0, "varying": 0.0, "flatness": 0.0, "radius": 0.0,
            "soft_radius": 0.0, "consistency_kl": 0.0, "consistency_entropy": 0.0}
    gamma = config.gamma_at(epoch)
    progress = tqdm(zip(train_part.batches(positions, torch.Generator().manual_seed(order_seed)), rows),
                    total=len(positions), desc=f"epoch {epoch} of 0-{config.epochs - 1}", leave=False,
                    disable=group.rank != 0)
    for batch, ((x, y), share) in enumerate(progress, start=1):
        weight = multiplier if config.objective.has_multiplier else lam
        gamma = config.gamma_at(epoch, batch - 1, len(positions))
        loss, parts = training_step(model, x, y, share, config, weight, state, noise_gen, optimizer, group,
                                    gamma=gamma, radius_weight=radius_weight_at(config, epoch, batch - 1, len(positions)))
        if "lip_batch_mean" in parts and config.objective.has_multiplier:  # dual ascent, the same on every rank
            multiplier = max(0.0, multiplier + config.dual_step * (parts["lip_batch_mean"] - config.lip_target))
        sums["loss"] += float(loss.detach())
        sums["ce"] += parts["ce"]
        sums["lip"] += parts.get("lip", share.share)  # no Lipschitz term: the estimate counts as 1
        sums["stability"] += parts.get("stability", 0.0)
        sums["varying"] += parts.get("varying", 0.0)
        sums["flatness"] += parts.get("flatness", 0.0)
        sums["radius"] += parts.get("radius", 0.0)
        sums["soft_radius"] += parts.get("soft_radius", 0.0)
        sums["consistency_kl"] += parts.get("consistency_kl", 0.0)
        sums["consistency_entropy"] += parts.get("consistency_entropy", 0.0)
        progress.set_postfix(loss=f"{sums['loss'] / batch:.4f}")
    progress.close()
    totals = group.sum_(torch.tensor(list(sums.values()), dtype=torch.float64, device=device)).tolist()
    batches = len(positions)
    record = {"epoch": epoch, "lr": config.lr_at(epoch), "lambda": lam, "gamma_train": gamma,
              "train_loss": totals[0] / batches, "train_ce": totals[1] / batches,
              "train_lip_estimate": totals[2] / batches}
    if config.stability_weight > 0 and model.split_index > 0:  # the stability term and the share it counts
        record.update(train_stability=totals[3] / batches, train_varying=totals[4] / batches)
    if config.flatness_weight > 0 and model.split_index > 0:  # log(L̂² n / ‖A‖_F²): 0 for a flat spectrum
        record.update(train_flatness=totals[5] / batches)
    if config.radius_weight > 0:  # the radius hinge (unweighted), the mean soft radius r̃ and the last step's weight
        record.update(train_radius=totals[6] / batches, train_soft_radius=totals[7] / batches,
                      radius_weight=radius_weight_at(config, epoch, batches - 1, batches))
    if config.consistency_lambda > 0 or config.consistency_eta > 0:  # the two consistency terms, unweighted
        record.update(train_consistency_kl=totals[8] / batches, train_consistency_entropy=totals[9] / batches)
    return record, multiplier


def _save_epoch(ckpt: dict[str, Any], out: Path, improved: bool, timed_record: dict[str, Any]) -> None:
    """Rank 0's files after an epoch, in an order that a resume can repair wherever an interruption falls between
    them (:func:`_bring_in_line_with_last`): the epoch's line of ``train.log`` (wall times there only: checkpoints of
    identical runs must be identical), ``last.pt``, then ``best.pt`` when the epoch improved."""
    with (out / "train.log").open("a") as fh:
        fh.write(json.dumps(timed_record) + "\n")
    save_checkpoint(ckpt, out / "last.pt")
    if improved:
        save_checkpoint(ckpt, out / "best.pt")


def train(
    model: SplitModel,
    train_set: Dataset,
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    model_spec: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    resume: bool = False,
    stop_after_epochs: int | None = None,
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
    data_parallel: DataParallelGroup = SINGLE_PROCESS,
) -> TrainResult:
    """Train ``model`` with the SPLITZ loss (RS loss when ``split_index == 0``) and write checkpoints to ``out_dir``.

    Args:
        train_set: dataset of ``(x, y)``; ``config.val_fraction`` of it (seeded) is held out for validation. Where it
            names its classes (torchvision's ``classes``, e.g. an ``ImageFolder``'s folders), checkpoints record them
            as ``class_names``, and ``splitz certify`` refuses a dataset that names them otherwise.
        model_spec: how to rebuild the model (e.g. ``{"name": "lenet", "split_index": 1}``), stored in checkpoints.
        resume: continue from ``out_dir/last.pt``; refused if that run used a different config or model spec.
            Without ``resume``, an existing ``last.pt`` is an error (nothing is overwritten silently); with it, a
            folder without ``last.pt`` trains from epoch 0 with a :class:`UserWarning` that says so.
        stop_after_epochs: stop (as an interruption would) after this many epochs of *this call*.
        on_epoch_end: called with each epoch's record (rank 0 only).
        data_parallel: this process's rank among the processes training together
            (:class:`~splitz_fast.training.parallel.DataParallelGroup`, its process group initialised); each step's
            global batch, of ``config.batch_size`` rows as in one process, is shared out in contiguous chunks and the
            gradients are summed, so the weights follow the single-process run's (float rounding apart). Validation is shared out and summed the same way, so every rank sees the
            same numbers and picks the same best epoch. Rank 0 alone writes ``last.pt``, ``best.pt`` and
            ``train.log`` (the others wait at a barrier); with ``resume`` every rank reads ``last.pt``, which must be
            on a file system all ranks see. Refused for models with BatchNorm (their batch statistics would be each
            rank's, not the global batch's).
    """
    config.validate()
    group = data_parallel
    train_indices, val_indices = _split_train_val(len(train_set), config.val_fraction, config.seed)
    group.check_batches(_smallest_batch(len(train_indices), config.batch_size, config.max_batches), "training")
    group.check_batches(_smallest_batch(len(val_indices), config.batch_size, config.max_batches), "validation")
    if group.world_size > 1 and any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))
                                    for m in model.modules()):
        raise ValueError("torchrun training of a model with BatchNorm is not supported: each rank would normalise "
                         "with its own chunk's batch statistics; train it in one process")
    if config.flatness_weight > 0 and model.split_index > 0 and model.left.depth != 1:
        raise ValueError(f"flatness_weight needs a one-layer f_L (split_index 1); this f_L has {model.left.depth} "
                         "layers")
    group.check_process_group()
    device = torch.device(device)
    out = Path(out_dir)
    last_path = out / "last.pt"
    config_dict = dataclasses.asdict(config)
    spec = dict(model_spec or {})
    class_names = class_names_of(train_set)

    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    state = group.power_iteration_state()
    result = TrainResult(out_dir=out)
    objective = config.objective
    start_epoch, multiplier = 0, config.dual_init  # the Lagrangian's μ (unused by the hinges)
    last = None
    if not last_path.exists() and (out / "best.pt").exists():
        leftovers = [name for name in ("best.pt", "train.log") if (out / name).exists()]
        raise FileExistsError(f"{out} holds {' and '.join(leftovers)} of a run but no last.pt, so that run can neither "
                              "continue nor be overwritten; restore last.pt (then resume), or choose another output "
                              "folder")
    log = out / "train.log"
    if not last_path.exists() and log.exists() and len(log.read_bytes().splitlines()) > 1:
        raise FileExistsError(f"{out} holds the train.log of a run of several epochs but no last.pt, so that run can "
                              "neither continue nor be overwritten; restore last.pt (then resume), or choose another "
                              "output folder")
    if not resume and (last_path.exists() or log.exists()):
        what = f"{last_path} exists" if last_path.exists() else f"{out} holds a run stopped in its first epoch"
        raise FileExistsError(f"{what}: pass resume=True (--resume) to continue that run, or choose another output "
                              "folder")
    if resume and not last_path.exists() and group.rank == 0:
        # Job scripts pass --resume whether or not there is a run to continue; a mistyped OUTDIR should still show.
        # (The command line shows this warning as "--resume: ...".)
        warnings.warn(f"resume=True: {out} holds no checkpoint (last.pt); training from epoch 0", stacklevel=2)
    if last_path.exists():
        start_epoch, multiplier, last = _resume_(last_path, config, spec, model, optimizer, state, result, device)
    elif config.init_checkpoint is not None:
        warm_start_(model, load_checkpoint_file(config.init_checkpoint, device), config)
    # Every rank has read last.pt (or found none) before rank 0 can write one: this is a collective.
    group.broadcast_from_rank0(model)
    if resume and group.rank == 0:
        _bring_in_line_with_last(out, last)
    train_part = _DatasetPart(train_set, train_indices, device, config.num_workers, model.num_classes)
    val_part = _DatasetPart(train_set, val_indices, device, config.num_workers, model.num_classes)
    out.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no empty folder behind
    val_positions, val_rows = _rank_batches(
        _batches_of(torch.arange(len(val_part)), config.batch_size, config.max_batches), group)
    epochs_run = 0
    for epoch in range(start_epoch, config.epochs):
        if stop_after_epochs is not None and epochs_run >= stop_after_epochs:
            break
        start = time.perf_counter()
        record, multiplier = _train_epoch(model, train_part, config, epoch, multiplier, state, optimizer, group,
                                          device)
        _check_not_diverged(model, record, config, epoch)
        seconds = time.perf_counter() - start
        val_batches = ((x, y, share) for (x, y), share in zip(val_part.batches(val_positions, None), val_rows))
        record.update(evaluate(model, val_batches, config, device, group))
        if objective.has_multiplier:  # the Lagrangian's μ after the epoch's last step
            record["multiplier"] = multiplier
        # Wall times go to train.log only: checkpoints of identical runs must be identical.
        result.history.append(record)
        timed_record = {**record, "epoch_seconds": seconds}
        improved = record["val_noisy_acc"] > result.best_val_noisy_acc
        if improved:
            result.best_epoch, result.best_val_noisy_acc = epoch, record["val_noisy_acc"]
        if group.rank == 0:
            ckpt = {"format": CHECKPOINT_FORMAT, "config": config_dict, "model_spec": spec,
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                    "power_vectors": [v.detach().cpu() for v in state.vectors if v is not None],
                    "multiplier": multiplier,
                    "history": result.history, "best_epoch": result.best_epoch,
                    "best_val_noisy_acc": result.best_val_noisy_acc}
            if class_names is not None:
                ckpt["class_names"] = class_names
            _save_epoch(ckpt, out, improved, timed_record)
            if on_epoch_end is not None:
                on_epoch_end(timed_record)
        group.barrier()
        epochs_run += 1
    return result


def _check_not_diverged(model: SplitModel, record: dict[str, Any], config: TrainConfig, epoch: int) -> None:
    """Stop a run whose epoch ended with a non-finite loss or weights, before its validation and checkpoints: a NaN
    model would otherwise be validated (argmax reads NaN as a class) and could be saved as ``best.pt``. The loss is
    summed over the ranks and the weights are the same on every rank, so all ranks stop together."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if math.isfinite(record["train_loss"]) and not bad:
        return
    shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    kept = "last.pt and best.pt hold earlier epochs" if epoch > 0 else "no checkpoint was written"
    raise ValueError(f"training diverged in epoch {epoch}: mean loss {record['train_loss']:.4g}"
                     f"{f', non-finite weights in {shown}' if bad else ''}; nothing of this epoch was saved ({kept}). "
                     f"Lower the learning rate (lr {config.lr_at(epoch):g} in this epoch) or check the data for "
                     "NaN/Inf, and train into a new output folder")


def warm_start_(model: SplitModel, checkpoint: dict, config: TrainConfig) -> SplitModel:
    """Initialise ``model`` from a checkpoint's model as ``model.warm_start_from_`` does
    (:meth:`~splitz_fast.model.modules.SplitModel.warm_start_from_`: by default its affine layers one for one, whatever the
    two splits are; a model family may define its own, e.g. ``lenet-rs-init`` from an RS ``lenet``). Thresholds and
    optimizer state start fresh. Refused when the checkpoint was trained at another σ or does not fit ``model``.
    """
    spec = checkpoint.get("model_spec") or {}
    trained_sigma = (checkpoint.get("config") or {}).get("sigma")
    if trained_sigma != config.sigma:
        raise ValueError(f"--init {config.init_checkpoint} was trained at σ = {trained_sigma}, this run at σ = "
                         f"{config.sigma}; warm-start from a checkpoint of the same σ")
    source = load_state_into(build_model(spec["name"], **spec["kwargs"]), checkpoint)
    try:
        model.warm_start_from_(source)
    except ValueError as err:
        raise ValueError(f"--init {config.init_checkpoint} is a {spec.get('name')}: {err}") from None
    return model
