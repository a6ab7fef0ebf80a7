"""When two calls of a layer may share one trace: the signature of a call.

Two calls share a trace when their signatures are equal: the module's class and Python state
(:func:`layer_attrs`, submodules included; hooks make a layer unfit), the parameter and
buffer names, the shapes, dtypes, devices and ``requires_grad`` of every tensor, the static
arguments, and the grad and autocast modes (:func:`call_signature`). A call that cannot be
keyed raises :class:`LayerFallbackError`, whose message says why (it becomes the warning of
:mod:`partita.capture.layers`). This module does not trace.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["IN_PLACE", "LayerFallbackError", "call_signature", "layer_attrs", "value_key"]

_SIMPLE = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)
_STRUCTURE = ("_parameters", "_buffers", "_modules", "training", "forward")
_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

IN_PLACE = "it updates a buffer or argument in place (e.g. batch-norm statistics)"


class LayerFallbackError(Exception):
    """This call cannot reuse a trace; the message says why."""


def layer_attrs(module: nn.Module) -> tuple[Any, ...]:
    """The Python state of ``module`` and its submodules that may steer ``forward``."""
    out = []
    for prefix, sub in module.named_modules():
        for hooks in _CALL_HOOKS:
            if getattr(sub, hooks, None):
                raise LayerFallbackError(
                    f"module {prefix or type(module).__name__!r} has {hooks[1:]}"
                )
        for name, value in sorted(vars(sub).items()):
            if name in _STRUCTURE or "hook" in name:  # hooks: checked above
                continue
            out.append((prefix, name, value_key(value)))
        out.append((prefix, type(sub), sub.training))
    return tuple(out)


def value_key(value: Any) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
        return (type(value), tuple(value))
    if isinstance(value, (set, frozenset)) and all(isinstance(v, _SIMPLE) for v in value):
        return (frozenset, frozenset(value))
    # anything else (a config object, a function, a tensor) by identity: layers that share it
    # see the same object. The key holds the object: an attribute replaced while the trace
    # runs frees it, and the next object allocated may get its id (and another value)
    return ("id", _Held(value))


class _Held:
    """An object as part of a key: equal only to itself, and kept alive by the key."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__} object>"


def call_signature(
    tree: pytree.TreeSpec, leaves: list[Any], primals: list[Tensor]
) -> tuple[Any, ...]:
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # activation checkpointing recomputes the layer in the backward and checks that it
        # saves the same tensors as its forward did; a placeholder saves others
        raise LayerFallbackError(
            "it runs under saved-tensor hooks (activation checkpointing, offloading)"
        )
    statics = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            continue
        try:
            hash(leaf)
        except TypeError:
            raise LayerFallbackError(
                f"its argument {leaf!r:.60} is neither a tensor nor hashable"
            ) from None
        statics.append(leaf)
    meta = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in primals)
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (tree, tuple(statics), meta, torch.is_grad_enabled(), autocast)
