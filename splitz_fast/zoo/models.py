"""Model builders: the networks of the SPLITZ experiments, returned as :class:`~splitz_fast.model.modules.SplitModel`.

Every builder returns ``f = f_R ∘ f_L`` split after ``split_index`` affine layers (default 1, the paper's choice
for every dataset). ``f_L`` holds the input standardization (if any), the affine layers and a clipped ReLU with
``threshold`` θ after each; ``split_index=0`` gives ``f_L = identity`` (plain randomized smoothing), with any
standardization moved to the front of ``f_R`` so noise is added to the raw input.

Registered models (:data:`MODELS`, :func:`build_model`), input ``[B, ...]`` → valid ``split_index``:

* ``lenet`` (:func:`lenet`, advertorch LeNet-5): ``[B, 1, 28, 28]`` in [0, 1] → 0, 1
* ``lenet-splitz`` (:func:`lenet`, no first max-pool): ``[B, 1, 28, 28]`` in [0, 1] → 0, 1, 2
* ``lenet-rs-init`` (:func:`lenet_rs_init`, starts as RS with ``L(x, γ) = 1``; warm-starts from an RS ``lenet``):
  ``[B, 1, 28, 28]`` in [0, 1] → 1
* ``lenet-5x5`` (:func:`lenet`, the SPLITZ authors' first layer, conv 5×5 1 → 20; later layers reconstructed):
  ``[B, 1, 28, 28]`` in [0, 1] → 0, 1
* ``cifar_resnet20`` / ``56`` / ``110`` (:func:`cifar_resnet`): ``[B, 3, 32, 32]`` in [0, 1] → 0, 1
* ``imagenet_resnet50`` (:func:`imagenet_resnet50`): ``[B, 3, 224, 224]`` in [0, 1] → 0, 1
* ``mlp`` (:func:`tabular_mlp`): ``[B, in_features]`` → 0, …, ``len(hidden)``

ResNets split at 1 lose the BatchNorm after ``conv1`` (BatchNorm is not an affine layer with bounds in ``f_L``, and
residual blocks cannot sit in ``f_L`` at all). :func:`split_resnet` folds that BatchNorm into ``conv1`` (exact in eval
mode), so a trained torchvision-style ResNet can be split without changing its function apart from the clip at θ.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..model.layers import fold_batchnorm_into
from ..model.modules import ClippedReLU, LeftHalf, SplitModel, Standardize, affine_layers, split_sequential
from .pretrained import lenet5, pretrained_lenet5

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

MNIST_INPUT_SHAPE = (1, 28, 28)
CIFAR_INPUT_SHAPE = (3, 32, 32)
IMAGENET_INPUT_SHAPE = (3, 224, 224)

LENET_VARIANTS = ("advertorch", "splitz", "5x5")


def _check_split_index(split_index: int, largest: int, model_name: str, reason: str) -> None:
    """Raise ``ValueError`` unless ``split_index`` is an integer in ``[0, largest]``."""
    if isinstance(split_index, bool) or not isinstance(split_index, int) or not 0 <= split_index <= largest:
        valid = ", ".join(str(s) for s in range(largest + 1))
        raise ValueError(f"{model_name}: split_index must be one of {{{valid}}} ({reason}), got {split_index!r}")


# ----------------------------------------------------------------------------------------------------------------
# MNIST LeNet
# ----------------------------------------------------------------------------------------------------------------


def lenet_network(variant: str = "advertorch") -> nn.Sequential:
    """The unsplit MNIST LeNet, ``[B, 1, 28, 28] → [B, 10]`` logits.

    * ``"advertorch"``: conv(1→32, 3, p1)-ReLU-maxpool2-conv(32→64, 3, p1)-ReLU-maxpool2-flatten-fc(3136→200)-ReLU-
      fc(200→10) (:func:`splitz_fast.zoo.pretrained.lenet5`).
    * ``"splitz"``: the advertorch LeNet without its first max-pool, so both convolutions can go into ``f_L`` (as
      the SPLITZ paper splits after the first layer with no pool before it): conv(1→32, 3, p1)-ReLU-conv(32→64, 3,
      p1)-ReLU-maxpool2-flatten-fc(64·14·14→200)-ReLU-fc(200→10). Not the SPLITZ authors' own network, whose
      published code starts with a 5×5 convolution 1 → 20.
    * ``"5x5"``: the SPLITZ authors' MNIST LeNet as far as their published code shows it, the rest reconstructed:
      conv(1→20, 5)-ReLU-maxpool2-conv(20→50, 5)-ReLU-maxpool2-flatten-fc(800→500)-ReLU-fc(500→10). Evidence: the
      stored copy of their ``archs/cifar_resnet.py`` defines a LeNet whose first layer is a 5×5 convolution 1 → 20
      (no padding) followed by a clipped ReLU of shape ``[1, 20, 24, 24]``, with no pool before the split; the rest of
      that file is in no source available to us. **Every layer after the first is a reconstruction**: the classic
      LeNet that starts with exactly that layer (the PyTorch MNIST example's network, also the ``archs/lenet.py`` of
      randomized-smoothing code such as CAT-RS). Split at 1, ``f_L`` = conv 5×5 + clipped ReLU (``[B, 20, 24,
      24]``) and the first max-pool opens ``f_R``.
    """
    if variant == "advertorch":
        return lenet5()
    if variant == "splitz":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),      # [B, 32, 28, 28]
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),     # [B, 64, 28, 28]
            nn.MaxPool2d(2), nn.Flatten(),                  # [B, 64·14·14]
            nn.Linear(64 * 14 * 14, 200), nn.ReLU(), nn.Linear(200, 10),
        )
    if variant == "5x5":
        return nn.Sequential(
            nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2),      # [B, 20, 24, 24] → [B, 20, 12, 12]
            nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2),     # [B, 50, 8, 8] → [B, 50, 4, 4]
            nn.Flatten(), nn.Linear(50 * 4 * 4, 500), nn.ReLU(), nn.Linear(500, 10),
        )
    raise ValueError(f"unknown LeNet variant {variant!r}; valid variants: {', '.join(LENET_VARIANTS)}")


def lenet(
    split_index: int = 1,
    variant: str = "advertorch",
    threshold: float = 1.0,
    learnable_threshold: bool = False,
    threshold_per_element: bool = False,
    pretrained: bool = False,
) -> SplitModel:
    """MNIST LeNet (:func:`lenet_network`) split after ``split_index`` affine layers. Input ``[B, 1, 28, 28]`` in
    [0, 1] (no standardization), output ``[B, 10]`` logits.

    Valid splits: 0 to 4 (the number of affine layers). The 2×2 max-pools between affine layers go into ``f_L`` with
    them (non-overlapping, so 1-Lipschitz; see :func:`~splitz_fast.model.modules.check_pool`).

    Args:
        threshold: θ of the clipped ReLUs in ``f_L`` (``float('inf')`` keeps the network's function).
        learnable_threshold: make each θ an ``nn.Parameter``.
        threshold_per_element: one θ per activation element (32×28×28 at split 1) instead of one per layer.
        pretrained: load advertorch's clean-trained MNIST weights (``"advertorch"`` variant only; needs the
            ``advertorch==0.2.3`` distribution installed, see :func:`splitz_fast.zoo.pretrained.pretrained_lenet5`).
    """
    if pretrained and variant != "advertorch":
        raise ValueError(f"pretrained weights exist only for the 'advertorch' LeNet variant, not {variant!r}")
    network = pretrained_lenet5() if pretrained else lenet_network(variant)
    return split_sequential(
        network, split_index, num_classes=10, input_shape=MNIST_INPUT_SHAPE,
        threshold=threshold, learnable_threshold=learnable_threshold, threshold_per_element=threshold_per_element,
    )


# ----------------------------------------------------------------------------------------------------------------
# MNIST LeNet that starts as randomized smoothing
# ----------------------------------------------------------------------------------------------------------------

RS_INIT_DETECTORS = 8
RS_INIT_DETECTOR_KERNEL = 7


class RSInitLeNet(SplitModel):
    """``lenet-rs-init`` (:func:`lenet_rs_init`): a split-1 model whose ``f_R`` is an RS LeNet widened by zero input
    columns, so it warm-starts from an RS ``lenet`` checkpoint (split 0) rather than layer for layer."""

    @torch.no_grad()
    def warm_start_from_(self, source: SplitModel) -> None:
        """``f_R`` from an RS LeNet (``lenet`` at split 0): every weight copied; the widened first convolution takes
        the RS convolution as its input channel 0 and zeros on the detector channels. ``f_L`` stays as built, so the
        result classifies ``f_R(f_L(x) + δ)`` exactly as the RS network classifies ``x + δ[:, :1]``."""
        if source.split_index != 0:
            raise ValueError(f"lenet-rs-init starts from an RS model (split_index 0), not split {source.split_index}")
        theirs, ours = affine_layers(source), affine_layers(self)[1:]  # [1:]: skip f_L's convolution
        if len(theirs) != len(ours) or ours[0].weight[:, :1].shape != theirs[0].weight.shape or any(
                a.weight.shape != b.weight.shape for a, b in zip(theirs[1:], ours[1:])):
            raise ValueError("lenet-rs-init starts from the advertorch LeNet at split 0 (model lenet, split_index 0)")
        first = ours[0]
        first.weight.zero_()
        first.weight[:, :1].copy_(theirs[0].weight)
        first.bias.copy_(theirs[0].bias)
        for src, dst in zip(theirs[1:], ours[1:]):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)


def rs_init_left(detectors: int, detector_kernel: int, threshold: float, learnable_threshold: bool) -> LeftHalf:
    """``f_L`` of :func:`lenet_rs_init`: ``Conv2d(1 → 1 + detectors, detector_kernel, same padding)`` then a clipped ReLU
    with one θ per channel. Output ``[B, 1 + detectors, 28, 28]``.

    * Channel 0, the identity channel: a delta kernel (1 at the centre), bias 0, θ = 1, so on inputs in [0, 1] it
      outputs ``clip(x, 0, 1) = x`` exactly.
    * Channels 1…K, the detectors: weights 0, bias ``threshold / 2``, θ = ``threshold``: constant on every ball.

    Hence ``L(x, γ) = 1`` for every x in [0, 1] and γ > 0: the detectors' rows of the Jacobian are zero, and the
    identity channel's rows are the unit vectors of the pixels, every one varying on the ball (its interval
    ``[x − γ, x + γ]`` meets (0, 1)), so the masked operator is an identity padded with zero rows.
    """
    channels = 1 + detectors
    conv = nn.Conv2d(1, channels, detector_kernel, padding=detector_kernel // 2)
    activation = ClippedReLU(threshold, shape=(channels,), learnable=learnable_threshold)
    centre = detector_kernel // 2
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, centre, centre] = 1.0
        # Detectors sit at θ/2, inside the clipped ReLU's linear range: slope 1 there, so the gradient reaches their
        # weights. With bias 0 they would sit at the kink, where the ReLU's derivative is 0, and never train.
        conv.bias.fill_(threshold / 2)
        conv.bias[0] = 0.0
        activation.threshold[0] = 1.0
    return LeftHalf([conv], [activation], input_shape=MNIST_INPUT_SHAPE)


def widened_lenet(extra_channels: int) -> nn.Sequential:
    """:func:`~splitz_fast.zoo.pretrained.lenet5` with its first convolution taking ``1 + extra_channels`` input channels, the
    extra channels' weights 0 (so it computes the LeNet of channel 0 alone)."""
    network = lenet5()
    first = network[0]
    wide = nn.Conv2d(1 + extra_channels, first.out_channels, first.kernel_size, padding=first.padding)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, :1].copy_(first.weight)
        wide.bias.copy_(first.bias)
    network[0] = wide
    return network


