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
import importlib

from ._moved import MOVED, install as _install_moved_paths, moved_module

# Each public name is imported from its module on first use (PEP 562): importing one light part of the package (the
# command line's parser, the reading of a results file) does not import torch and the whole stack with it.
_PUBLIC = {  # module under splitz_fast -> the public names it defines
    "analysis.diagnostics": ("diagnose", "neuron_states"),
    "analysis.envelope": ("envelope_report",),
    "analysis.headroom": ("headroom", "headroom_report"),
    "bounds.certificate": ("certified_lambda_max",),
    "bounds.estimate": ("PowerIterationState", "lipschitz_estimate"),
    "bounds.intervals": ("BallBounds", "ball_bounds"),
    "bounds.lipschitz": ("LipschitzBound", "global_lipschitz_bound", "lipschitz_bound"),
    "bounds.radius": ("BoundOptions", "RadiusSearch"),
    "certify.attacks": ("ATTACKS", "AttackResult", "Attacker", "falsify_certificates"),
    "certify.margin": ("MarginCertifier",),
    "certify.protocols": ("PROTOCOLS", "CertificationProtocol", "DisplacementCertificate", "PaperAlgorithm1",
                          "PublishedCode", "SoundCertificate"),
    "certify.sequential": ("BetaBinomialCS", "Decision", "SequentialCertifier", "SequentialCertifyResult",
                           "SequentialResult", "certify_sequential", "latent_thresholds"),
    "certify.smoothing": ("ABSTAIN", "CertifyResult", "PredictResult", "Smoother"),
    "certify.stats": ("clopper_pearson_lower", "latent_radius", "max_latent_radius", "two_sided_binomial_pvalue"),
    "checkpoints.splitz": ("LoadedCheckpoint", "checkpoint_digest", "load_checkpoint"),
    "data.datasets": ("DATASETS", "DatasetInfo", "get_dataset"),
    "model.modules": ("ClippedReLU", "LeftHalf", "SplitModel", "Standardize", "split_sequential"),
    "model.snapshot": ("ModuleSnapshot",),
    "runs.dataset_run": ("DatasetRun",),
    "runs.loop": ("run_over_dataset",),
    "runs.shards": ("ShardSpec", "merge_shards"),
    "runs.tasks": ("AttackRun", "CertifyRun", "MarginRun", "PredictRun", "RunTask"),
    "sampling.engine": ("NoiseStream", "SamplingEngine"),
    "training.config": ("TrainConfig",),
    "training.loss": ("splitz_loss",),
    "training.loop": ("train",),
    "training.recipes": ("RECIPES", "Recipe", "recipe_config"),
    "zoo.models": ("MODELS", "build_model", "cifar_resnet", "imagenet_resnet50", "lenet", "lenet_rs_init",
                   "tabular_mlp"),
}
_SUBMODULES = {  # sz.<name> -> the module itself
    "analysis": "analysis",
    "diagnostics": "analysis.diagnostics",
    "envelope": "analysis.envelope",
    "attacks": "certify.attacks",
    "recipes": "training.recipes",
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

_install_moved_paths()


def __getattr__(name: str):
    """A public name, imported from its module on first use; ``sz.<old module>`` (a 0.1 path,
    :data:`~splitz_fast._moved.MOVED`): the moved module, with a warning."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{_SUBMODULES[name]}")
    elif name in MOVED:
        return moved_module(name)
    else:
        raise AttributeError(f"module 'splitz_fast' has no attribute {name!r}")
    globals()[name] = value  # found once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.2.0.dev0"

__all__ = [*_WHERE, *_SUBMODULES]
