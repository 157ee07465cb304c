"""Model pieces: the clipped ReLU, input standardization, the left half ``f_L`` and the split model.

A SPLITZ classifier is ``f = f_R ∘ f_L``. ``f_L`` (:class:`LeftHalf`) is an optional standardization followed by
``s`` affine layers (``nn.Conv2d`` / ``nn.Linear``), each followed by a :class:`ClippedReLU` (or by nothing, which
the bound code treats as an identity) and, between two affine layers, optionally by a non-overlapping
``nn.MaxPool2d`` (l2 1-Lipschitz and monotone, so the bounds pass through it). ``f_R`` is any module.
Noise is never added by a model: the smoother (:mod:`splitz_fast.certify.smoothing`) owns σ and adds it between the halves.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.thresholds import normalize_threshold
from .layers import AFFINE_KINDS, LayerRule, replaces_methods, rule_for
from .snapshot import hooked_modules, instance_overrides

AFFINE_TYPES = AFFINE_KINDS


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """Run ``model`` in eval mode (BatchNorm running statistics, no dropout) and restore its modes afterwards: votes
    must be i.i.d. draws of one fixed base classifier, and certifying must not change the model."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class ClippedReLU(nn.Module):
    """``ReLU_θ(z) = min(max(z, 0), θ)`` with a threshold that is a scalar, per channel or per element.

    Args:
        threshold: initial θ ≥ 0 (``float('inf')`` gives a plain ReLU).
        shape: shape of θ: ``()`` scalar, ``(C,)`` per channel (broadcast over dim 1 of ``[B, C, ...]``), or any shape
            that broadcasts to one activation under torch's rules, e.g. ``(C, H, W)``, ``(1, H, W)``, ``(H, 1)``,
            ``(F,)``. How θ is read is decided in one place, :func:`splitz_fast.kernels.thresholds.normalize_threshold`,
            which the bound code and the kernels use too; a shape it cannot read unambiguously is an error.
        learnable: whether θ is an ``nn.Parameter``. Optimizers can push it below zero; call
            :meth:`project_` after each step (the training loop does) — the bound code refuses negative θ.
    """

    def __init__(self, threshold: float = 1.0, shape: Sequence[int] = (), learnable: bool = False):
        super().__init__()
        if math.isnan(threshold) or threshold < 0:
            raise ValueError(f"ClippedReLU threshold must be >= 0, got {threshold}")
        value = torch.full(tuple(shape), float(threshold))
        if learnable:
            self.threshold = nn.Parameter(value)
        else:
            self.register_buffer("threshold", value)

    def broadcast_threshold(self, z: torch.Tensor) -> torch.Tensor:
        """θ shaped to broadcast against a pre-activation ``z`` of shape ``[B, ...]`` (the reading every bound uses)."""
        return normalize_threshold(self.threshold, tuple(z.shape[1:])).to(z.dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        theta = self.broadcast_threshold(z)
        return torch.minimum(F.relu(z), theta)

    @torch.no_grad()
    def expand_(self, shape: Sequence[int]) -> None:
        """Give θ the shape ``shape`` (e.g. one value per element of the activation), each entry starting from the
        value θ has now there; learnable stays learnable (a new parameter: build optimizers after this)."""
        value = normalize_threshold(self.threshold, tuple(shape)).expand(tuple(shape)).clone()
        if isinstance(self.threshold, nn.Parameter):
            self.threshold = nn.Parameter(value)
        else:
            self.threshold = value  # a registered buffer stays one when reassigned

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp θ to ≥ 0 in place (the projection step after an optimizer update)."""
        self.threshold.clamp_(min=0.0)

    def valid(self) -> torch.Tensor:
        """A 0-d bool tensor on θ's device, True when no θ is negative or NaN (not read on the host: callers batch
        this read with others, see :meth:`LeftHalf.check_structure`)."""
        return ~(torch.isnan(self.threshold) | (self.threshold < 0)).any()

    def check_valid(self) -> None:
        if not bool(self.valid()):
            raise ValueError(
                "ClippedReLU has a negative or NaN threshold; call .project_() after each optimizer step "
                "(bounds for negative thresholds are not defined); a NaN one in training means the run diverged "
                "(lower the learning rate)"
            )

    def extra_repr(self) -> str:
        return f"threshold_shape={tuple(self.threshold.shape)}, learnable={isinstance(self.threshold, nn.Parameter)}"


class Standardize(nn.Module):
    """``(x − μ) / sd`` per input channel (dim 1). It belongs to ``f_L``; its ``1/sd`` is folded into the first layer's
    weights by the bound code, and zero padding of the next convolution stays zero in standardized space."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        mean_t = torch.as_tensor(mean, dtype=torch.float32).flatten()
        std_t = torch.as_tensor(std, dtype=torch.float32).flatten()
        if mean_t.shape != std_t.shape:
            raise ValueError(f"mean and std must have the same length, got {mean_t.numel()} and {std_t.numel()}")
        if not torch.isfinite(std_t).all() or (std_t <= 0).any():
            raise ValueError(f"every std must be finite and > 0, got {std_t.tolist()}")
        self.register_buffer("mean", mean_t)
        self.register_buffer("std", std_t)

    def _view(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return t.to(x.dtype).view(1, -1, *([1] * (x.ndim - 2))) if x.ndim > 2 else t.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self._view(self.mean, x)) / self._view(self.std, x)

    def inverse_std(self, x: torch.Tensor) -> torch.Tensor:
        """``1/sd`` shaped to broadcast against ``x``."""
        return 1.0 / self._view(self.std, x)

    def per_element(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, sd)`` with one value per element of one input of the batch ``x`` (shape ``x.shape[1:]``)."""
        return (self._view(self.mean, x).expand_as(x[:1])[0], self._view(self.std, x).expand_as(x[:1])[0])


def check_pool(pool: nn.Module) -> None:
    """Refuse pooling the bounds cannot pass through: only ``nn.MaxPool2d`` with disjoint windows (stride = kernel
    size, no padding or dilation). Disjoint windows make it 1-Lipschitz in l2 (each output moves by at most the
    largest move in its own window); overlapping windows would multiply the bound by up to √(windows per input)."""
    if not isinstance(pool, nn.MaxPool2d) or replaces_methods(pool, nn.MaxPool2d, "forward"):
        raise TypeError(f"f_L may pool only with nn.MaxPool2d, got {type(pool).__name__}; move it into f_R")
    pair = nn.modules.utils._pair
    if pair(pool.kernel_size) != pair(pool.stride) or pair(pool.padding) != (0, 0) or pair(pool.dilation) != (1, 1) \
            or pool.return_indices:
        raise ValueError(
            f"f_L supports non-overlapping max-pooling only (stride = kernel_size, padding 0, dilation 1), got "
            f"{pool}; split before it or use such a pool"
        )


def check_affine(layer: nn.Module) -> LayerRule:
    """Refuse a layer of ``f_L`` the bounds cannot read, and return its rule: only the kinds of
    :data:`~splitz_fast.model.layers.AFFINE_KINDS` (``nn.Conv2d`` with ``groups=1`` and zero padding given as numbers,
    ``nn.Linear``), and no subclass with a forward of its own (the bounds apply the weight themselves; subclasses that
    only reparametrize the weight, such as ``torch.nn.utils.parametrize``'s, are fine)."""
    rule = rule_for(layer)
    rule.check(layer)
    return rule


def affine(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``layer``'s affine map (a checked layer, :func:`check_affine`) applied to ``h`` from its weight and bias, as the
    bound code reads them."""
    return rule_for(layer).apply(layer, h)


def check_activation(act: nn.Module) -> None:
    """Refuse an activation of ``f_L`` other than :class:`ClippedReLU` (``nn.Identity`` stands for none)."""
    if not isinstance(act, ClippedReLU) or replaces_methods(act, ClippedReLU, "forward", "broadcast_threshold"):
        raise TypeError(f"f_L activations must be ClippedReLU or None (nn.Identity), got {type(act).__name__}; "
                        "for a plain ReLU use ClippedReLU(float('inf'))")


def check_standardize(standardize: nn.Module) -> None:
    """Refuse a standardization of ``f_L`` other than :class:`Standardize` with finite ``std > 0``."""
    if not isinstance(standardize, Standardize) or replaces_methods(standardize, Standardize, "forward", "_view"):
        raise TypeError(f"f_L's standardize must be a splitz_fast.Standardize, got {type(standardize).__name__}")
    std = standardize.std
    if not torch.isfinite(std).all() or (std <= 0).any():
        raise ValueError(f"f_L's Standardize has std {std.tolist()}; every std must be finite and > 0")


class LeftHalf(nn.Module):
    """``f_L``: optional standardization, then affine layers each followed by a clipped ReLU (or nothing) and, before
    the next affine layer, optionally a non-overlapping max-pool.

    Args:
        layers: affine layers, ``nn.Conv2d`` (``groups=1``) or ``nn.Linear``. A ``Linear`` after a convolution sees the
            flattened activation (as ``nn.Flatten`` would give).
        activations: one per layer, a :class:`ClippedReLU` or ``None`` (no activation, e.g. the last layer of the
            paper's toy example).
        standardize: optional :class:`Standardize` applied first.
        input_shape: shape of one input without the batch dimension, e.g. ``(1, 28, 28)``.
        pools: one per layer, an ``nn.MaxPool2d`` with disjoint windows (see :func:`check_pool`) applied after that
            layer's activation, or ``None``. The last layer takes none: a pool after it belongs to ``f_R``.
    """

    def __init__(
        self,
        layers: Iterable[nn.Module],
        activations: Iterable[ClippedReLU | None] | None = None,
        standardize: Standardize | None = None,
        input_shape: Sequence[int] | None = None,
        pools: Iterable[nn.Module | None] | None = None,
    ):
        super().__init__()
        layers = list(layers)
        activations = [ClippedReLU(1.0) for _ in layers] if activations is None else list(activations)
        if len(activations) != len(layers):
            raise ValueError(f"got {len(layers)} affine layers but {len(activations)} activations")
        pools = [None] * len(layers) if pools is None else list(pools)
        if len(pools) != len(layers):
            raise ValueError(f"got {len(layers)} affine layers but {len(pools)} pools (use None for no pool)")
        self.layers = nn.ModuleList(layers)
        self.activations = nn.ModuleList([act if act is not None else nn.Identity() for act in activations])
        self.pools = nn.ModuleList([pool if pool is not None else nn.Identity() for pool in pools])  # no state
        self.standardize = standardize
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.check_structure()

    @property
    def depth(self) -> int:
        """Number of affine layers ``s``."""
        return len(self.layers)

    def activation(self, k: int) -> ClippedReLU | None:
        """Layer ``k``'s clipped ReLU, or ``None`` where it has none (an ``nn.Identity``). Anything else is refused:
        the bounds would otherwise treat an unknown activation as the identity."""
        act = self.activations[k]
        if type(act) is nn.Identity:
            return None
        check_activation(act)
        return act

    def pool(self, k: int) -> nn.MaxPool2d | None:
        """The max-pool after layer ``k``'s activation, or ``None`` (an ``nn.Identity``); a pool the bounds cannot pass
        through is refused (:func:`check_pool`)."""
        pool = self.pools[k] if k < len(self.pools) else None
        if pool is None or type(pool) is nn.Identity:
            return None
        check_pool(pool)
        return pool

    def check_structure(self) -> None:
        """Refuse, with one error that names the piece and the fix, anything in ``f_L`` *as it is now* that the bound
        code cannot bound soundly: a layer, activation, pool or standardization of another kind (or a subclass with its
        own ``forward``), an overlapping pool, a pool after the last layer, lists of different lengths, forward hooks
        (they may change an output the bound never sees), a negative or NaN threshold, NaN or Inf weights.

        Every bound calls this (:func:`~splitz_fast.bounds.intervals.ball_bounds`, the global bound), not only ``__init__``:
        ``f_L``'s pieces are ordinary module attributes that users replace after construction
        (``left.pools[0] = nn.MaxPool2d(3, 1, 1)``), and a check made once at construction would certify a network
        that is no longer the one being bounded."""
        depth = len(self.layers)
        if len(self.activations) != depth:
            raise ValueError(f"f_L has {depth} affine layers but {len(self.activations)} activations")
        if len(self.pools) != depth:
            raise ValueError(f"f_L has {depth} affine layers but {len(self.pools)} pools (nn.Identity for no pool)")
        if self.standardize is not None:
            check_standardize(self.standardize)
        for layer in self.layers:
            check_affine(layer)
        self._check_values()
        for k in range(depth):
            if self.pool(k) is not None and k == depth - 1:
                raise ValueError("a pool after the last affine layer of f_L belongs to f_R (the latent is taken "
                                 "before it)")
        hooked = [name or "f_L" for name in hooked_modules(self)]
        if hooked:
            raise ValueError(f"f_L has forward hooks on {', '.join(hooked)}: a hook may change an output the Lipschitz "
                             "bound does not see; remove them (handle.remove()) before bounding or certifying")
        overridden = instance_overrides(self)
        if overridden:
            raise ValueError(f"f_L has methods replaced on the instance ({', '.join(overridden)}): f_L is computed "
                             "from its layers' weights, as the Lipschitz bound reads them, so the replacement would "
                             "not run; delete the instance attribute (del module.forward) or move the layer into f_R")

    def _check_values(self) -> None:
        """Refuse NaN/Inf weights (they would reach the eigensolvers as an opaque solver error) and negative or NaN
        thresholds, with one host read for all of them (on a GPU one sync): the radius search calls this for every
        bound."""
        weights = [(f"layers[{k}].{name}", t) for k, layer in enumerate(self.layers)
                   for name, t in (("weight", layer.weight), ("bias", layer.bias)) if t is not None]
        activations = [act for k in range(len(self.layers)) if (act := self.activation(k)) is not None]
        flags = [torch.isfinite(t).all() for _, t in weights] + [act.valid() for act in activations]
        if not flags or bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all()):
            return
        bad = [name for name, t in weights if not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(f"f_L has NaN or Inf values in {', '.join(bad)}: no Lipschitz bound exists; load a "
                             "checkpoint without them (a diverged training run?)")
        for act in activations:
            act.check_valid()

    @staticmethod
    def layer_input(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Reshape ``h`` for ``layer`` (flatten before a Linear)."""
        return rule_for(layer).layer_input(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``f_L(x)``, computed by :func:`latent_of` (no submodule is called)."""
        return latent_of(self, x)

    @torch.no_grad()
    def thresholds_per_element_(self) -> None:
        """Give every clipped ReLU one θ per element of its activation (``(C, H, W)`` or ``(F,)``), starting from its
        current θ — the per-element learnable thresholds of the published SPLITZ code. Needs ``input_shape``."""
        if self.input_shape is None:
            raise ValueError("per-element thresholds need f_L's input_shape to know each activation's shape")
        h = torch.zeros((1, *self.input_shape), dtype=self.layers[0].weight.dtype if self.depth else torch.float32)
        h = self.standardize(h) if self.standardize is not None else h
        for k, (layer, pool) in enumerate(zip(self.layers, self.pools)):
            h = layer(self.layer_input(layer, h))
            act = self.activation(k)
            if act is not None:
                act.expand_(h.shape[1:])
                h = act(h)
            h = pool(h)

    def project_thresholds_(self) -> None:
        for k in range(self.depth):
            act = self.activation(k)
            if act is not None:
                act.project_()


def latent_of(left: LeftHalf, x: torch.Tensor) -> torch.Tensor:
    """``f_L(x)`` from the weights, thresholds, pool geometry and standardization constants that the bound code reads,
    with the functional ops it models: no submodule of ``left`` is called, so what a hook or a method replaced on an
    instance would compute cannot differ from what is bounded (:meth:`LeftHalf.check_structure` refuses both, and
    global module hooks never run here). The latent noise is added to is this function."""
    h = x
    if left.standardize is not None:
        check_standardize(left.standardize)
        h = (h - left.standardize._view(left.standardize.mean, h)) / left.standardize._view(left.standardize.std, h)
    for k, layer in enumerate(left.layers):
        rule = check_affine(layer)
        h = rule.apply(layer, rule.layer_input(h))
        act = left.activation(k)
        if act is not None:
            h = torch.minimum(F.relu(h), normalize_threshold(act.threshold, tuple(h.shape[1:])).to(h.dtype))
        pool = left.pool(k)
        if pool is not None:
            h = F.max_pool2d(h, pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)
    return h


class SplitModel(nn.Module):
    """``f = f_R ∘ f_L``. ``forward`` is the noiseless classifier; smoothing adds noise between the halves.

    ``split_index == 0`` (``left.depth == 0``) is plain randomized smoothing: ``f_L`` is the identity.
    """

    def __init__(self, left: LeftHalf, right: nn.Module, num_classes: int):
        super().__init__()
        self.left = left
        self.right = right
        self.num_classes = int(num_classes)
        self.check_structure()

    def check_structure(self) -> None:
        """Refuse halves that cannot be certified *as they are now* (certifiers call this on every call, since
        ``model.left`` / ``model.right`` may be replaced after construction): ``left`` must be a :class:`LeftHalf`
        that passes :meth:`LeftHalf.check_structure`, without standardization at split 0."""
        if not isinstance(self.left, LeftHalf) or replaces_methods(self.left, LeftHalf, "forward", "layer_input"):
            raise TypeError(f"model.left must be a splitz_fast.LeftHalf, got {type(self.left).__name__}; build f_L "
                            "with LeftHalf(...) or split_sequential()")
        if self.left.standardize is not None and self.left.depth == 0:
            raise ValueError("with split index 0, standardization belongs to f_R (noise is added to the raw input)")
        self.left.check_structure()

    @property
    def split_index(self) -> int:
        return self.left.depth

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        return self.left.input_shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.right(self.left(x))

    @torch.no_grad()
    def warm_start_from_(self, source: "SplitModel") -> None:
        """Initialise this model from a trained ``source``: its affine layers copied into this model's one for one, in
        network order, whatever the two splits are (an RS model, split 0, warm-starts split 1 of the same network).
        Thresholds stay as they are. ``ValueError`` when the affine layers do not match one for one. A model family
        whose architecture differs from its warm-start source overrides this."""
        theirs, ours = affine_layers(source), affine_layers(self)
        if len(theirs) != len(ours) or any(a.weight.shape != b.weight.shape for a, b in zip(theirs, ours)):
            raise ValueError("its affine layers do not match this model's one for one; warm-start from the same "
                             "architecture")
        for src, dst in zip(theirs, ours):
            dst.weight.copy_(src.weight)
            if dst.bias is not None:
                dst.bias.copy_(src.bias)


def affine_layers(model: SplitModel) -> list[nn.Module]:
    """The affine layers of ``f_R ∘ f_L`` in network order (``f_L``'s, then ``f_R``'s as ``modules()`` walks them)."""
    return [m for half in (model.left, model.right) for m in half.modules() if isinstance(m, AFFINE_TYPES)]


def split_sequential(
    network: nn.Sequential,
    split_index: int,
    *,
    num_classes: int,
    input_shape: Sequence[int],
    standardize: Standardize | None = None,
    threshold: float = 1.0,
    learnable_threshold: bool = False,
    threshold_per_element: bool = False,
) -> SplitModel:
    """Split a sequential network after its ``split_index``-th affine layer.

    Each affine layer that lands in ``f_L`` takes the activation that follows it: an ``nn.ReLU`` becomes a
    :class:`ClippedReLU` with ``threshold`` (``float('inf')`` keeps the network's function unchanged), a
    :class:`ClippedReLU` is kept, ``nn.Flatten`` is absorbed, a max-pool between two affine layers of ``f_L`` is kept
    if its windows are disjoint (:func:`check_pool`); any other module inside ``f_L`` (average pooling, BatchNorm,
    dropout, an overlapping max-pool) is an error. ``standardize`` (if given) goes to ``f_L`` for ``split_index ≥ 1`` and to the front of
    ``f_R`` for ``split_index == 0``. The module right after ``f_L``'s last affine layer joins ``f_L`` if it is an
    ``nn.ReLU`` or a :class:`ClippedReLU`; an affine layer (after an ``nn.Flatten`` or not) or the network's end may
    follow it too, and ``f_L`` then ends with the affine output. Any other module there (BatchNorm, Tanh, Sigmoid,
    GELU, a pool, dropout) is an error: it belongs to the layer's block, and the split would move it behind the noise
    (fold a BatchNorm into its layer with :func:`splitz_fast.zoo.models.fold_batchnorm`, or split before the layer).
    ``num_classes`` must be the size of the network's logits.

    The result shares its layers with ``network`` (nothing is copied: training one changes the other); pass
    ``copy.deepcopy(network)`` to keep ``network`` as it was. ``threshold=1.0`` (the default) clips ``f_L``'s ReLUs at 1,
    which changes a pretrained network's outputs; ``float('inf')`` keeps them. ``threshold_per_element`` gives each
    clipped ReLU of ``f_L`` one θ per element of its activation (:meth:`LeftHalf.thresholds_per_element_`).
    """
    if not isinstance(network, nn.Sequential) or type(network).forward is not nn.Sequential.forward:
        what = ("an nn.Sequential subclass with its own forward" if isinstance(network, nn.Sequential)
                else type(network).__name__)
        raise TypeError(f"split_sequential needs a plain nn.Sequential (it splits the network by its layers in order, "
                        f"so what a forward() does besides would be lost), got {what}; write the network as an "
                        "nn.Sequential with its activations and flatten as modules, or build the halves yourself: "
                        "SplitModel(LeftHalf(...), f_R, num_classes)")
    modules = list(network.children())
    n_affine = sum(isinstance(m, AFFINE_TYPES) for m in modules)
    if isinstance(split_index, bool) or not isinstance(split_index, int) or not 0 <= split_index <= n_affine:
        containers = [i for i, m in enumerate(modules) if _is_container(m)]
        raise ValueError(f"split_index must be an integer in [0, {n_affine}] for this network (it has {n_affine} "
                         f"affine layer{'s' if n_affine != 1 else ''} at its top level), got {split_index}"
                         + (_CONTAINER_HINT.format(containers) if containers else ""))
    layers: list[nn.Module] = []
    activations: list[ClippedReLU | None] = []
    pools: list[nn.Module | None] = []
    i = 0
    while len(layers) < split_index:
        m = modules[i]
        if isinstance(m, AFFINE_TYPES):
            layers.append(m)
            activations.append(None)
            pools.append(None)
        elif isinstance(m, nn.MaxPool2d) and layers and pools[-1] is None:
            # Max-pooling commutes with the (clipped) ReLU, so pool-then-ReLU networks split the same way.
            pools[-1] = m
        elif isinstance(m, nn.ReLU) and layers and activations[-1] is None:
            activations[-1] = ClippedReLU(threshold, learnable=learnable_threshold)
        elif isinstance(m, ClippedReLU) and layers and activations[-1] is None:
            activations[-1] = m
        elif isinstance(m, nn.Flatten):
            pass
        else:
            raise ValueError(
                f"module {i} ({type(m).__name__}) would fall inside f_L, which holds only affine layers, "
                f"(clipped) ReLUs and non-overlapping max-pools; choose a smaller split_index or restructure the network"
                + _misplaced_module_hint(i, m))
        i += 1
    # The activation right after the last affine layer of f_L belongs to f_L too.
    if layers and i < len(modules) and activations[-1] is None:
        if isinstance(modules[i], nn.ReLU):
            activations[-1] = ClippedReLU(threshold, learnable=learnable_threshold)
            i += 1
        elif isinstance(modules[i], ClippedReLU):
            activations[-1] = modules[i]
            i += 1
        else:
            _refuse_a_split_inside_a_block(modules, i)
    rest = modules[i:]
    if split_index == 0 and standardize is not None:
        rest = [standardize] + rest
        standardize = None
    left = LeftHalf(layers, activations, standardize=standardize, input_shape=input_shape, pools=pools)
    model = SplitModel(left, nn.Sequential(*rest), num_classes=num_classes)
    _check_input_shape(model, modules)
    if threshold_per_element:
        left.thresholds_per_element_()
    return model


def _refuse_a_split_inside_a_block(modules: Sequence[nn.Module], i: int) -> None:
    """Refuse a split between f_L's last affine layer and a module that belongs to its block (a BatchNorm, an
    activation other than ReLU, a pool, dropout): f_L would end with the bare affine output and that module would move
    into f_R, behind the noise — not the split asked for. An affine layer, ``nn.Flatten`` before one, or the network's
    end may follow: there the split point is a layer boundary."""
    following = next((m for m in modules[i:] if not isinstance(m, nn.Flatten)), None)
    if following is None or isinstance(following, AFFINE_TYPES):
        return
    index = modules.index(following)
    fix = ""
    if isinstance(following, nn.modules.batchnorm._BatchNorm):
        fix = ", or fold it into the layer before it (splitz_fast.zoo.models.fold_batchnorm(conv, bn))"
    elif isinstance(following, nn.MaxPool2d):
        fix = ", or put the ReLU before the pool (max-pooling commutes with it)"
    name = type(following).__name__
    raise ValueError(f"module {index} ({name}) follows f_L's last affine layer, so f_L would end without an "
                     f"activation and the {name} would move behind the noise; f_L's last affine layer may be followed "
                     f"only by a ReLU or ClippedReLU (taken into f_L), another affine layer or the network's end: split "
                     f"before that layer (a smaller split_index){fix}")


_CONTAINER_HINT = ("; split_sequential splits the network's top-level modules in order and does not look inside "
                   "containers (modules {} hold layers of their own): flatten nested blocks into one nn.Sequential, "
                   "e.g. nn.Sequential(*features, nn.Flatten(), *classifier)")


def _is_container(module: nn.Module) -> bool:
    """A module that only holds other layers (an ``nn.Sequential``, ``nn.ModuleList``, or a block without parameters
    of its own but with children): what ``split_sequential`` does not look into."""
    return (not isinstance(module, AFFINE_TYPES) and next(module.children(), None) is not None
            and not isinstance(module, (ClippedReLU, Standardize)))


def _misplaced_module_hint(index: int, module: nn.Module) -> str:
    """What to do instead, for a module that ``split_sequential`` cannot put into ``f_L``: a normalisation in front of
    the network belongs in ``standardize=``; a nested container is not looked into."""
    if index == 0 and (isinstance(module, Standardize) or (hasattr(module, "mean") and hasattr(module, "std"))):
        return ("; a normalisation in front of the network is passed as split_sequential(..., "
                "standardize=Standardize(mean, std)) and not as a layer (f_L's bound takes its 1/std into account)")
    if _is_container(module):
        return _CONTAINER_HINT.format([index])
    return ""


def _check_input_shape(model: SplitModel, modules: Sequence[nn.Module]) -> None:
    """Refuse an ``input_shape`` the network cannot take, or a ``num_classes`` its logits do not have, with one line
    naming it, at build time rather than at the first certify: one no-grad forward of a zero input of that shape in
    eval mode (modes restored, nothing changed; about 0.15 s for a ResNet-50 at 224×224 on one CPU core, less than
    building it)."""
    shape = model.input_shape
    first = next((p for p in model.parameters()), None)
    zero = torch.zeros((1, *shape), dtype=first.dtype if first is not None and first.is_floating_point()
                       else torch.float32, device=first.device if first is not None else None)
    try:
        with evaluating(model), torch.no_grad():
            logits = model(zero)
    except RuntimeError as err:
        affine = next((m for m in modules if isinstance(m, AFFINE_TYPES)), None)
        expects = ""
        if isinstance(affine, nn.Conv2d):
            expects = f" (its first layer, {affine}, takes {affine.in_channels}-channel images [C, H, W])"
        elif isinstance(affine, nn.Linear):
            expects = f" (its first layer, {affine}, takes {affine.in_features} features)"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"input_shape={tuple(shape)} does not fit the network{expects}: a zero input of that shape "
                         f"fails with \"{first_line}\"; pass the shape of one input the network was built for "
                         "(without the batch dimension)") from None
    if logits.shape != (1, model.num_classes):
        fits = f"; pass num_classes={logits.shape[1]}" if logits.ndim == 2 else " (logits [batch, classes] expected)"
        raise ValueError(f"num_classes={model.num_classes} does not match the network: its output for one input has "
                         f"shape {tuple(logits.shape)}{fits}")