def lenet_rs_init(
    split_index: int = 1,
    threshold: float = 1.0,
    learnable_threshold: bool = True,
    detectors: int = RS_INIT_DETECTORS,
    detector_kernel: int = RS_INIT_DETECTOR_KERNEL,
) -> RSInitLeNet:
    """An MNIST SPLITZ model that starts as randomized smoothing and can learn nonlinear detectors. Input
    ``[B, 1, 28, 28]`` in [0, 1], output ``[B, 10]`` logits; split 1 only.

    ``f_L`` = :func:`rs_init_left` (an identity channel and ``detectors`` detector channels, ``detector_kernel`` ×
    ``detector_kernel``); ``f_R`` = :func:`widened_lenet` (the advertorch LeNet of ``lenet`` at split 0, drawn from the
    same seed, its first convolution widened by zero columns). At initialisation, ``f_R(f_L(x) + δ)`` is the LeNet
    applied to ``x + δ_0`` (the noise of channel 0) and ``L(x, γ) = 1``: the certificate is RS's. An affine ``f_L``
    with ``‖A‖ ≤ 1`` can never do better than RS; SPLITZ gains only through ``f_L``'s nonlinearity at the scale of the
    certified ball, which the detectors (and the identity channel's gain and θ) are free to learn.

    Args:
        threshold: the detectors' initial θ (their bias is ``threshold / 2``); finite and > 0. The identity
            channel's θ is 1.
        learnable_threshold: make the per-channel θ an ``nn.Parameter``.
        detectors: K ≥ 0 detector channels.
        detector_kernel: odd kernel size of ``f_L``'s convolution.
    """
    if split_index != 1:
        raise ValueError(f"lenet-rs-init: split_index must be 1 (its f_L is one convolution), got {split_index!r}")
    if isinstance(detectors, bool) or not isinstance(detectors, int) or detectors < 0:
        raise ValueError(f"lenet-rs-init: detectors must be an integer >= 0, got {detectors!r}")
    if isinstance(detector_kernel, bool) or not isinstance(detector_kernel, int) or detector_kernel < 1 \
            or detector_kernel % 2 == 0:
        raise ValueError(f"lenet-rs-init: detector_kernel must be an odd positive integer, got {detector_kernel!r}")
    if not 0.0 < threshold < math.inf:
        raise ValueError(f"lenet-rs-init: threshold (the detectors' θ) must be finite and > 0, got {threshold!r}")
    right = widened_lenet(detectors)  # first: f_R draws the initial weights lenet(split_index=0) draws from a seed
    left = rs_init_left(detectors, detector_kernel, threshold, learnable_threshold)
    return RSInitLeNet(left, right, num_classes=10)


