"""splitz_fast: sound, fast SPLITZ (split Lipschitz randomized smoothing) for PyTorch.

Everything a user needs is importable from here::

    import splitz_fast as sz
    model = sz.split_sequential(net, 1, num_classes=10, input_shape=(1, 28, 28))
    result = sz.Smoother(model, sigma=0.5).certify(x, n0=100, n=100_000, alpha=0.001)

Workflow pieces: ``sz.build_model`` (model zoo), ``sz.get_dataset`` (offline/user datasets), ``sz.train`` (SPLITZ
loss, resumable), ``sz.load_checkpoint`` (a trained checkpoint's model and σ), ``sz.run_over_dataset`` (resumable
certification TSVs; ``sz.DatasetRun``: a checkpoint's run over its dataset, whole or one shard, as ``splitz certify``
runs it), ``sz.analysis`` (tables and plots), ``sz.attacks`` (l2 attacks on the smoothed and base classifiers, attack-based checks of certificates).
"""
from ._moved import MOVED, install as _install_moved_paths, moved_module
from .analysis.diagnostics import diagnose, neuron_states
from .analysis.envelope import envelope_report
from .bounds.certificate import certified_lambda_max
from .bounds.estimate import PowerIterationState, lipschitz_estimate
from .bounds.intervals import BallBounds, ball_bounds
from .bounds.lipschitz import LipschitzBound, global_lipschitz_bound, lipschitz_bound
from .bounds.radius import BoundOptions, RadiusSearch
from .certify.attacks import ATTACKS, AttackResult, Attacker, falsify_certificates
from .certify.margin import MarginCertifier
from .certify.protocols import (PROTOCOLS, CertificationProtocol, DisplacementCertificate, PaperAlgorithm1,
                                PublishedCode, SoundCertificate)
from .certify.sequential import (BetaBinomialCS, Decision, SequentialCertifier, SequentialCertifyResult,
                                 SequentialResult, certify_sequential, latent_thresholds)
from .certify.smoothing import ABSTAIN, CertifyResult, PredictResult, Smoother
from .certify.stats import clopper_pearson_lower, latent_radius, max_latent_radius, two_sided_binomial_pvalue
from .checkpoints.splitz import LoadedCheckpoint, checkpoint_digest, load_checkpoint
from .data.datasets import DATASETS, DatasetInfo, get_dataset
from .model.modules import ClippedReLU, LeftHalf, SplitModel, Standardize, split_sequential
from .model.snapshot import ModuleSnapshot
from .runs.dataset_run import DatasetRun
from .runs.loop import run_over_dataset
from .runs.shards import ShardSpec, merge_shards
from .runs.tasks import AttackRun, CertifyRun, MarginRun, PredictRun, RunTask
from .sampling.engine import NoiseStream, SamplingEngine
from .training.config import TrainConfig
from .training.loss import splitz_loss
from .training.loop import train
from .training.recipes import RECIPES, Recipe, recipe_config
from .zoo.models import MODELS, build_model, cifar_resnet, imagenet_resnet50, lenet, lenet_rs_init, tabular_mlp
from . import analysis
from .analysis import diagnostics, envelope
from .certify import attacks
from .training import recipes

_install_moved_paths()


def __getattr__(name: str):
    """``sz.<old module>`` (a 0.1 path, :data:`~splitz_fast._moved.MOVED`): the moved module, with a warning."""
    if name in MOVED:
        return moved_module(name)
    raise AttributeError(f"module 'splitz_fast' has no attribute {name!r}")


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
    "DatasetRun",
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
