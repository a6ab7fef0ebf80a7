"""A jitted function's last signature, checked cheaply so a steady loop skips building its key.

``partita.jit`` keys its compiled programs by the signature of a call: the argument structure,
each tensor leaf's shape, dtype and sharding, the options and (for a module) its plain Python
attributes (``frontend.signature``). Building that key flattens the arguments with
``torch.utils._pytree``, builds a tuple per leaf and hashes the whole, on every call: in a
training loop, more than the rest of the call's Python. :class:`LastCall` remembers the last
call's signature in a form checked without building anything: the argument structure as a
*flatten plan* (tuples, lists, dicts by their keys in order, None), and per leaf its kind
(tensor or ShardedTensor), global shape, dtype and, for a ShardedTensor, its sharding. A call
whose arguments match it, with the same options, module attributes, ``in_specs`` object and
mark count (``values.annotations.marks_made``), has the same key, so it runs the same program;
anything else (another structure, a shape, a dtype, a sharding, a static argument, an object
pytree knows such as a KV cache or a namedtuple) goes the ordinary way. This module only
compares; it compiles nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.values.annotations import marks_made
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["LastCall"]

_NONE = type(None)
#: A flatten plan: None for a leaf, else (container type, length or dict keys, children).
Plan = tuple[type, Any, tuple[Any, ...]] | None


class _UnsupportedError(Exception):
    """A node the plan does not spell out (a namedtuple, an OrderedDict, a registered class)."""


def _plan(tree: pytree.TreeSpec) -> Plan:
    if tree.is_leaf():
        return None
    kind = tree.type
    children = tuple(_plan(c) for c in tree.children())
    if kind is tuple or kind is list:
        return (kind, len(children), children)
    if kind is dict:
        return (dict, tuple(tree.context), children)
    if kind is _NONE:
        return (_NONE, 0, ())
    raise _UnsupportedError


def _flatten(plan: Plan, obj: Any, out: list[Any]) -> bool:
    """Append the leaves of ``obj`` to ``out`` if it has ``plan``'s structure, else False."""
    if plan is None:
        out.append(obj)
        return True
    kind, size, children = plan
    if type(obj) is not kind:
        return False
    node: Any = obj
    if kind is dict:
        if len(node) != len(size) or tuple(node) != size:
            return False
        values = node.values()
    elif kind is _NONE:
        return True
    else:
        if len(node) != size:
            return False
        values = node
    for child, value in zip(children, values, strict=True):
        if not _flatten(child, value, out):
            return False
    return True


class LastCall:
    """The signature of one call and its compiled program (see the module docstring).

    ``of`` returns None when the call has a leaf that is not a tensor (a static argument is
    compared by value in the key) or a container the plan does not spell out.
    """

    __slots__ = ("compiled", "marks", "metas", "mode", "options", "plan", "source")

    def __init__(
        self,
        plan: Plan,
        metas: list[tuple[bool, torch.Size, torch.dtype, Sharding | None]],
        source: Any,
        options: Hashable,
        mode: Any,
        compiled: Any,
    ) -> None:
        self.plan = plan
        self.metas = metas
        self.source = source
        self.options = options
        self.mode = mode
        self.marks = marks_made()
        self.compiled = compiled

    @classmethod
    def of(
        cls,
        tree: pytree.TreeSpec,
        leaves: list[Any],
        shardings: list[Sharding | None],
        source: Any,
        options: Hashable,
        mode: Any,
        compiled: Any,
    ) -> LastCall | None:
        """The call whose flattened arguments were ``leaves`` (structure ``tree``), each
        tensor's Sharding in ``shardings``, with ``in_specs`` object ``source``."""
        try:
            plan = _plan(tree)
        except _UnsupportedError:
            return None
        metas = []
        for leaf, sharding in zip(leaves, shardings, strict=True):
            if isinstance(leaf, ShardedTensor):
                metas.append((True, leaf.shape, leaf.dtype, sharding))
            elif isinstance(leaf, torch.Tensor):
                metas.append((False, leaf.shape, leaf.dtype, None))
            else:
                return None
        return cls(plan, metas, source, options, mode, compiled)

    def match(self, args: Any, source: Any, options: Hashable, mode: Any) -> list[Any] | None:
        """The leaves of ``args`` (``(args, kwargs)``) if this call has the same signature
        as the remembered one, else None."""
        if (
            source is not self.source
            or options != self.options
            or mode != self.mode
            or marks_made() != self.marks
        ):
            return None
        leaves: list[Any] = []
        if not _flatten(self.plan, args, leaves) or len(leaves) != len(self.metas):
            return None
        nodes = pytree.SUPPORTED_NODES
        for leaf, (sharded, shape, dtype, sharding) in zip(leaves, self.metas, strict=True):
            if sharded:
                if not isinstance(leaf, ShardedTensor):
                    return None
                got = leaf.sharding
                if got is not sharding and got != sharding:
                    return None
            elif isinstance(leaf, ShardedTensor) or not isinstance(leaf, torch.Tensor):
                return None
            if type(leaf) in nodes or leaf.shape != shape or leaf.dtype != dtype:
                return None
        return leaves
