"""What the ops of a flat graph may do besides computing their result: write an input, share
an input's storage, draw random numbers.

The passes over the LocalMesh's traced step (``runtime.flat_constants`` computes values
once, ``runtime.flat_order`` moves ops) may only touch an op whose result depends on its
inputs alone, and only read a value no op writes. This module answers those questions from
the ATen schemas (alias annotations, the ``nondeterministic_seeded`` tag); a call whose
schema it does not know (a Python function) is taken to write and alias every input. It
changes nothing.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["aliases", "pure", "writes", "written"]


def pure(node: fx.Node) -> bool:
    """Whether ``node``'s result is a function of its inputs alone: an ATen op (not another
    library's: partita's random draw is one) that writes none of its arguments, draws no
    random numbers and makes no uninitialised memory (``empty``), or a ``getitem``."""
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


def writes(node: fx.Node) -> list[fx.Node]:
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


def aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with an input (a view op, getitem)."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in target._schema.returns)


def written(gm: fx.GraphModule, returned: bool = True) -> set[fx.Node]:
    """The nodes whose data some op may write, directly or through a view (by the ops' alias
    annotations), and with ``returned`` those the graph returns or shares storage with."""
    roots: dict[fx.Node, set[fx.Node]] = {}  # the nodes whose storage a node's may be
    bad: set[fx.Node] = set()
    for node in gm.graph.nodes:
        reads = [roots[n] for n in node.all_input_nodes]
        roots[node] = {node}.union(*reads) if reads and aliases(node) else {node}
        if node.op == "output" and returned:
            bad.update(*reads)
        for target in writes(node):
            bad.update(roots[target])
    return {n for n, r in roots.items() if r & bad}
