"""Cut a run of nodes out of an fx graph into a graph of its own (what a segment between
collectives and a compiled region both are)."""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

__all__ = ["copy_nodes"]


def copy_nodes(
    nodes: list[fx.Node], rewrite: Callable[[fx.Node], None] | None = None
) -> tuple[fx.Graph, list[fx.Node], dict[fx.Node, fx.Node]]:
    """Copy ``nodes`` (in order) into a new graph whose placeholders are their inputs from
    outside the list, in order of first use; ``rewrite`` may edit each copy in place.

    Returns the graph (without its output), the outside inputs and the map from each original
    node (inputs included) to its node in the new graph.
    """
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(i: fx.Node) -> fx.Node:
        if i not in env:
            inputs.append(i)
            env[i] = graph.placeholder(f"in_{i.name}")
        return env[i]

    # Placeholders first: collect every outside input before copying nodes.
    for node in nodes:
        for i in node.all_input_nodes:
            if i not in inside:
                arg(i)
    for node in nodes:
        env[node] = graph.node_copy(node, arg)
        if rewrite is not None:
            rewrite(env[node])
    return graph, inputs, env
