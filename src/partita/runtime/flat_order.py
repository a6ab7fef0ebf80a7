"""Move the ops of a flat graph that read only the graph's inputs to just before their first
reader.

The LocalMesh's traced step (``runtime.fused_step``) keeps the interpreter's order, where an
op runs in the first segment its inputs allow. The optimizer's ops that read only the
step's inputs (AdamW's ``p * (1 - lr * wd)`` and ``v * beta2``, one pair per parameter) thus
run at the start of the step, and their results, as large as the parameters, wait in memory
through the forward and backward passes until the update reads them: two passes over every
parameter's size more between memory and the cache, and that much more memory held
through the step. The unsharded step computes them where the update needs them.

:func:`sink_input_ops` moves each op whose inputs are the graph's inputs, its constants or
other such ops (in a graph without random draws or writes that is every op; partita's
attention kernels, called as Python functions, and what reads them stay where they are) to
just before the first op that reads it. The same ops on the same values:
an op moves only if its result is a function of its inputs alone (``flat_effects.pure``: no
random draw, no write) and no op of the graph may write any of its inputs, so the results
are the same bit for bit. This module changes graphs only.
"""

from __future__ import annotations

from torch import fx

from partita.runtime.flat_effects import pure, written

__all__ = ["sink_input_ops"]


def sink_input_ops(gm: fx.GraphModule) -> int:
    """Move ``gm``'s ops that read only its inputs to just before their first reader (see
    the module doc); returns how many moved. The graph is recompiled when any did.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x, y: x * 2 + (y.exp() * 3).sum())(torch.ones(2), torch.ones(2))
    >>> [n.name for n in gm.graph.nodes if n.op == "call_function"]
    ['mul', 'exp', 'mul_1', 'sum_1', 'add']
    >>> sink_input_ops(gm)
    1
    >>> [n.name for n in gm.graph.nodes if n.op == "call_function"]
    ['exp', 'mul_1', 'sum_1', 'mul', 'add']
    """
    nodes = list(gm.graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    touched = written(gm, returned=False)
    movable: set[fx.Node] = set()
    for node in nodes:
        if node.op != "call_function" or node in touched or not pure(node):
            continue
        if all(_input(a, touched) or a in movable for a in node.all_input_nodes):
            movable.add(node)
    moved = 0
    for node in reversed(nodes):
        if node not in movable or not node.users:
            continue
        first = min(node.users, key=pos.__getitem__)
        before = first.prev
        if before is node:
            continue
        if not pos[before] < (pos[before] + pos[first]) / 2 < pos[first]:
            # the gap has no float left between its ends (many ops sunk before one reader
            # halve it each time): number the nodes again in their current order
            pos.update((n, float(i)) for i, n in enumerate(gm.graph.nodes))
        pos[node] = (pos[before] + pos[first]) / 2
        first.prepend(node)
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _input(node: fx.Node, touched: set[fx.Node]) -> bool:
    return node.op in ("placeholder", "get_attr") and node not in touched
