"""Independent elementwise ops of a flat graph as one ``torch._foreach_*`` call each.

An optimizer update is the same dozen elementwise ops once per parameter (AdamW: ``mul``,
``add``, ``sqrt``, ``div``, ...), each a Python call of the graph with its dispatch; a tiny
model spends more time there than in its kernels. :func:`foreach_elementwise` groups ops of one
kind (same op, same scalar arguments) that do not depend on each other into one
``aten._foreach_*`` call, as ``torch.optim``'s ``foreach=True`` does: one Python call and one
dispatch for the group, then each op's kernel as before (on the CPU the ``_foreach`` kernels
run the ordinary op on each pair, so every result is the same bit for bit).

How: ops are grouped by kind and by depth (the longest path from the graph's inputs), so no
member reads another; each group becomes one ``_foreach`` call and a ``getitem`` per member,
and the graph is put back in a topological order that keeps the old one where the groups allow
(a group runs once its last member's inputs exist). An op that writes memory stays after the
ops before it that read that memory and before those after it (``flat_effects``): paths and
depths count these as edges too, since a buffer written through a view is read by ops that
take the buffer, not the write's result. Grouping the same step of every
parameter's update holds that step's temporaries for all parameters at once, as
``torch.optim``'s ``foreach`` does. Only small members group (``_MAX_BYTES``): for large
tensors the saved call is nothing next to the kernel, and running one step for every member
before the next step of any loses the cache (each member's chain stays in it when run in
order). ``runtime.flat_trace`` applies it to each segment's flat
graph (one process: no collective's place in the program depends on the order).
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Any

import torch
from torch import fx

from partita.errors import CompilerError
from partita.runtime.flat_effects import aliases, writes

__all__ = ["foreach_elementwise"]

aten = torch.ops.aten

#: op -> (its ``_foreach`` over a list and a list, over a list and one scalar); the unary ops
#: map to their list form.
_BINARY = {
    aten.add.Tensor: (aten._foreach_add.List, aten._foreach_add.Scalar),
    aten.sub.Tensor: (aten._foreach_sub.List, aten._foreach_sub.Scalar),
    aten.mul.Tensor: (aten._foreach_mul.List, aten._foreach_mul.Scalar),
    aten.div.Tensor: (aten._foreach_div.List, aten._foreach_div.Scalar),
    aten.add.Scalar: (None, aten._foreach_add.Scalar),
    aten.mul.Scalar: (None, aten._foreach_mul.Scalar),
    aten.div.Scalar: (None, aten._foreach_div.Scalar),
    aten.sub.Scalar: (None, aten._foreach_sub.Scalar),
}
_UNARY = {
    aten.sqrt.default: aten._foreach_sqrt.default,
    aten.neg.default: aten._foreach_neg.default,
    aten.exp.default: aten._foreach_exp.default,
    aten.abs.default: aten._foreach_abs.default,
    aten.reciprocal.default: aten._foreach_reciprocal.default,
}
#: Fewer members than this stay as they are: measured on the demo GPT's flat graphs, a group
#: of 8 or more runs faster (244 ops of an AdamW update: 0.80 -> 0.60 ms), smaller groups did
#: not (their ``getitem`` calls and the new order cost about what the calls saved).
_MIN_GROUP = 8
#: Members larger than this (bytes of the result) stay as they are: grouping runs one step of
#: every member's chain before the next step of any, so each step streams the whole group's
#: tensors through memory, where the per-member chain (``p``, ``g``, ``m``, ``v`` and their
#: temporaries) stays in the cache. Measured on GPT-S's AdamW (3.45 M parameters, one
#: thread): grouped 46 ms, per op 35 ms; the call saved (a few microseconds) only matters
#: for members whose kernels cost about as little (the demo GPT's).
_MAX_BYTES = 64 * 1024


def _tensor(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _kind(node: fx.Node) -> tuple[Any, ...] | None:
    """The group a node can join: ``(foreach op, scalar or None)``; None if it cannot (or
    its result is over ``_MAX_BYTES``)."""
    if node.op != "call_function" or node.kwargs or not _tensor(node.args[0]):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() > _MAX_BYTES:
        return None
    if node.target in _UNARY and len(node.args) == 1:
        return (_UNARY[node.target], None)
    if node.target not in _BINARY or len(node.args) != 2:
        return None
    listed, scalar = _BINARY[node.target]
    other = node.args[1]
    if _tensor(other) and listed is not None:
        return (listed, None)
    if isinstance(other, int | float) and not isinstance(other, bool):
        # the value and its type: 2 and 2.0 promote an integer tensor differently
        return (scalar, (type(other), other))
    return None


def _emit(
    graph: fx.Graph, before: fx.Node, kind: tuple[Any, ...], members: list[fx.Node]
) -> fx.Node:
    """The group's ``_foreach`` call, placed before ``before``, read by a ``getitem`` per
    member in its place."""
    op, scalar = kind
    firsts = [m.args[0] for m in members]
    if scalar is not None:
        args: tuple[Any, ...] = (firsts, scalar[1])
    elif len(members[0].args) == 2:
        args = (firsts, [m.args[1] for m in members])
    else:
        args = (firsts,)
    with graph.inserting_before(before):
        fused = graph.call_function(op, args)
        fused.meta["val"] = [m.meta["val"] for m in members]
        for i, member in enumerate(members):
            item = graph.call_function(operator.getitem, (fused, i))
            item.meta["val"] = member.meta["val"]
            member.replace_all_uses_with(item)
    for member in members:
        graph.erase_node(member)
    return fused


def foreach_elementwise(gm: fx.GraphModule, from_outputs: bool = False) -> int:
    """Rewrite ``gm``'s independent elementwise ops of one kind as ``_foreach`` calls (see the
    module docstring); returns how many ops were grouped. ``from_outputs``: group by the
    longest path to the graph's end instead of from its inputs (a whole step's optimizer
    updates start wherever each gradient is ready, but all end the step)."""
    graph = gm.graph
    depth: dict[fx.Node, int] = {}
    groups: dict[tuple[Any, ...], list[fx.Node]] = {}
    nodes = list(graph.nodes)
    before = _order_of_writes(nodes)
    if from_outputs:
        later: dict[fx.Node, list[fx.Node]] = {}
        for node, firsts in before.items():
            for first in firsts:
                later.setdefault(first, []).append(node)
        for node in reversed(nodes):
            nexts = itertools.chain(node.users, later.get(node, ()))
            depth[node] = 1 + max((depth[u] for u in nexts), default=-1)
    else:
        for node in nodes:
            prevs = itertools.chain(node.all_input_nodes, before.get(node, ()))
            depth[node] = 1 + max((depth[a] for a in prevs), default=-1)
    for node in nodes:
        kind = _kind(node)
        if kind is not None:  # one depth: no member reads another
            groups.setdefault((*kind, depth[node]), []).append(node)
    count = 0
    call_of: dict[fx.Node, fx.Node] = {}  # a grouped op: its group's call
    for key, members in groups.items():
        if len(members) >= _MIN_GROUP:
            call_of.update(dict.fromkeys(members, _emit(graph, members[0], key[:2], members)))
            count += len(members)
    if count:
        _stable_sort(graph, before, call_of)
        graph.lint()
        gm.recompile()
    return count


def _order_of_writes(nodes: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """Per node, the nodes it must run after besides its inputs: an op that writes memory
    (``flat_effects.writes``) after every earlier op that reads it, and every later op that
    reads it after the write. Its inputs alone do not say so: a buffer written through a view
    of it (``buffer.select(0, i).copy_(piece)``) is read by ops that take the buffer itself,
    which a sort by inputs alone ran before the copies (GLM's ``tp`` step read its q|k|v
    gradient before its pieces were copied in, and never ran fused)."""
    roots: dict[fx.Node, set[fx.Node]] = {}  # the nodes whose memory a node's may be
    last_write: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}  # of each root since its last write
    before: dict[fx.Node, set[fx.Node]] = {}
    for node in nodes:
        read: set[fx.Node] = set().union(*(roots[i] for i in node.all_input_nodes))
        roots[node] = {node} | read if read and aliases(node) else {node}
        deps = {last_write[r] for r in read if r in last_write}
        hit: set[fx.Node] = set().union(*(roots[t] for t in writes(node)))
        for r in hit:
            deps.update(readers.pop(r, ()))
            last_write[r] = node
        for r in read - hit:
            readers.setdefault(r, []).append(node)
        deps.discard(node)
        if deps:
            before[node] = deps
    return before


def _stable_sort(
    graph: fx.Graph, before: dict[fx.Node, set[fx.Node]], call_of: dict[fx.Node, fx.Node]
) -> None:
    """Order ``graph`` topologically, each node as early as in the old order as its inputs
    and ``before`` (the order of writes and reads of memory; a grouped op's entries are its
    group's call, ``call_of``) allow (a group's call, placed at its first member, waits for
    the last member's inputs)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    nexts: dict[fx.Node, set[fx.Node]] = {n: set(n.users) for n in nodes}
    for node, firsts in before.items():
        then = call_of.get(node, node)
        for first in firsts:
            if call_of.get(first, first) is not then:  # one group: no member reads another
                nexts[call_of.get(first, first)].add(then)
    waiting = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in nexts[node]:
            waiting[user] += 1
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in nexts[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    if len(order) != len(nodes):
        raise CompilerError(
            f"foreach_elementwise: the flat graph has a cycle after grouping ({len(nodes)} "
            f"nodes, {len(order)} ordered). This is a bug in partita; set "
            f"PARTITA_TRACE_FLAT_AT=0 to run the segment's vmap instead."
        )
    for prev, node in itertools.pairwise(order):
        prev.append(node)
