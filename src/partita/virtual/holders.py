"""What holds the values a captured step reads, and whether it still does (the guard of
:mod:`partita.virtual.compiled`).

At the capture, one walk over the objects Python's collector tracks finds every tensor object
standing for one of the step's values, every ``nn.Module`` holding such a tensor (or a module
that does) and every optimizer over one; :meth:`Holders.stale` says, before each replay, what
changed since. This module does not record or run anything.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.virtual.lazy import LazyTensor

__all__ = ["Holders", "holders"]


@dataclass
class Holders:
    """What holds the tensors a captured step reads besides its arguments, as it was at the
    capture: a replay is the step only while these are unchanged.

    ``tensors``: each tensor object on one of the step's cells (a Parameter, an optimizer's
    moment, an alias), with the cell it stood for, its ``requires_grad`` and its ``.grad``
    (``t.data = x`` gives a tensor another cell; ``requires_grad_(False)`` changes what the
    backward computes). ``modules``: each module holding such a tensor, or a module holding
    one, with its parameters, buffers, submodules and ``training`` (a swapped Parameter or
    submodule, ``model.eval()``). ``optimizers``: each optimizer over such a tensor, with its
    param groups (tensors, hyperparameters) and its state's entries (``load_state_dict``
    replaces them). Tensors are compared by identity through weak references; everything
    else by value.
    """

    tensors: list[tuple[Any, Any, bool, Any]]
    modules: list[tuple[Any, Any]]
    optimizers: list[tuple[Any, Any]]

    def stale(self) -> str | None:
        """Why the step's tensors are no longer held as at the capture, else None."""
        for ref, cell, requires_grad, grad in self.tensors:
            t = ref()
            if t is None:  # an alias gone: it cannot be read any more
                continue
            what = f"a {list(t.shape)} {t.dtype} tensor the step reads"
            if t._cell is not cell():
                return f"{what} was given another value (t.data = x)"
            if t.requires_grad != requires_grad:
                return f"{what} had requires_grad={requires_grad} and now has {t.requires_grad}"
            if not _same(grad, t.grad):
                return f"{what} has another .grad than when it was captured"
        for ref, snapshot in self.modules:
            m = ref()
            if m is not None and not _module_same(snapshot, m):
                return (
                    f"the {type(m).__name__} module holding tensors the step reads changed (a "
                    f"parameter, buffer or submodule replaced, or train()/eval())"
                )
        for ref, snapshot in self.optimizers:
            opt = ref()
            if opt is not None and not _optimizer_same(snapshot, opt):
                return (
                    f"the {type(opt).__name__} optimizer over tensors the step reads changed "
                    f"(load_state_dict, a hyperparameter set in param_groups, a param group "
                    f"added)"
                )
        return None


def _weak(value: Any) -> Any:
    """A value as a snapshot keeps it: tensors (and modules) by weak reference."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return weakref.ref(value)
    if isinstance(value, (list, tuple)):
        return tuple(_weak(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _weak(v)) for k, v in value.items())
    return value


def _same(snapshot: Any, value: Any) -> bool:
    """``value`` (an object, or a container of them) is what ``snapshot`` recorded."""
    if type(snapshot) is weakref.ref:
        return snapshot() is value and value is not None
    if snapshot is None:
        return value is None
    if type(snapshot) is tuple:
        if isinstance(value, dict):
            return len(value) == len(snapshot) and all(
                k == j and _same(a, b)
                for (k, a), (j, b) in zip(snapshot, value.items(), strict=True)
            )
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(snapshot)
            and all(_same(a, b) for a, b in zip(snapshot, value, strict=True))
        )
    try:
        return type(snapshot) is type(value) and bool(snapshot == value)
    except Exception:  # a value that cannot be compared: treated as changed
        return False


def _module_snapshot(m: nn.Module) -> Any:
    return (m.training, _weak(m._parameters), _weak(m._buffers), _weak(m._modules))


def _module_same(snapshot: Any, m: nn.Module) -> bool:
    training, params, buffers, modules = snapshot
    return (
        m.training == training
        and _same(params, m._parameters)
        and _same(buffers, m._buffers)
        and _same(modules, m._modules)
    )


def _optimizer_snapshot(opt: torch.optim.Optimizer) -> Any:
    groups = _weak(opt.param_groups)
    params = [p for g in opt.param_groups for p in g["params"]]
    state = tuple(_weak(opt.state[p]) if p in opt.state else None for p in params)
    return (groups, state)


def _optimizer_same(snapshot: Any, opt: torch.optim.Optimizer) -> bool:
    groups, state = snapshot
    if not _same(groups, opt.param_groups):
        return False
    params = (p for g in opt.param_groups for p in g["params"])
    return all(_same(s, opt.state.get(p)) for s, p in zip(state, params, strict=False))


def holders(roles: list[tuple[Any, ...]]) -> Holders:
    """Who holds the cells a capture reads (one walk over the objects the collector tracks)."""
    cells = {}
    for role in roles:
        if role[0] == "cell" and (cell := role[1]()) is not None:
            cells[id(cell)] = role[1]
    tensors: list[tuple[Any, Any, bool, Any]] = []
    modules: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    held: set[int] = set()  # ids of the tensors on the step's cells
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which some objects warn on
        if issubclass(kind, LazyTensor):
            ref = cells.get(id(obj._cell))
            if ref is not None:
                grad = None if obj.grad is None else weakref.ref(obj.grad)
                tensors.append((weakref.ref(obj), ref, obj.requires_grad, grad))
                held.add(id(obj))
        elif issubclass(kind, nn.Module):
            modules.append(obj)
        elif issubclass(kind, torch.optim.Optimizer):
            optimizers.append(obj)
    kept: set[int] = set()
    changed = True
    while changed:  # modules holding a step tensor, then the modules holding those
        changed = False
        for m in modules:
            if id(m) in kept:
                continue
            direct = (*m._parameters.values(), *m._buffers.values())
            if any(id(t) in held for t in direct if t is not None) or any(
                id(c) in kept for c in m._modules.values() if c is not None
            ):
                kept.add(id(m))
                changed = True
    return Holders(
        tensors,
        [(weakref.ref(m), _module_snapshot(m)) for m in modules if id(m) in kept],
        [
            (weakref.ref(o), _optimizer_snapshot(o))
            for o in optimizers
            if any(id(p) in held for g in o.param_groups for p in g["params"])
        ],
    )
