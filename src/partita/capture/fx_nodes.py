"""Adding nodes to an fx graph without fx's per-argument check for symbolic ints.

``Graph.create_node`` (behind ``call_function`` and ``node_copy``) walks every argument of
a new ``call_function`` node with pytree to warn about a raw ``SymInt``; partita's programs
are traced with static shapes and have none, and the walk was 10-15 % of partitioning
GPT-M and of inlining its layers' copies. :func:`add_node` and :func:`copy_node` create the
node bare (no arguments, nothing to walk) and then set its arguments through fx's own
``Node.args`` / ``Node.kwargs`` setters, which record the uses as ``create_node`` does: the
graph is the same, node for node and name for name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch.fx as fx

__all__ = ["add_node", "copy_node"]


def add_node(
    graph: fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    name: str | None = None,
) -> fx.Node:
    """``graph.create_node("call_function", target, args, kwargs, name)``, at the graph's
    insertion point."""
    node = graph.create_node("call_function", target, name=name)
    node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Callable[[fx.Node], Any]) -> fx.Node:
    """``graph.node_copy(node, arg_transform)``: the node with its arguments mapped, its name
    and a shallow copy of its meta."""
    if node.op != "call_function":
        return graph.node_copy(node, arg_transform)
    new = graph.create_node("call_function", node.target, name=node.name, type_expr=node.type)
    new.args = fx.map_arg(node.args, arg_transform)
    if node.kwargs:
        new.kwargs = fx.map_arg(node.kwargs, arg_transform)
    new.meta = copy.copy(node.meta)
    return new
