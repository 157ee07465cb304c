"""``f_R``'s weights cast once to a reduced sampling precision on the CPU, where the engine measures that faster.

With ``precision="bfloat16"`` (or ``"float16"``) the engine scores a batch under autocast
(:meth:`~splitz_fast.sampling.engine.SamplingEngine._scores`), which casts every convolution's and linear layer's
weight and bias to that dtype again at every call (its weight cache is off: it would live for one call anyway, and a
CUDA graph capture must not use it). The cast copy holds those casts, made once: a deep copy of the prepared module
with its parameters and buffers in the precision's dtype, still channels_last. Its scores are those of autocast's
(the same round-to-nearest casts of the same weights, the same oneDNN kernels; checked on a real batch against the
autocast scores by :class:`CastChoice`), so it is the same base classifier: the precision the result is labelled
with. The noise is still drawn and added to the latent in float32 and cast after the sum (SPEC §2).

Measured on an AMD EPYC (Zen 4, AVX-512 BF16, no AMX), one thread, advertorch's LeNet at s = 0: 37.0 against 38.5 us
per sample at batch 64, 38.9 against 45.3 at batch 256 — a few percent, which is why it is a measured choice and
not a rule; float32 ``f_R`` is 64-71 us per sample there.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .choices import CopyChoice, Option


# Modules whose computation autocast keeps in float32 on the CPU (normalizations, softmax): cast to bf16 they would
# compute another function than under autocast, so an f_R holding one keeps autocast.
AUTOCAST_FLOAT32_MODULES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax)


class CastChoice(CopyChoice):
    """A sampling engine's use of the cast copy of ``f_R`` (:func:`cast_copy`) instead of autocast, one decision per
    :class:`~splitz_fast.sampling.choices.Variant` (layout and batch of rows): decided on the CPU only, where the
    precision is reduced, by the check and timing of a whole copy
    (:meth:`~splitz_fast.sampling.choices.CopyChoice.choose`: the cast
    copy must score a real batch like autocast within the copy tolerance, then the faster is used). A cast copy that
    fails or scores differently warns once (an error under ``SPLITZ_STRICT=1``) and autocast samples; one measured
    slower is not used; an ``f_R`` with a layer it does not :meth:`take <takes>` keeps autocast. ``considered``: a reduced ``precision`` on a CPU ``device``, unless ``f_R`` runs compiled
    (``compile=True``: the compiled copy is made from the autocast one)."""

    OPTION = Option("cast_weights", "autocast", "cast")
    AUTO_DEVICES = ("cpu",)
    FORCED_DEVICES = None

    def __init__(self, dtype: torch.dtype, device: torch.device, compile: bool | None):
        super().__init__(False if dtype == torch.float32 or compile else None, device)

    @staticmethod
    def takes(module: nn.Module) -> bool:
        """Whether a layer of the prepared copy computes in the cast copy what it does under autocast: not one of
        :data:`AUTOCAST_FLOAT32_MODULES` (the caller also keeps autocast for modules not PyTorch's or this library's,
        whose forward may depend on its tensors' dtype)."""
        return not isinstance(module, AUTOCAST_FLOAT32_MODULES)

    def fallback_message(self, variant, reason: str) -> str:
        return f"f_R's weights are not cast once ({reason}); sampling casts them under autocast at each batch"


def cast_copy(prepared: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of the prepared module ``prepared`` with its floating-point parameters and buffers in ``dtype``,
    in the same memory format (``nn.Module.to`` keeps a channels_last weight channels_last)."""
    return copy.deepcopy(prepared).to(dtype)


__all__ = ["CastChoice", "cast_copy"]
