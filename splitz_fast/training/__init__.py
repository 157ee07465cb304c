"""Training: the SPLITZ loss and the resumable loop (:mod:`.loop`), and the recipes (:mod:`.recipes`).

``splitz_fast.training`` was one module before 0.2: its names are handed on here."""
from .loop import (
    TrainConfig, radius_weight_at, LipschitzObjective, PerSampleHinge, BatchMeanHinge, Lagrangian,
    philox_training_noise, torch_training_noise, splitz_loss, P_A_CLAMP, RadiusTerm, radius_penalty, ball_intervals,
    stability_penalty, flatness_penalty, held_out_part, epoch_order, evaluate, training_step, TrainResult, train,
    warm_start_
                   )

__all__ = [
    "TrainConfig", "radius_weight_at", "LipschitzObjective", "PerSampleHinge", "BatchMeanHinge", "Lagrangian",
    "philox_training_noise", "torch_training_noise", "splitz_loss", "P_A_CLAMP", "RadiusTerm", "radius_penalty",
    "ball_intervals", "stability_penalty", "flatness_penalty", "held_out_part", "epoch_order", "evaluate",
    "training_step", "TrainResult", "train", "warm_start_",
]
