"""Lift the tensor constants of a traced graph into program inputs.

``make_fx`` turns every real tensor the traced function touches without receiving it as an
argument into a ``get_attr`` constant of the graph: a closed-over tensor, a literal
(``torch.tensor(2.0)``, ``torch.tensor([])``), the parameters and buffers of a module the
function calls. Later stages (propagation, partitioning, the runtimes) handle program inputs
only, so :func:`lift_constants` replaces each such ``get_attr`` by a new placeholder after the
user's inputs and returns the values to feed it, in placeholder order. This is what
``torch.export`` does with its lifted constants.

A lifted constant is annotated replicated (``P()``) when the trace has a mesh: nobody sharded it,
and every device needs all of it. The caller feeds the values; this module does not run the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from partita.capture.annotate import ANNOTATE_OP, Annotation
from partita.capture.fx_nodes import add_node
from partita.ir import node_meta
from partita.values.mesh import Mesh
from partita.values.spec import P

__all__ = ["lift_constants"]


def lift_constants(
    gm: fx.GraphModule, mesh: Mesh | None
) -> tuple[list[torch.Tensor], dict[fx.Node, Annotation]]:
    """Turn each used tensor ``get_attr`` of ``gm`` into a trailing placeholder (in place).

    Returns the constant values (detached, in placeholder order) and the annotate nodes added
    (one replicated annotation per constant when ``mesh`` is given).
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    getters = [n for n in graph.nodes if n.op == "get_attr" and n.users]
    values: list[torch.Tensor] = []
    lifted: list[fx.Node] = []
    last = placeholders[-1] if placeholders else None
    by_target: dict[str, fx.Node] = {}
    for node in getters:
        if str(node.target) in by_target:
            # A second get_attr of the same constant (the backward of a closed-over module's
            # op, traced through autograd.grad, reads its weight again): the same input.
            node.replace_all_uses_with(by_target[str(node.target)])
            graph.erase_node(node)
            continue
        value = _fetch(gm, str(node.target))
        if not isinstance(value, torch.Tensor):
            continue
        if last is None:
            ctx = graph.inserting_before(next(iter(graph.nodes)))
        else:
            ctx = graph.inserting_after(last)
        with ctx:
            ph = graph.placeholder(f"constant{len(values)}")
        ph.meta = dict(node.meta)
        node_meta.set_lifted_from(ph, str(node.target))
        node.replace_all_uses_with(ph)
        graph.erase_node(node)
        _drop(gm, str(node.target))
        values.append(value.detach())
        lifted.append(ph)
        by_target[str(node.target)] = ph
        last = ph
    annotations: dict[fx.Node, Annotation] = {}
    if mesh is not None:
        for ph in lifted:
            node, ann = _annotate_replicated(graph, ph, mesh)
            annotations[node] = ann
    return values, annotations


def _annotate_replicated(graph: fx.Graph, ph: fx.Node, mesh: Mesh) -> tuple[fx.Node, Annotation]:
    """Insert ``annotate(ph, P())`` before ph's first use and route every use through it."""
    users = list(ph.users)
    first_user = min(users, key=_position(graph)) if users else None
    with graph.inserting_before(first_user):
        ann_node = add_node(graph, ANNOTATE_OP, (ph, -1))
    val = ph.meta["val"]
    where = next((node_meta.source(u) for u in users if node_meta.source(u)), None)
    ann = Annotation(
        P().to_sharding(mesh, val.ndim),
        source=f"tensor constant {node_meta.lifted_from(ph)} used at {where or 'an unknown line'}",
    )
    ann_node.meta = {"val": val}
    node_meta.set_annotation(ann_node, ann)
    node_meta.set_source(ann_node, where)
    for user in users:
        user.replace_input_with(ph, ann_node)
    return ann_node, ann


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _fetch(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _drop(gm: fx.GraphModule, target: str) -> None:
    """Remove the attribute so the graph module no longer holds the constant."""
    *path, name = target.split(".")
    owner: object = gm
    for part in path:
        owner = getattr(owner, part)
    if hasattr(owner, name):
        delattr(owner, name)
