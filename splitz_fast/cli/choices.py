"""The names the ``splitz`` parser offers as choices (datasets, models, recipes, bounds, protocols, precisions, ...),
written out here so that building the parser imports neither torch nor scipy: ``splitz --help`` and argument errors
cost a fraction of a second. Each list is the key set of the registry that defines it (named beside it);
``tests/cli/test_cli_startup.py`` holds the two equal."""
from __future__ import annotations

#: splitz_fast.data.datasets.DATASETS
DATASET_NAMES = ("mnist", "cifar10", "imagenet", "cifar10-samples", "imagenet-samples", "adult", "law_school")
#: splitz_fast.zoo.models.MODELS
MODEL_NAMES = ("lenet", "lenet-splitz", "lenet-rs-init", "lenet-5x5", "cifar_resnet20", "cifar_resnet56",
               "cifar_resnet110", "imagenet_resnet50", "mlp")
#: splitz_fast.training.recipes.RECIPES
RECIPE_NAMES = ("rs", "paper", "published-code", "warm-start", "rs-init", "constrained", "stable", "consistency")
#: splitz_fast.training.config.LIP_OBJECTIVES
LIP_OBJECTIVE_NAMES = ("per-sample-hinge", "batch-mean-hinge", "lagrangian")
#: splitz_fast.checkpoints.splitz.CHECKPOINT_FORMATS
CHECKPOINT_FORMATS = ("splitz", "cohen", "macer")
#: splitz_fast.checkpoints.macer.NAMED_NORMALIZATIONS
INPUT_NORMALIZATION_NAMES = ("none", "cohen-cifar10")
#: splitz_fast.checkpoints.cohen.COHEN_ARCHS: arch -> its dataset
COHEN_ARCH_DATASETS = {"cifar_resnet20": "cifar10", "cifar_resnet110": "cifar10", "resnet50": "imagenet"}
#: splitz_fast.bounds.radius.BOUNDS, BOUND_METHODS, GAMMA_SEARCHES
BOUNDS = ("local", "global")
BOUND_METHODS = ("auto", "exact", "probabilistic")
GAMMA_SEARCHES = ("bisection", "one-step")
#: splitz_fast.certify.protocols.PROTOCOLS
PROTOCOL_NAMES = ("sound", "displacement", "paper", "published-code")
#: splitz_fast.sampling.engine.PRECISIONS
PRECISION_NAMES = ("float32", "tf32", "bfloat16", "float16")
#: splitz_fast.certify.attacks.ATTACKS
ATTACK_NAMES = ("smooth-pgd", "smooth-fgsm", "pgd", "fgsm", "deepfool")
#: splitz_fast.runs.dataset_run.HELD_OUT_SPLIT
HELD_OUT_SPLIT = "heldout"