# ----------------------------------------------------------------------------------------------------------------
# ResNets (CIFAR and ImageNet) and how to split them
# ----------------------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Residual block ``ReLU(BN(conv3x3(ReLU(BN(conv3x3(x))))) + shortcut(x))``: ``[B, C_in, H, W] →
    [B, C_out, H/stride, W/stride]``. The shortcut is the identity, or a 1×1 convolution + BN where the shape
    changes (as in Cohen et al.'s CIFAR ResNet)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNet of He et al. (2016) as used by Cohen et al. (2019): depth ``6n + 2`` (20, 56, 110, …).

    ``[B, 3, 32, 32]`` (already standardized) → conv1 3→16 + BN + ReLU ``[B, 16, 32, 32]`` → ``layer1`` (n blocks,
    16 ch) ``[B, 16, 32, 32]`` → ``layer2`` (32 ch, stride 2) ``[B, 32, 16, 16]`` → ``layer3`` (64 ch, stride 2)
    ``[B, 64, 8, 8]`` → global average pool → ``fc`` → ``[B, num_classes]``. Attribute names follow torchvision's
    ResNet, so :func:`split_resnet` handles both.
    """

    def __init__(self, depth: int = 110, num_classes: int = 10):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(f"CIFAR ResNet depth must be 6n + 2 with n >= 1 (e.g. 20, 56, 110), got {depth!r}")
        blocks = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._stage(16, 16, blocks, stride=1)
        self.layer2 = self._stage(16, 32, blocks, stride=2)
        self.layer3 = self._stage(32, 64, blocks, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    @staticmethod
    def _stage(in_channels: int, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_channels, out_channels, stride)]
        layers += [BasicBlock(out_channels, out_channels) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new ``nn.Conv2d`` (with bias) equal to ``bn ∘ conv`` when ``bn`` is in eval mode (running statistics).

    ``w' = w · γ/√(var + ε)`` per output channel, ``b' = (b − mean) · γ/√(var + ε) + β``, computed in float64 and
    rounded to the convolution's dtype once (:func:`~splitz_fast.model.layers.fold_batchnorm_into`, the folder
    ``f_R``'s BatchNorms go through too). For a freshly initialized BatchNorm (γ = 1, β = 0, mean 0, var 1) this is
    ``conv`` scaled by ``1/√(1 + ε)``, i.e. removing the BatchNorm.
    """
    return fold_batchnorm_into(conv, bn)


def split_resnet(
    network: nn.Module,
    split_index: int,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    input_shape: Sequence[int],
    num_classes: int,
    threshold: float = 1.0,
    learnable_threshold: bool = False,
) -> SplitModel:
    """Split a torchvision-style ResNet (children ``conv1, bn1, relu, …, fc`` in forward order, e.g. torchvision's
    ``ResNet`` or :class:`CifarResNet`) at ``split_index`` ∈ {0, 1}.

    * ``0``: ``f_L`` = identity; ``f_R`` = ``Standardize(mean, std)`` then the whole ``network``.
    * ``1``: ``f_L`` = ``Standardize(mean, std)`` → ``conv1`` with ``bn1`` folded in (:func:`fold_batchnorm`) →
      :class:`ClippedReLU` (θ = ``threshold``); ``f_R`` = the remaining children (e.g. ``maxpool``, ``layer1…``,
      ``avgpool``) + ``flatten`` + ``fc``, under the same names as in ``network`` (so ``network``'s state-dict keys
      minus ``conv1.*``/``bn1.*`` load into ``f_R``).

    The network's modules are reused, not copied. With ``threshold=inf``, the split model in eval mode computes the
    same function as ``network(standardize(x))`` in eval mode (up to float rounding of the fold).
    """
    _check_split_index(split_index, 1, "ResNet", "residual blocks cannot sit in f_L; split 1 puts only conv1 there")
    standardize = Standardize(mean, std)
    if split_index == 0:
        left = LeftHalf([], [], input_shape=input_shape)
        right = nn.Sequential(OrderedDict(standardize=standardize, network=network))
        return SplitModel(left, right, num_classes=num_classes)

    children = list(network.named_children())
    names = [name for name, _ in children]
    if names[:3] != ["conv1", "bn1", "relu"] or names[-1] != "fc":
        raise ValueError(
            f"split_resnet expects a torchvision-style ResNet whose children start with conv1, bn1, relu and end "
            f"with fc; got {names}"
        )
    stem = fold_batchnorm(network.conv1, network.bn1)
    activation = ClippedReLU(threshold, learnable=learnable_threshold)
    left = LeftHalf([stem], [activation], standardize=standardize, input_shape=input_shape)
    rest = OrderedDict(children[3:-1])
    rest["flatten"] = nn.Flatten()
    rest["fc"] = network.fc
    return SplitModel(left, nn.Sequential(rest), num_classes=num_classes)


def cifar_resnet(
    depth: int = 110,
    split_index: int = 1,
    threshold: float = 1.0,
    learnable_threshold: bool = False,
    num_classes: int = 10,
    mean: Sequence[float] = CIFAR10_MEAN,
    std: Sequence[float] = CIFAR10_STD,
) -> SplitModel:
    """CIFAR ResNet-``depth`` (:class:`CifarResNet`) split at ``split_index`` ∈ {0, 1} (:func:`split_resnet`), with
    CIFAR-10 standardization. Input ``[B, 3, 32, 32]`` in [0, 1], output ``[B, num_classes]`` logits.

    Split 1: ``f_L`` = standardize → conv1 (3→16, 3×3, pad 1, BatchNorm removed) → clipped ReLU, output
    ``[B, 16, 32, 32]``; ``f_R`` = ``layer1..3`` → avgpool → flatten → fc.

    ``mean``/``std``: the standardization (default CIFAR-10's per-pixel statistics; Cohen et al.'s checkpoints were
    trained behind other ones, see :mod:`splitz_fast.checkpoints.cohen`).
    """
    _check_split_index(split_index, 1, f"cifar_resnet{depth}", "residual blocks cannot sit in f_L")
    return split_resnet(
        CifarResNet(depth, num_classes), split_index, mean=mean, std=std,
        input_shape=CIFAR_INPUT_SHAPE, num_classes=num_classes,
        threshold=threshold, learnable_threshold=learnable_threshold,
    )


def imagenet_resnet50(
    split_index: int = 1,
    threshold: float = 1.0,
    learnable_threshold: bool = False,
    num_classes: int = 1000,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> SplitModel:
    """torchvision ``resnet50(weights=None)`` (randomly initialized; weights are never downloaded) split at
    ``split_index`` ∈ {0, 1} (:func:`split_resnet`), with ImageNet standardization (``mean``/``std``). Input
    ``[B, 3, 224, 224]`` in [0, 1], output ``[B, num_classes]`` logits. Needs ``torchvision``.

    Split 1 (the paper's ImageNet model): ``f_L`` = standardize → conv1 (3→64, 7×7, stride 2, pad 3, BatchNorm
    removed) → clipped ReLU, output ``[B, 64, 112, 112]``; ``f_R`` = maxpool → ``layer1..4`` → avgpool → flatten → fc.
    """
    _check_split_index(split_index, 1, "imagenet_resnet50", "residual blocks cannot sit in f_L")
    try:
        from torchvision.models import resnet50
    except ImportError as err:  # torchvision is not a hard dependency of splitz_fast
        raise ImportError("imagenet_resnet50 needs torchvision: pip install torchvision") from err
    return split_resnet(
        resnet50(weights=None, num_classes=num_classes), split_index, mean=mean, std=std,
        input_shape=IMAGENET_INPUT_SHAPE, num_classes=num_classes,
        threshold=threshold, learnable_threshold=learnable_threshold,
    )


# ----------------------------------------------------------------------------------------------------------------
# Tabular MLP
# ----------------------------------------------------------------------------------------------------------------


def mlp_network(in_features: int, num_classes: int = 2, hidden: Sequence[int] = (64, 64)) -> nn.Sequential:
    """The unsplit MLP ``Linear-ReLU-…-Linear``: ``[B, in_features] → [B, num_classes]`` logits."""
    widths = [in_features, *hidden]
    for w in [*widths, num_classes]:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"layer widths must be positive integers, got in_features={in_features!r}, "
                             f"hidden={tuple(hidden)!r}, num_classes={num_classes!r}")
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], num_classes))
    return nn.Sequential(*layers)


