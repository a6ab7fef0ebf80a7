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

from typing import Any

from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.runtime.flat_effects import pure, written

__all__ = ["fold_constants"]


def fold_constants(gm: fx.GraphModule) -> int:
    """Fold ``gm``'s ops that read no input (see the module doc); returns how many nodes
    went. The graph is recompiled when any did."""
    touched = written(gm)
    values: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node in touched:
            continue
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, Tensor):
                values[node] = value
            continue
        if node.op != "call_function" or not pure(node):
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
