"""Tests of capture.fx_nodes: nodes added bare, then given their arguments, are the nodes fx's
``call_function`` and ``node_copy`` add."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from partita.capture.fx_nodes import add_node, copy_node

aten = torch.ops.aten


def _build(add: Callable[..., fx.Node], copy: Callable[..., fx.Node]) -> fx.Graph:
    """A graph with calls (positional, keyword, list and nested arguments, repeated names)
    and a copy of them into a second graph."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = add(g, aten.add.Tensor, (x, y))
    a.meta["val"] = "kept"
    b = add(g, aten.sum.dim_IntList, (a, [0]), {"keepdim": True, "dtype": torch.float64})
    c = add(g, aten.cat.default, ([a, b, x],), None, "cat_me")
    d = add(g, operator.getitem, ((c, [b, 2]), 0))
    g.output((c, d))
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in g.nodes:
        if node.op == "output":
            out.output(fx.map_arg(node.args[0], env.__getitem__))
        else:
            env[node] = copy(out, node, env.__getitem__)
    return out


def _fx_add(g: fx.Graph, target: Any, args: Any, kwargs: Any = None, name: Any = None) -> Any:
    return g.create_node("call_function", target, args, kwargs, name)


def _describe(g: fx.Graph) -> list[tuple[Any, ...]]:
    return [
        (n.name, n.op, n.target, n.args, dict(n.kwargs), list(n.users), n.all_input_nodes, n.meta)
        for n in g.nodes
    ]


def test_nodes_added_bare_are_the_nodes_fx_adds() -> None:
    ours = _build(add_node, copy_node)
    theirs = _build(_fx_add, fx.Graph.node_copy)
    assert str(ours) == str(theirs)
    assert [repr(d) for d in _describe(ours)] == [repr(d) for d in _describe(theirs)]
    assert ours.python_code("self").src == theirs.python_code("self").src
    ours.lint()
    first = next(n for n in ours.nodes if n.op == "call_function")
    assert first.meta == {"val": "kept"}  # a copy of the meta, not the same dict
