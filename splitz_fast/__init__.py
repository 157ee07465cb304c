"""splitz_fast: sound, fast SPLITZ (split Lipschitz randomized smoothing) for PyTorch.

Everything a user needs is importable from here::

    import splitz_fast as sz
    model = sz.split_sequential(net, 1, num_classes=10, input_shape=(1, 28, 28))
    result = sz.Smoother(model, sigma=0.5).certify(x, n0=100, n=100_000, alpha=0.001)

Workflow pieces: ``sz.build_model`` (model zoo), ``sz.get_dataset`` (offline/user datasets), ``sz.train`` (SPLITZ
loss, resumable), ``sz.load_checkpoint`` (a trained checkpoint's model and σ), ``sz.run_over_dataset`` (resumable
certification TSVs), ``sz.analysis`` (tables and plots), ``sz.attacks`` (l2 attacks on the smoothed and base classifiers, attack-based checks of certificates).
"""
from .bounds import BallBounds, ball_bounds
from .lipschitz import (
    LipschitzBound,
    PowerIterationState,
    certified_lambda_max,
    global_lipschitz_bound,
    lipschitz_bound,
    lipschitz_estimate,
)
from .modules import ClippedReLU, LeftHalf, SplitModel, Standardize, split_sequential
from .snapshot import ModuleSnapshot
from .smoothing import ABSTAIN, CertifyResult, PredictResult, Smoother
from .margin import MarginCertifier
from .sequential import (BetaBinomialCS, Decision, SequentialCertifier, SequentialCertifyResult, SequentialResult,
                         certify_sequential, latent_thresholds)
from .radius import BoundOptions, RadiusSearch
from .protocols import (PROTOCOLS, CertificationProtocol, DisplacementCertificate, PaperAlgorithm1, PublishedCode,
                        SoundCertificate)
from .sampling import NoiseStream, SamplingEngine
from .stats import clopper_pearson_lower, latent_radius, max_latent_radius, two_sided_binomial_pvalue
from .models import MODELS, build_model, cifar_resnet, imagenet_resnet50, lenet, lenet_rs_init, tabular_mlp
from .datasets import DATASETS, DatasetInfo, get_dataset
from .training import TrainConfig, splitz_loss, train
from .checkpoints import LoadedCheckpoint, checkpoint_digest, load_checkpoint
from .runs import AttackRun, CertifyRun, MarginRun, PredictRun, RunTask, ShardSpec, merge_shards, run_over_dataset
from .attacks import ATTACKS, AttackResult, Attacker, falsify_certificates
from .recipes import RECIPES, Recipe, recipe_config
from .envelope import envelope_report
from .diagnostics import diagnose, neuron_states
from . import analysis, attacks, diagnostics, envelope, recipes

__version__ = "0.2.0.dev0"

__all__ = [
    "ABSTAIN",
    "ATTACKS",
    "AttackResult",
    "Attacker",
    "attacks",
    "falsify_certificates",
    "RECIPES",
    "Recipe",
    "recipe_config",
    "recipes",
    "envelope",
    "envelope_report",
    "diagnose",
    "diagnostics",
    "neuron_states",
    "DATASETS",
    "DatasetInfo",
    "MODELS",
    "TrainConfig",
    "LoadedCheckpoint",
    "checkpoint_digest",
    "load_checkpoint",
    "analysis",
    "build_model",
    "cifar_resnet",
    "get_dataset",
    "imagenet_resnet50",
    "lenet",
    "lenet_rs_init",
    "run_over_dataset",
    "RunTask",
    "CertifyRun",
    "PredictRun",
    "MarginRun",
    "AttackRun",
    "ShardSpec",
    "merge_shards",
    "splitz_loss",
    "tabular_mlp",
    "train",
    "BallBounds",
    "BoundOptions",
    "ModuleSnapshot",
    "NoiseStream",
    "RadiusSearch",
    "PROTOCOLS",
    "CertificationProtocol",
    "SoundCertificate",
    "DisplacementCertificate",
    "PaperAlgorithm1",
    "PublishedCode",
    "SamplingEngine",
    "CertifyResult",
    "ClippedReLU",
    "LeftHalf",
    "LipschitzBound",
    "PowerIterationState",
    "PredictResult",
    "Smoother",
    "MarginCertifier",
    "BetaBinomialCS",
    "Decision",
    "SequentialCertifier",
    "SequentialCertifyResult",
    "SequentialResult",
    "certify_sequential",
    "latent_thresholds",
    "SplitModel",
    "Standardize",
    "ball_bounds",
    "certified_lambda_max",
    "clopper_pearson_lower",
    "global_lipschitz_bound",
    "latent_radius",
    "lipschitz_bound",
    "lipschitz_estimate",
    "max_latent_radius",
    "split_sequential",
    "two_sided_binomial_pvalue",
]
