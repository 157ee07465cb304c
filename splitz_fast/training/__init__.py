"""Training: its settings (:mod:`.config`), the SPLITZ loss (:mod:`.loss`), the data of a run (:mod:`.batches`), the
resumable loop (:mod:`.loop`), data-parallel training (:mod:`.parallel`), and the recipes (:mod:`.recipes`).

``splitz_fast.training`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .config import TrainConfig, radius_weight_at, LipschitzObjective, PerSampleHinge, BatchMeanHinge, Lagrangian
from .loss import (
    philox_training_noise, torch_training_noise, splitz_loss, P_A_CLAMP, RadiusTerm, radius_penalty, ball_intervals,
    stability_penalty, flatness_penalty,
)
from .batches import held_out_part, epoch_order
from .loop import evaluate, training_step, TrainResult, train, warm_start_

__all__ = [
    "TrainConfig", "radius_weight_at", "LipschitzObjective", "PerSampleHinge", "BatchMeanHinge", "Lagrangian",
    "philox_training_noise", "torch_training_noise", "splitz_loss", "P_A_CLAMP", "RadiusTerm", "radius_penalty",
    "ball_intervals", "stability_penalty", "flatness_penalty", "held_out_part", "epoch_order", "evaluate",
    "training_step", "TrainResult", "train", "warm_start_",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.training``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
