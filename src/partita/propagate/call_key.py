"""The memo key of an op call: equal for two calls exactly when a rule cannot tell them apart.

Propagation gives calls with equal keys one rule object (``ProgramState._op_shape``): every
layer of a transformer repeats the same ops on the same shapes, so a deeper model adds
look-ups, not rule inputs. :func:`info_key` keys an OpInfo; :func:`call_key` gives the same key
read off the node in one walk, without building the OpInfo (the per-node cost of a deep
program's build, so it is written for speed: plain tuples whose hashing and comparison stay in
C, a type switch before any ``isinstance``).

A tensor is keyed as ``(TensorMeta, shape, dtype)``, every other leaf with its type, so ``1``,
``1.0`` and ``True`` (equal in Python) stay apart. An argument that is not a plain value
(anything but None, bool, int, float, str, dtype, device, layout, memory format, enum,
TensorMeta, or lists, tuples and dicts of them) makes the call not memoised (None).

This module does not build rules or OpInfos.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any

import torch
import torch.fx as fx

from partita.rules import OpInfo, TensorMeta

__all__ = ["call_key", "info_key"]


class _NotPlainError(Exception):
    """An argument the key does not cover."""


_PLAIN = (
    type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
    torch.memory_format, enum.Enum, TensorMeta,
)  # fmt: skip

#: leaf types keyed as (type, value) without a further test (the common arguments)
_SCALARS = frozenset((type(None), bool, int, str, torch.dtype))


def _leaf_key(a: Any) -> Hashable:
    t = type(a)
    if t in _SCALARS:
        return (t, a)
    if t is float:
        return (t, a.hex())  # -0.0 and 0.0 apart, every NaN equal to itself
    if isinstance(a, (list, tuple)):
        return (type(a), tuple([_leaf_key(x) for x in a]))
    if isinstance(a, dict):
        return (dict, tuple([(k, _leaf_key(v)) for k, v in a.items()]))
    if isinstance(a, float):
        return (type(a), a.hex())
    if isinstance(a, TensorMeta):
        return (TensorMeta, a.shape, a.dtype)
    if isinstance(a, _PLAIN):
        return (type(a), a)
    raise _NotPlainError


def info_key(info: OpInfo) -> Hashable | None:
    """A key equal for two OpInfos exactly when a rule cannot tell them apart, or None (see the
    module)."""
    try:
        return (
            info.target,
            _leaf_key(info.args),
            _leaf_key(info.kwargs),
            tuple([(m.shape, m.dtype) for m in info.operands]),
            tuple([None if m is None else (m.shape, m.dtype) for m in info.results]),
        )
    except _NotPlainError:
        return None


class _Walk:
    """One call's walk: its tensor operands (nodes and keys) as they are met. ``seen`` keeps,
    per node argument met before, its key and its operand entry (None: not a tensor), so a
    value read by several ops is described once (``ProgramState`` shares one across its
    walk)."""

    __slots__ = ("metas", "nodes", "operands", "seen")

    def __init__(
        self,
        metas: dict[fx.Node, TensorMeta],
        nodes: list[fx.Node],
        seen: dict[Any, Any],
    ) -> None:
        self.metas, self.nodes, self.seen = metas, nodes, seen
        self.operands: list[tuple[Any, ...]] = []

    def args(self, seq: Any) -> tuple[Hashable, ...]:
        """The keys of a sequence of arguments: nodes and scalars inline (the common case),
        anything else through :meth:`arg`."""
        out = []
        seen = self.seen
        for a in seq:
            t = type(a)
            if t is fx.Node:
                found = seen.get(a)
                if found is None:
                    found = seen[a] = self._describe(a)
                key, operand = found
                if operand is not None:
                    self.nodes.append(a)
                    self.operands.append(operand)
                out.append(key)
            elif t in _SCALARS:
                out.append((t, a))
            else:
                out.append(self.arg(a))
        return tuple(out)

    def arg(self, a: Any) -> Hashable:
        t = type(a)
        if t is fx.Node:
            return self.tensor(a)
        if t in _SCALARS:
            return (t, a)
        if t is list or t is tuple:
            return (t, self.args(a))
        if isinstance(a, fx.Node):
            return self.tensor(a)
        if isinstance(a, (list, tuple)):  # fx's immutable_list: keyed with its own type
            return (type(a), self.args(a))
        if isinstance(a, dict):
            return (dict, tuple([(k, self.arg(v)) for k, v in a.items()]))
        return _leaf_key(a)

    def tensor(self, a: fx.Node) -> Hashable:
        """A node argument: a tensor operand, or its value's key when it is not a tensor."""
        found = self.seen.get(a)
        if found is None:
            found = self.seen[a] = self._describe(a)
        key, operand = found
        if operand is not None:
            self.nodes.append(a)
            self.operands.append(operand)
        return key

    def _describe(self, a: fx.Node) -> tuple[Hashable, Any]:
        meta = self.metas.get(a)
        if meta is None:
            val: Any = a.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return _leaf_key(val), None
            meta = self.metas[a] = TensorMeta(tuple(val.shape), val.dtype)
        return (TensorMeta, meta.shape, meta.dtype), (meta.shape, meta.dtype)


def call_key(
    node: fx.Node,
    metas: dict[fx.Node, TensorMeta],
    operand_nodes: list[fx.Node],
    seen: dict[Any, Any] | None = None,
) -> Hashable | None:
    """``info_key(op_info(node, metas)[0])`` without building the OpInfo, or None; appends the
    node's tensor operand nodes (flattened order) to ``operand_nodes``. ``seen`` (optional,
    kept by the caller across calls while the graph and its values live) memoises each node
    argument's description and, by the ``id`` of the node's value, its results' key."""
    walk = _Walk(metas, operand_nodes, {} if seen is None else seen)
    try:
        args = (tuple, walk.args(node.args))
        kwargs = (dict, tuple([(k, walk.arg(v)) for k, v in node.kwargs.items()]))
    except _NotPlainError:
        del operand_nodes[:]
        return None
    val = node.meta.get("val")
    # a function of the value alone, and the copies of a layer share their value objects
    # (capture copies a part's nodes with their meta): described once per object
    results = walk.seen.get(id(val))
    if results is None:
        if not isinstance(val, (tuple, list)):
            results = ((tuple(val.shape), val.dtype),) if isinstance(val, torch.Tensor) else (None,)
        else:
            results = tuple(
                [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in val]
            )
        if seen is not None:
            seen[id(val)] = results
    return (node.target, args, kwargs, tuple(walk.operands), results)
