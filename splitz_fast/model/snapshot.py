"""What a module computes with, captured so that a cache or a running call can tell whether it still describes the module.

A module's output depends on more than its parameters and buffers: forward hooks and pre-hooks, a method replaced on
the instance (``layer.forward = ...``), the plain Python attributes its ``forward`` reads (``self.scale = 2.0``), and
the hooks registered for every module (``torch.nn.modules.module.register_module_forward_hook``). :class:`ModuleSnapshot`
compares all of them; :func:`hooked_modules` and :func:`instance_overrides` name the pieces that a rewrite of a module
would lose, and :func:`check_no_global_hooks` refuses the global ones.

The Python state is read *by value* (numbers, strings, containers, tensors, arrays, and the attributes of the plain
objects they hold, to :data:`STATE_DEPTH` levels) and functions by identity, so a snapshot taken of a ``copy.deepcopy``
of a module matches the module itself. What it cannot see is named in docs/soundness.md: global variables and the
closure cells a hook or a replaced ``forward`` reads, and objects nested deeper than :data:`STATE_DEPTH`.
"""
from __future__ import annotations

import collections
import enum
import functools
import types

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules import module as _torch_module

# Bit patterns compared by ModuleSnapshot: each element read as the unsigned/signed integer of its width.
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# A module's own attributes that the snapshot compares elsewhere (tensors by bits, children by walking the tree) or that
# the certifier sets for each call (eval mode).
_COMPARED_ELSEWHERE = frozenset({"_parameters", "_buffers", "_modules", "training"})
# Levels of plain objects (attributes of attributes) whose values the snapshot reads; deeper ones count by type only.
STATE_DEPTH = 4
_VALUES = (type(None), bool, int, str, bytes, complex, torch.dtype, torch.device, torch.memory_format, torch.layout,
           type, range, slice, enum.Enum, type(Ellipsis))
