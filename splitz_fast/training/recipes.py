"""Named training recipes (``splitz train --recipe NAME``): the settings that make one published way of training, with
their source, so a result can say which recipe produced it and another user can reproduce it.

A recipe fixes :class:`~splitz_fast.training.config.TrainConfig` fields and model options (split, clipped-ReLU thresholds);
options given on the command line (or keyword arguments of :func:`recipe_config`) override it, and fields a recipe
leaves alone keep TrainConfig's defaults (the paper's MNIST settings). Budget settings (epochs, batch size, learning
rate schedule) are not part of a recipe: they are the user's hardware budget, stated next to every result.

Recipes change which model training finds, never whether its certificates hold: certification bounds the trained
``f_L`` soundly whatever objective produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .config import TrainConfig

__all__ = ["Recipe", "RECIPES", "get_recipe", "recipe_config"]


@dataclass(frozen=True)
class Recipe:
    """One named recipe: ``train`` (TrainConfig fields), ``model`` (model options: ``split_index``, ``threshold``,
    ``learnable_threshold``, ``threshold_per_element``), whether it needs a warm-start checkpoint, and its source."""

    name: str
    source: str
    train: Mapping[str, Any] = field(default_factory=dict)
    model: Mapping[str, Any] = field(default_factory=dict)
    needs_init: bool = False


_PAPER_MODEL = {"split_index": 1, "threshold": 1.0, "learnable_threshold": False, "threshold_per_element": False}
_PAPER_TRAIN = {"lambda_start": 0.8, "lambda_end": 0.4, "theta_lip": 0.5, "gamma_train": 0.1, "power_iters": 5,
                "lip_objective": "per-sample-hinge", "gamma_ramp": False}

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(
        "rs",
        "Cohen et al. (ICML 2019): Gaussian data augmentation at the test σ; split 0, no Lipschitz term",
        train={"lambda_start": 0.0, "lambda_end": 0.0},
        model={"split_index": 0},
    ),
    Recipe(
        "paper",
        "SPLITZ paper, Sec. 4 and App. C (MNIST): split 1, clipped-ReLU θ = 1, λ 0.8 → 0.4 linearly, per-sample hinge "
        "at θ_lip = 0.5, γ_train = 0.1, 5 power steps",
        train=_PAPER_TRAIN, model=_PAPER_MODEL,
    ),
    Recipe(
        "published-code",
        "the published SPLITZ code's effective recipe: its loss (1 − κ)·CE + κ·L̂ on the batch-mean estimate L̂ while "
        "L̂ > θ_lip (cross-entropy alone below), the Lipschitz weight κ from 1.0 down to 0.7 linearly (its "
        "starting_kappa = 1.0, kappa = 0.7: the Lipschitz term starts with all the weight; λ = κ here), per-element "
        "learnable thresholds initialised at 1 (projected to ≥ 0), γ_train ramped linearly from 0 to 0.1. Caution: its "
        "first, Lipschitz-only epoch collapsed lenet-5x5 trained from scratch to a constant classifier, and undid an "
        "RS-pretrained one (docs/results/identification)",
        train={**_PAPER_TRAIN, "lambda_start": 1.0, "lambda_end": 0.7, "lip_objective": "batch-mean-hinge",
               "gamma_ramp": True},
        model={**_PAPER_MODEL, "learnable_threshold": True, "threshold_per_element": True},
    ),
    Recipe(
        "warm-start",
        "the paper's recipe started from a trained model's affine layers (--init: an RS checkpoint of the same σ, e.g. "
        "from --recipe rs), so f_R begins as a noise-robust classifier and the Lipschitz term only reshapes f_L",
        train=_PAPER_TRAIN, model=_PAPER_MODEL, needs_init=True,
    ),
    Recipe(
        "rs-init",
        "this library's recipe for model lenet-rs-init, started from an RS lenet checkpoint of the same σ (--init, e.g. "
        "from --recipe rs): the model is that RS classifier with L(x, γ) = 1 at the start (an identity channel in f_L, "
        "detector channels constant on every ball, f_R the RS network widened by zero columns); Gaussian-augmentation "
        "training of the whole model (λ = 0: the paper's hinge toward θ_lip = 0.5 would pull against L = 1, which "
        "is the starting point, not a fault), learnable per-channel thresholds (projected to ≥ 0), so the detectors "
        "can learn nonlinearity at the scale of the certified ball",
        train={"lambda_start": 0.0, "lambda_end": 0.0},
        model={"split_index": 1, "threshold": 1.0, "learnable_threshold": True, "threshold_per_element": False},
        needs_init=True,
    ),
    Recipe(
        "constrained",
        "this library's constrained recipe: minimise cross-entropy subject to mean L̂ ≤ L* (--lip-target, default 0.5) "
        "by a Lagrange multiplier with dual ascent (step 0.01 per training step, start 1.0) instead of a fixed λ "
        "schedule; the paper's model (split 1, θ = 1). Caution: on the MNIST LeNet (L̂ ≈ 3 at initialisation) these "
        "settings drove f_L to zero in the first epoch (docs/results/mnist-recipes); lower --dual-step first",
        train={**_PAPER_TRAIN, "lip_objective": "lagrangian", "lip_target": 0.5, "dual_step": 0.01, "dual_init": 1.0},
        model=_PAPER_MODEL,
    ),
    Recipe(
        "stable",
        "this library's recipe for f_L flat where it is certified: the paper's loss with the Lipschitz "
        "term's ball ramped per step from 0 to γ_train = 1.5 over the first half of training (Huang et al., NeurIPS "
        "2021: train on a ball at the radius to certify), a stability term (weight 0.5) that rewards f_L's neurons "
        "constant on that ball, inactive or saturated, from the certificate's interval bounds (Xiao et al., ICLR 2019, "
        "adapted to the clipped ReLU), and per-element learnable thresholds from 1 (projected to ≥ 0) that can move "
        "down to saturate; set --gamma-train to the radius you want to certify. Experimental: in a 4-epoch MNIST screen "
        "(docs/results/stable-recipe) it certified less than the paper's recipe, reaching its constant neurons by "
        "switching whole channels off",
        train={**_PAPER_TRAIN, "gamma_train": 1.5, "gamma_ramp": True, "gamma_ramp_fraction": 0.5,
               "stability_weight": 0.5, "stability_scale": 1.0},
        model={**_PAPER_MODEL, "learnable_threshold": True, "threshold_per_element": True},
    ),
    Recipe(
        "consistency",
        "Jeong & Shin (NeurIPS 2020), Gaussian augmentation + consistency regularization: split 0, 2 noise draws per "
        "input, the cross-entropy of each plus λ = 20 times the mean KL(p̂ ‖ p_j) of the draws' predictions p_j to "
        "their mean p̂ plus η = 0.5 times the entropy H(p̂) (their MNIST settings). For SPLITZ with it, add "
        "--noise-samples 2 --consistency-lambda 20 --consistency-eta 0.5 to another recipe",
        train={"lambda_start": 0.0, "lambda_end": 0.0, "noise_samples": 2, "consistency_lambda": 20.0,
               "consistency_eta": 0.5},
        model={"split_index": 0},
    ),
)}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_config(name: str | None, **overrides: Any) -> TrainConfig:
    """The validated TrainConfig of recipe ``name`` (``None``: TrainConfig's defaults) with ``overrides`` applied
    (keyword arguments whose value is ``None`` are treated as not given)."""
    base = dict(get_recipe(name).train) if name is not None else {}
    base.update({key: value for key, value in overrides.items() if value is not None})
    config = TrainConfig(**base).validate()
    if name is not None and get_recipe(name).needs_init and config.init_checkpoint is None:
        raise ValueError(f"recipe {name!r} starts from a trained checkpoint: give it with --init CHECKPOINT "
                         "(init_checkpoint=...)")
    return config
