"""Tag the per-device nodes emitted for one op with the op and source line they come from.

Moved out of ``partition/lower.py`` (its line budget); it does nothing else.
"""

from __future__ import annotations

import torch.fx as fx

from partita.ir import node_meta
from partita.report.explain import op_name

__all__ = ["stamp_origin"]


def stamp_origin(node: fx.Node, first: fx.Node | None, graph: fx.Graph) -> None:
    """Tag the local nodes emitted for ``node`` (from ``first`` on; ``None``: the whole graph)
    with the op and source line they come from, so that a failure while running names them."""
    local = first if first is not None else next(iter(graph.nodes), None)
    if local is None or local.op == "root":  # the op emitted nothing
        return
    origin = f"{op_name(node.target)} (%{node.name})"
    has_source = node_meta.has_source(node)
    while local.op != "root":
        node_meta.set_origin_once(local, origin)
        if has_source:
            node_meta.set_source_once(local, node_meta.source(node))
        local = local.next
