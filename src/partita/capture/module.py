"""An ``nn.Module`` as a function of its weights: what ``partita.jit(module)`` traces.

``partita.jit(model, ...)`` compiles ``model(*args)`` with the module's parameters and buffers as
program *inputs* (not constants baked into the graph): they are fetched fresh on every call, so
an optimizer step or ``load_state_dict`` is seen without recompiling, and a parameter whose
shape or dtype changed gives a new signature. The traced function is
``torch.func.functional_call(model, (params, buffers), args, kwargs)`` and its positional
arguments are ``(params, buffers, *args)``; :class:`ModuleInputs` builds them, their in_specs
and readable names.

Weights are replicated unless ``param_specs`` shards them: any preset
:func:`partita.presets.param_specs` accepts (a preset name, ``{name or pattern: P}``, a callable
``(name, param) -> P | None``), resolved once when the module is jitted. A weight marked with
``partita.mark_sharding(model.fc.weight, mesh, spec)`` is sharded so, before or after ``jit``
(a new mark compiles a new program), over the preset. Buffers are replicated.

This module does not trace or run anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from partita.presets import PresetLike, param_specs
from partita.values.annotations import marked_param_specs
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = ["ModuleInputs"]


class ModuleInputs:
    """The weights of a jitted module as the first two (dict) arguments of its program."""

    def __init__(self, module: nn.Module, mesh: Mesh, preset: PresetLike | None) -> None:
        self.module = module
        self.mesh = mesh
        self.param_specs: dict[str, PartitionSpec] = (
            {} if preset is None else param_specs(preset, module, mesh)
        )

    def call(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``module(*args, **kwargs)`` with these parameters and buffers."""
        return torch.func.functional_call(self.module, (params, buffers), args, kwargs)

    def args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``(params, buffers, *args)`` with the module's current weights (detached aliases,
        so an in-place buffer update written back reaches the module)."""
        params = {k: v.detach() for k, v in self.module.named_parameters()}
        buffers = {k: v.detach() for k, v in self.module.named_buffers()}
        return (params, buffers, *args)

    def in_specs(self, in_specs: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The in_specs prefix of ``(params, buffers, *args)`` given the user's for ``args``."""
        marked = marked_param_specs(self.module, self.mesh)  # mark_sharding on a weight wins
        specs = {**self.param_specs, **marked}
        params = {k: specs.get(k) for k, _ in self.module.named_parameters()}
        buffers = {k: None for k, _ in self.module.named_buffers()}
        if in_specs is None or isinstance(in_specs, PartitionSpec):
            user: tuple[Any, ...] = (in_specs,) * len(args)
        else:
            user = tuple(in_specs)
        return (params, buffers, *user)

    def mode(self) -> tuple[Any, ...]:
        """The class and plain Python attributes of every submodule (numbers, strings, flags,
        tuples of them; the train/eval flag among them): part of the signature, because the
        forward reads them while tracing and the program keeps what it read. ``model.eval()``,
        ``model.temperature = 0.5``, ``dropout.p = 0.0`` or a submodule swapped for one of
        another class with the same attributes (``nn.ReLU`` for ``nn.SiLU``) compile a new
        program, and so does ``mark_sharding`` on a weight (last, when there is one)."""
        attributes = tuple(
            (("__class__", type(m)), *_plain_attributes(m)) for m in self.module.modules()
        )
        marked = marked_param_specs(self.module, self.mesh)
        return (*attributes, tuple(marked.items())) if marked else attributes

    def mutated(self, before: tuple[Any, ...]) -> list[str]:
        """The attributes (``'calls' of Counter``) whose value differs from ``before`` (a
        :meth:`mode` taken earlier): what a traced forward changed."""
        names = [n or type(self.module).__name__ for n, _ in self.module.named_modules()]
        changed = []
        for name, old, new in zip(names, before, self.mode(), strict=False):
            old_d, new_d = dict(old), dict(new)
            for key in sorted(set(old_d) | set(new_d), key=str):
                if old_d.get(key, _MISSING) != new_d.get(key, _MISSING):
                    changed.append(f"{key!r} of {name} ({old_d.get(key)!r} -> {new_d.get(key)!r})")
        return changed

    def leaf_name(self, name: str) -> str:
        """A readable name for a leaf of ``(params, buffers, *args)``: ``args[0]['fc.weight']``
        is ``parameter 'fc.weight'``, ``args[3]`` is ``args[1]``."""
        for prefix, what in (("args[0]", "parameter"), ("args[1]", "buffer")):
            if name.startswith(prefix + "["):
                return f"{what} {name[len(prefix) + 1 : -1]}"
        if name.startswith("args["):
            index, rest = name[5:].split("]", 1)
            return f"args[{int(index) - 2}]{rest}"
        return name


_MISSING = object()
_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return len(value) <= 16 and all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _plain_attributes(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """``(name, value)`` of a module's own plain attributes (``vars(module)``; parameters,
    buffers, submodules and hooks live in dicts of their own, so they are not among them)."""
    return tuple((k, v) for k, v in vars(module).items() if _is_plain(v))
