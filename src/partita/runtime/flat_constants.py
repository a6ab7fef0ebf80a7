"""Fold the ops of a flat graph that read no input into constants of the graph.

The LocalMesh's traced step (``runtime.fused_step``) computes some values from nothing but
constants at every run: the per-device offsets of a sharded embedding lookup (``arange``,
the device offsets lifted as constants, ``sub``, ``ge``/``lt``/``logical_and``, ``where``),
the ``scalar_tensor`` fill value of each ``where``, the row offsets of a gather's indices.
:func:`fold_constants` computes each such value once, when the graph is made, and the graph
reads it as an attribute from then on: the same tensor, so the same results bit for bit.

What is folded: an ATen op (not another library's: partita's random draw is one) whose
schema writes none of its arguments, that draws no random numbers, that makes no uninitialised
memory (``empty``), whose tensor inputs are all folded or constants of the graph (``getitem``
of a folded tuple too). No value some op may write, directly or through a view (by the ops'
alias annotations), nor one the graph returns, is folded or read as a constant: those stay
computed per run, as before. This module changes graphs only.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

__all__ = ["fold_constants"]


def _foldable(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or type(target) is not torch._ops.OpOverload:
        return False
    if target.namespace != "aten":  # another library's op may draw or keep state
        return False
    schema = target._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return "empty" not in target.__name__


def _writes(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` may write (its schema's ``Tensor(a!)`` arguments), or every input
    for a call whose schema is unknown (a Python function)."""
    target = node.target
    if node.op != "call_function":
        return []
    if target is operator.getitem:
        return []
    if not isinstance(target, torch._ops.OpOverload):
        return list(node.all_input_nodes)
    out: list[fx.Node] = []
    names = [a.name for a in target._schema.arguments]
    for i, arg in enumerate(target._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(names[i])
        out += [n for n in pytree.tree_leaves(value) if isinstance(n, fx.Node)]
    return out


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with an input (a view op, getitem)."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in target._schema.returns)


def fold_constants(gm: fx.GraphModule) -> int:
    """Fold ``gm``'s ops that read no input (see the module doc); returns how many nodes
    went. The graph is recompiled when any did."""
    touched = _written(gm)
    values: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node in touched:
            continue
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, Tensor):
                values[node] = value
            continue
        if node.op != "call_function" or not _foldable(node):
            continue
        if not all(n in values for n in node.all_input_nodes):
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, values.__getitem__, (node.args, node.kwargs))
        try:
            values[node] = node.target(*args, **kwargs)
        except Exception:  # leave it to run as it did
            continue
    folded = {n for n in values if n.op == "call_function"}
    if not folded:
        return 0
    before = len(gm.graph.nodes)
    kept = 0
    for node in [n for n in gm.graph.nodes if n in folded]:
        value = values[node]
        if not isinstance(value, Tensor) or all(u in folded for u in node.users):
            continue
        name = f"_folded_{kept}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, value, persistent=False)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr, delete_user_cb=lambda u: u not in folded)
        kept += 1
    for node in reversed(list(gm.graph.nodes)):  # what nothing reads now
        if (node in folded or node in values) and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return before - len(gm.graph.nodes)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _written(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose data some op may write, or the graph returns, directly or through a
    view (by the ops' alias annotations): none of them is a constant."""
    roots: dict[fx.Node, set[fx.Node]] = {}  # the nodes whose storage a node's may be
    bad: set[fx.Node] = set()
    for node in gm.graph.nodes:
        reads = [roots[n] for n in node.all_input_nodes]
        roots[node] = {node}.union(*reads) if reads and _aliases(node) else {node}
        if node.op == "output":
            bad.update(*reads)
        for written in _writes(node):
            bad.update(roots[written])
    return {n for n, r in roots.items() if r & bad}