def tabular_mlp(
    in_features: int,
    num_classes: int = 2,
    hidden: Sequence[int] = (64, 64),
    split_index: int = 1,
    threshold: float = 1.0,
    mean: Sequence[float] | torch.Tensor | None = None,
    std: Sequence[float] | torch.Tensor | None = None,
    learnable_threshold: bool = False,
    threshold_per_element: bool = False,
) -> SplitModel:
    """MLP for tabular data (:func:`mlp_network`) split after ``split_index`` ∈ {0, …, len(hidden)} hidden layers,
    or ``len(hidden) + 1``: the whole classifier in ``f_L`` (the Lipschitz-only model, certified without noise by
    :class:`~splitz_fast.certify.margin.MarginCertifier`). Input ``[B, in_features]``, output ``[B, num_classes]`` logits.

    Args:
        mean: optional per-feature standardization ``(x − mean)/std``, ``[in_features]`` (give ``std`` too, or
            neither); it belongs to ``f_L`` (to the front of ``f_R`` for ``split_index=0``).
        std: the standardization's per-feature std, ``[in_features]``, all > 0.
    """
    hidden = tuple(hidden)
    _check_split_index(split_index, len(hidden) + 1, "mlp",
                       "f_L holds the hidden layers, or with len(hidden) + 1 the whole classifier")
    standardize = None
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std for standardization, or neither")
    if mean is not None:
        standardize = Standardize(mean, std)
        if standardize.mean.numel() != in_features:
            raise ValueError(f"mean/std have {standardize.mean.numel()} entries but in_features is {in_features}")
    return split_sequential(
        mlp_network(in_features, num_classes, hidden), split_index, num_classes=num_classes,
        input_shape=(in_features,), standardize=standardize,
        threshold=threshold, learnable_threshold=learnable_threshold, threshold_per_element=threshold_per_element,
    )


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------


