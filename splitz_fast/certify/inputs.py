"""One input's way into any certifier (Smoother, MarginCertifier, SequentialCertifier, Attacker): checked and
moved to the model's device as float32 (:class:`PreparedInput`, with the distance the rounding moved it), its seed,
the model's eval mode for the call, and the guard that the model is not edited while a lazy call runs."""
from __future__ import annotations

import operator
import secrets
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import TypeVar

import torch

from .._checks import check_tensor
from ..model.modules import SplitModel, evaluating
from ..model.snapshot import ModuleSnapshot, check_no_global_hooks

T = TypeVar("T")


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@dataclass(frozen=True)
class PreparedInput:
    """One input as the model computes with it: ``x`` in float32 on the model's device, and ``rounding``, an upper
    bound on the l2 distance from the input as given (0 unless it was wider than float32, e.g. float64)."""

    x: torch.Tensor
    rounding: float


def prepare_input(model: SplitModel, x: torch.Tensor) -> PreparedInput:
    """One input ``[*input_shape]`` (or ``[1, *input_shape]``) checked and moved to the model's device as float32."""
    shape = model.input_shape
    check_tensor("x", x, ndim=None if shape is None else (len(shape), len(shape) + 1), shape_tail=shape)
    if shape is not None and x.ndim == len(shape) + 1:
        if x.shape[0] != 1:
            raise ValueError(f"certify/predict take one input at a time, got a batch of {x.shape[0]}; "
                             "use certify_many/predict_many for several")
        x = x[0]
    x32 = x.to(model_device(model), torch.float32)
    return PreparedInput(x32, rounding_distance(x, x32))


def rounding_distance(given: torch.Tensor, rounded: torch.Tensor) -> float:
    """An upper bound on ``‖given − rounded‖₂``, 0 when the cast was exact (float32 and narrower inputs).

    In float64 the differences of two doubles, their squares and the sum of ``d`` squares carry a relative error of
    at most ``γ_{d+2}`` (Higham, Ch. 3), the square root one more ``u``: the factor ``1 + 2(d + 4)u`` covers them."""
    if given.dtype.itemsize <= 4:  # float32 or narrower: the cast to float32 is exact
        return 0.0
    diff = given.detach().to(torch.float64).cpu() - rounded.detach().to(torch.float64).cpu()
    distance = float(diff.square().sum().sqrt())
    return distance * (1 + 2 * (diff.numel() + 4) * 2.0 ** -53) if distance > 0 else 0.0


class CallGuard:
    """The model one certify/predict call works on: the halves it started with, and a snapshot of each.

    A call over many inputs is a lazy generator, and the caller's code runs between its results. If ``model.left`` or
    ``model.right`` is replaced, or any tensor, layer, hook, replaced method or plain attribute of either is edited
    meanwhile (``.data`` writes and ``copy_`` under ``no_grad`` included; :class:`~splitz_fast.model.snapshot.ModuleSnapshot`),
    or a global module forward hook is registered, later latents, bounds and votes would come from different networks
    than the earlier ones; :meth:`check`, called before every result and before sampling each input, stops the call
    with an error instead (a new call certifies the edited model). A check costs host-side comparisons and one device
    comparison per (device, element width) group of each half.

    Args:
        model: the model of the call.
        right: a snapshot of ``model.right`` as it is now, to share instead of copying ``f_R`` a second time (the
            sampling engine's, just verified by :meth:`~splitz_fast.sampling.prepared.PreparedClassifier.check_current`).
    """

    def __init__(self, model: SplitModel, right: ModuleSnapshot | None = None):
        model.check_structure()
        check_no_global_hooks()
        self.model, self.left, self.right = model, model.left, model.right
        self.left_snapshot = ModuleSnapshot(model.left)
        self.right_snapshot = ModuleSnapshot(model.right) if right is None else right

    def edited(self) -> bool:
        model = self.model
        return model.left is not self.left or model.right is not self.right \
            or not self.left_snapshot.matches(model.left) or not self.right_snapshot.matches(model.right)

    def check(self) -> None:
        check_no_global_hooks()
        if self.edited():
            raise RuntimeError("the model was edited while a certify/predict call was running over its inputs "
                               "(a half replaced, or a tensor, layer, hook or attribute of f_L or f_R changed); start a new "
                               "call after editing the model")


def resolve_seed(seed: int | None) -> int:
    if seed is None:
        return secrets.randbits(63)
    if isinstance(seed, bool) or not hasattr(type(seed), "__index__"):  # NumPy and 0-d integer tensors are integers
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    value = operator.index(seed)
    if not 0 <= value < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    return value


_NO_SEED = object()  # the end of a seeds iterable (None is a seed: draw a fresh one)


def with_seeds(inputs: Iterable[T], seeds: Iterable[int | None] | None) -> Iterator[tuple[T, int | None]]:
    """Each input paired with its seed: one seed per input, ``None`` draws a fresh random seed for every input.

    Seeds and inputs must be as many: a mismatch is a ``ValueError``, never results silently dropped or seeds silently
    ignored. It is raised here, before any work, when both have a length (a tensor, list or range); with a lazy
    iterable as soon as it shows — an input without a seed before that input is computed, seeds left over when the
    inputs end."""
    if seeds is None:
        return ((x, None) for x in inputs)
    if isinstance(seeds, int):
        raise TypeError("seeds must be one seed per input (e.g. [base + i for i in indices]), not a single int")
    n_inputs = len(inputs) if isinstance(inputs, Sized) else None
    n_seeds = len(seeds) if isinstance(seeds, Sized) else None
    if n_inputs is not None and n_seeds is not None and n_inputs != n_seeds:
        raise _seed_count_error(n_seeds, n_inputs)
    return _paired(inputs, seeds, n_inputs, n_seeds)


def _paired(inputs, seeds, n_inputs: int | None, n_seeds: int | None):
    seed_iter = iter(seeds)
    count = 0
    for x in inputs:
        seed = next(seed_iter, _NO_SEED)
        if seed is _NO_SEED:
            raise _seed_count_error(count, n_inputs if n_inputs is not None else f"at least {count + 1}")
        count += 1
        yield x, seed
    if next(seed_iter, _NO_SEED) is not _NO_SEED:
        raise _seed_count_error(n_seeds if n_seeds is not None else f"more than {count}", count)


def _seed_count_error(seeds: int | str, inputs: int | str) -> ValueError:
    seed_word = "seed" if seeds == 1 else "seeds"
    input_word = "input" if inputs == 1 else "inputs"
    return ValueError(f"seeds: {seeds} {seed_word} for {inputs} {input_word}; give one seed per input")


def inputs_of(inputs: torch.Tensor | Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """A batch tensor ``[M, *input_shape]`` is read as its M inputs."""
    return inputs.unbind(0) if isinstance(inputs, torch.Tensor) else inputs


__all__ = ["CallGuard", "PreparedInput", "evaluating", "inputs_of", "model_device", "prepare_input", "resolve_seed",
           "rounding_distance", "with_seeds"]