_ATOMS = frozenset({type(None), bool, int, str, bytes, torch.dtype, torch.device})  # exact types: compared as they are
_HOOK_DICTS = frozenset({dict, collections.OrderedDict})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened with its elements read as same-width integers (float32 → int32, bfloat16 → int16, …): equal
    bits compare equal, so a NaN matches itself and ``-0.0`` differs from ``0.0`` (``torch.equal`` on floats says the
    opposite of both)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(_SAME_WIDTH_INT[t.element_size()])


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` — non-persistent buffers too, which the state dict leaves out."""
    return [*module.named_parameters(), *module.named_buffers()]


def _grouped_bits(tensors: list[tuple[str, torch.Tensor]]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, t in tensors:
        bits = _bits(t)
        groups.setdefault((bits.device, bits.dtype), []).append(bits)
    return groups


class _TensorValue:
    """A tensor attribute that is not a registered parameter or buffer, compared by shape, dtype, device and bits."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach().clone()

    def __eq__(self, other) -> bool:
        a, b = self.tensor, other.tensor if isinstance(other, _TensorValue) else None
        return b is not None and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and (
            a.numel() == 0 or torch.equal(_bits(a.contiguous()), _bits(b.contiguous())))

    def __hash__(self) -> int:
        return hash((self.tensor.dtype, tuple(self.tensor.shape)))


class _Same:
    """A function, compared by identity (``copy.deepcopy`` keeps functions as they are)."""

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _state(value, depth: int):
    """``value`` as a comparable, hashable description of what a ``forward`` reading it would see."""
    if isinstance(value, float):
        return "float", value.hex()  # NaN equals itself, -0.0 differs from 0.0
    if isinstance(value, _VALUES):
        return type(value), value
    if isinstance(value, torch.Tensor):
        return _TensorValue(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return "numpy", value.dtype.str, value.shape, value.tobytes()
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_state(v, depth) for v in value)
    if isinstance(value, dict):  # in order: hook dicts run in insertion order
        return type(value), tuple((_state(k, depth), _state(v, depth)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return type(value), frozenset(_state(v, depth) for v in value)
    if isinstance(value, types.MethodType):
        return "method", _Same(value.__func__), type(value.__self__)
    if isinstance(value, functools.partial):
        return "partial", _state(value.func, depth), _state(value.args, depth), _state(value.keywords, depth)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType)):
        return _Same(value)
    if depth < STATE_DEPTH and hasattr(value, "__dict__"):
        return type(value), _state(vars(value), depth + 1)
    return "object", type(value)


def _own_state(module: nn.Module) -> tuple:
    """:func:`_state` of one module's own attributes (those :data:`_COMPARED_ELSEWHERE` left out), with fast paths for
    what nearly every attribute is — a number, string, tuple of numbers or an empty hook dict — since a guard check
    reads every module of ``f_R`` before each result (ResNet-110: 389 modules, about 30 attributes each)."""
    out = []
    for key, value in module.__dict__.items():
        kind = type(value)
        if key in _COMPARED_ELSEWHERE:
            continue
        if kind in _ATOMS:
            out.append((key, value))
        elif kind is float:
            out.append((key, value.hex()))  # NaN equals itself, -0.0 differs from 0.0
        elif kind in _HOOK_DICTS and all(type(v) is types.FunctionType for v in value.values()):
            out.append((key, kind, tuple(value.items())))  # functions compare by identity
        elif kind is tuple and all(type(v) in _ATOMS for v in value):
            out.append((key, value))
        else:
            out.append((key, _state(value, 0)))
    return tuple(out)


def python_state(module: nn.Module) -> tuple:
    """Per submodule (in tree order): its name, its class, and the value of every attribute of its own that is not a
    parameter, buffer, child or the train/eval flag — hooks, replaced methods and plain attributes included."""
    return tuple((name, type(m), _own_state(m)) for name, m in module.named_modules())


def hooked_modules(module: nn.Module) -> list[str]:
    """Qualified names (``""`` for ``module`` itself) of the submodules with forward hooks or forward pre-hooks."""
    return [name for name, m in module.named_modules() if m._forward_hooks or m._forward_pre_hooks]


def instance_overrides(module: nn.Module) -> list[str]:
    """``name.method`` for every method of a submodule's class that the instance replaces (``layer.forward = f``)."""
    return [f"{name or type(module).__name__}.{attr}" for name, m in module.named_modules()
            for attr in vars(m) if not attr.startswith("__") and callable(getattr(type(m), attr, None))]


def global_forward_hooks() -> int:
    """How many forward hooks and pre-hooks are registered for every module (``register_module_forward_hook``,
    ``register_module_forward_pre_hook``)."""
    return len(_torch_module._global_forward_hooks) + len(_torch_module._global_forward_pre_hooks)


def check_no_global_hooks() -> None:
    """Refuse to certify while global module forward hooks are registered: they run inside every module call, the
    sampler's private copy of ``f_R`` and its rewritten layers included, so no fixed base classifier would be sampled."""
    if global_forward_hooks():
        raise ValueError("global module forward hooks are registered (torch.nn.modules.module."
                         "register_module_forward_hook / register_module_forward_pre_hook): they run inside every "
                         "module call, so what is sampled would not be a fixed model; remove them (handle.remove()) "
                         "before certifying, or register the hook on model.right")


class ModuleSnapshot:
    """A copy of what a module computes with, to tell whether something cached from it (a bound, a prepared copy) or a
    running call still describes it.

    Compared by value, so no change slips through: ``.data`` writes and ``copy_`` under ``no_grad`` (which do not bump
    a tensor's version counter), ``load_state_dict``, a layer swapped in place, a hook added or removed, a method
    replaced on an instance, a plain attribute changed (:func:`python_state`). :meth:`matches` first compares on the
    host what costs no device work — the module tree's ``repr`` (layer geometry), its ``input_shape`` if it has one,
    its Python state, and the name, dtype, device and shape of every parameter and buffer (non-persistent buffers
    included) — then the values with **one** ``torch.equal`` per (device, element width): the tensors of a group
    flattened, read bit by bit as integers of their width and concatenated, against the snapshot's concatenation. A
    check costs one host synchronisation per group (usually one), however many tensors the module has. A snapshot is
    never changed after it is made, so several holders may share one; one taken of a ``copy.deepcopy`` of a module
    matches the module.
    """

    def __init__(self, module: nn.Module):
        tensors = _named_tensors(module)
        self.structure = self._structure(module)
        self.layout = self._layout(tensors)
        self.bits = {key: torch.cat(parts) for key, parts in _grouped_bits(tensors).items()}  # cat copies

    @staticmethod
    def _structure(module: nn.Module) -> tuple:
        return repr(module), getattr(module, "input_shape", None), python_state(module)

    @staticmethod
    def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple:
        return tuple((name, t.dtype, t.device, t.shape) for name, t in tensors)

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` has the same structure, Python state and bit-identical tensors (names, dtype, device,
        shape, values)."""
        tensors = _named_tensors(module)
        if self._layout(tensors) != self.layout or self._structure(module) != self.structure:
            return False
        groups = _grouped_bits(tensors)  # same layout: the same groups as the snapshot's
        return all(torch.equal(parts[0] if len(parts) == 1 else torch.cat(parts), self.bits[key])
                   for key, parts in groups.items())


__all__ = ["ModuleSnapshot", "STATE_DEPTH", "check_no_global_hooks", "global_forward_hooks", "hooked_modules",
           "instance_overrides", "python_state"]