def _preset(builder: Callable[..., SplitModel], name: str, **fixed) -> Callable[..., SplitModel]:
    """``builder`` with some arguments fixed; passing a fixed argument again is an error, not a silent override."""

    def build(**kwargs) -> SplitModel:
        clash = sorted(set(kwargs) & set(fixed))
        if clash:
            raise TypeError(f"model {name!r} fixes {clash}; call {builder.__name__}(...) directly to choose them")
        return builder(**fixed, **kwargs)

    build.__name__ = name
    build.__doc__ = f"``{builder.__name__}({', '.join(f'{k}={v!r}' for k, v in fixed.items())}, **kwargs)``."
    return build


MODELS: dict[str, Callable[..., SplitModel]] = {
    "lenet": _preset(lenet, "lenet", variant="advertorch"),
    "lenet-splitz": _preset(lenet, "lenet-splitz", variant="splitz"),
    "lenet-rs-init": lenet_rs_init,
    "lenet-5x5": _preset(lenet, "lenet-5x5", variant="5x5"),
    "cifar_resnet20": _preset(cifar_resnet, "cifar_resnet20", depth=20),
    "cifar_resnet56": _preset(cifar_resnet, "cifar_resnet56", depth=56),
    "cifar_resnet110": _preset(cifar_resnet, "cifar_resnet110", depth=110),
    "imagenet_resnet50": imagenet_resnet50,
    "mlp": tabular_mlp,
}


def build_model(name: str, **kwargs) -> SplitModel:
    """Build a registered model by name (see :data:`MODELS`), passing ``kwargs`` to its builder, e.g.
    ``build_model("cifar_resnet110", split_index=0)`` or ``build_model("mlp", in_features=14)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)
