"""Bucketing: fuse independent collectives of one kind into one call on a flat buffer.

A partitioned training step runs one collective per value: under FSDP one all_gather per
parameter and one reduce_scatter per gradient, under gradient clipping one scalar all_reduce per
gradient. Each call costs a latency whatever its size, so :func:`bucket_collectives` replaces
groups of them by the fused ops of ``partita.ir.buckets``:

- which fuse: collectives with the same op (all_gather, all_reduce, reduce_scatter), mesh
  axes, reduce op and dtype, whose *ready* point (their latest input) comes before the *first
  use* of every other member's result. Then no member depends on another, and one call placed
  between the last ready point and the first use is a valid schedule.
- how they are grouped: all_gathers in order of first use (the parameters a block reads come
  together, and the fused call is placed just before the first of them is read);
  all_reduces and reduce_scatters in order of readiness (gradients as the backward produces
  them, the fused call placed right after the last one exists). A bucket closes when the next
  member would exceed ``bucket_bytes`` per device (a single larger value stays alone).
- the Plan keeps one :class:`~partita.partition.plan.CollectiveRecord` per value (bytes stay
  attributed to values) and gains one :class:`~partita.partition.plan.Bucket` per fused call.

The knob: the ``bucket_bytes`` option (:mod:`partita.options`; the environment variable
``PARTITA_BUCKET_BYTES``), default :data:`DEFAULT_BUCKET_BYTES`; ``0`` turns bucketing off.

This module changes only which call moves a value, never what arrives: the fused program
computes exactly what the unfused one does. It does not decide shardings or run anything.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from partita.errors import CompilerError
from partita.ir import node_meta
from partita.ir.buckets import BUCKET_OF
from partita.ir.collectives import COLLECTIVE_OPS
from partita.partition.plan import Bucket, Plan

__all__ = ["DEFAULT_BUCKET_BYTES", "bucket_collectives", "reorder"]

#: Default bucket size per device (4 MiB: about one block of a small GPT, so the next bucket
#: can be gathered while this one computes; measured in bench/README.md).
DEFAULT_BUCKET_BYTES = 4 << 20

_GET_PAST = "please report it. To get past it now, set PARTITA_BUCKET_BYTES=0 (bucketing off)."

# Ops whose result is read only after they are fused: gathers go just before their first use.
_GATHERS = {"all_gather"}


@dataclass
class _Member:
    node: fx.Node
    record: int  # index into plan.collectives
    ready: int  # position of the latest input
    first_use: int  # position of the earliest user
    nbytes: int


def bucket_collectives(gm: fx.GraphModule, plan: Plan, bucket_bytes: int) -> None:
    """Fuse the per-device program's collectives in place and list the buckets in ``plan``.

    Every collective node (fused or not) gets ``node_meta.collective_bytes``, its per-device
    bytes, which the overlap schedule of real processes bounds (``runtime.overlap``).
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    colls = [n for n in nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]
    _check_records(colls, plan)
    for node, rec in zip(colls, plan.collectives, strict=True):
        node_meta.set_collective_bytes(node, rec.bytes)
    if bucket_bytes <= 0:
        return
    is_coll = set(colls)
    level, after, before = _levels(nodes, is_coll, pos)
    groups: dict[tuple[object, ...], list[_Member]] = {}
    for i, node in enumerate(colls):
        if node.target not in BUCKET_OF or node.kwargs or not node.users:
            continue
        rec = plan.collectives[i]
        # a re-gather (partition.regather) is fused only with re-gathers: with a forward
        # gather it would be issued in the forward and hold its memory until the backward
        again = node_meta.regather_of(node) is not None
        key = (node.target, rec.mesh_axes, rec.dtype, level[node], again, *_reduce_op(node))
        if rec.kind in _GATHERS:  # ready once its collective inputs are; needed by its users
            ready = max((after[a] for a in node.all_input_nodes), default=-1)
            first = min(pos[u] for u in node.users)
        else:  # ready when its input is computed; needed by the next op that is no local op
            ready = max((pos[a] for a in node.all_input_nodes), default=-1)
            first = min(before[u] for u in node.users)
        groups.setdefault(key, []).append(_Member(node, i, ready, first, rec.bytes))
    priority: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    changed = False
    for members in groups.values():
        kind = plan.collectives[members[0].record].kind
        gather = kind in _GATHERS
        members.sort(key=(lambda m: m.first_use) if gather else (lambda m: m.ready))
        for bucket in _split(members, bucket_bytes):
            if len(bucket) < 2:
                continue
            at = (
                min(m.first_use for m in bucket) - 0.5
                if gather
                # priority, not pos: an input may be a getitem of a bucket fused just before
                # (a reduce_scatter over one axis feeding an all_reduce over the other)
                else max(priority[a] for m in bucket for a in m.node.all_input_nodes) + 0.5
            )
            _fuse(gm.graph, bucket, priority, at)
            plan.buckets.append(Bucket(kind, tuple(m.record for m in bucket)))
            changed = True
    if changed:
        plan.buckets.sort(key=lambda b: b.members[0])
        reorder(gm.graph, priority)
        gm.graph.lint()
        gm.recompile()


def _levels(
    nodes: list[fx.Node], colls: set[fx.Node], pos: dict[fx.Node, int]
) -> tuple[dict[fx.Node, int], dict[fx.Node, int], dict[fx.Node, int]]:
    """Per node: its level (collectives on its longest path from the inputs), the position of
    the latest collective it depends on through local ops only (-1: none), and the position
    of the earliest collective or output that depends on it through local ops only.

    Collectives of one level never depend on each other, and buckets of one level each can
    never depend on each other both ways: every fused program is acyclic.
    """
    level: dict[fx.Node, int] = {}
    after: dict[fx.Node, int] = {}
    for n in nodes:
        ins = n.all_input_nodes
        level[n] = max((level[i] for i in ins), default=0) + (n in colls)
        after[n] = pos[n] if n in colls else max((after[i] for i in ins), default=-1)
    before: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n in colls or n.op == "output" or not n.users:
            before[n] = pos[n]
        else:
            before[n] = min(before[u] for u in n.users)
    return level, after, before


def _reduce_op(node: fx.Node) -> tuple[object, ...]:
    if node.target is COLLECTIVE_OPS[0]:  # all_gather: no reduction
        return ()
    return (node.args[1] if node.target is COLLECTIVE_OPS[1] else node.args[2],)


def _split(members: list[_Member], cap: int) -> list[list[_Member]]:
    """Consecutive runs whose ready points all precede every first use, within ``cap`` bytes."""
    out: list[list[_Member]] = []
    cur: list[_Member] = []
    last_ready, first_use, size = -1, 0, 0
    for m in members:
        fits = (
            cur
            and max(last_ready, m.ready) < min(first_use, m.first_use)
            and size + m.nbytes <= cap
        )
        if fits:
            cur.append(m)
            last_ready, first_use = max(last_ready, m.ready), min(first_use, m.first_use)
            size += m.nbytes
        else:
            if cur:
                out.append(cur)
            cur, last_ready, first_use, size = [m], m.ready, m.first_use, m.nbytes
    if cur:
        out.append(cur)
    return out


def _fuse(
    graph: fx.Graph, bucket: list[_Member], priority: dict[fx.Node, float], at: float
) -> None:
    first = bucket[0].node
    bucket_op = BUCKET_OF[cast(torch._ops.OpOverload, first.target)]  # a collective op
    xs = [m.node.args[0] for m in bucket]
    if first.target is COLLECTIVE_OPS[1]:  # all_reduce(x, reduce_op, mesh_axes, group_size)
        args = (xs, *first.args[1:])
    else:  # all_gather / reduce_scatter (x, dim, ...): dims become a list
        args = (xs, [m.node.args[1] for m in bucket], *first.args[2:])
    with graph.inserting_before(first):
        fused = graph.call_function(bucket_op, args)
    node_meta.set_bucket_members(fused, [m.node.name for m in bucket])
    afters = [a for m in bucket if (a := node_meta.regather_after(m.node)) is not None]
    if afters:  # launched no earlier than the last forward use of any member
        of = node_meta.regather_of(first)
        assert of is not None  # re-gathers are bucketed only with re-gathers
        node_meta.set_regather(fused, of)
        at_name = {n.name: p for n, p in priority.items()}
        node_meta.set_regather_after(fused, max(afters, key=at_name.__getitem__))
    node_meta.set_collective_bytes(fused, sum(m.nbytes for m in bucket))
    priority[fused] = at
    for j, m in enumerate(bucket):
        with graph.inserting_before(first):
            item = graph.call_function(operator.getitem, (fused, j))
        item.meta.update(m.node.meta)
        priority[item] = at + (j + 1) * 1e-6
        m.node.replace_all_uses_with(item)
    for m in bucket:
        graph.erase_node(m.node)


def reorder(graph: fx.Graph, priority: dict[fx.Node, float]) -> None:
    """Re-order ``graph`` topologically: among the nodes whose inputs are computed, first the
    one needed soonest (its own priority or, if smaller, that of any node that needs it)."""
    nodes = list(graph.nodes)
    need = dict(priority)
    for n in reversed(nodes):
        for u in n.users:
            need[n] = min(need[n], need[u])
    seq = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    heap = [(need[n], seq[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(heap)
    order: list[fx.Node] = []
    while heap:
        _, _, n = heapq.heappop(heap)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(heap, (need[u], seq[u], u))
    if len(order) != len(nodes):
        raise CompilerError(
            f"Re-ordering the per-device program left {len(nodes) - len(order)} of "
            f"{len(nodes)} nodes unplaced: the graph has a cycle after bucketing, a bug in "
            f"partita; {_GET_PAST}"
        )
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


def _check_records(colls: list[fx.Node], plan: Plan) -> None:
    kinds = [cast(torch._ops.OpOverload, n.target)._schema.name.split("::")[-1] for n in colls]
    if kinds != [c.kind for c in plan.collectives]:
        raise CompilerError(
            f"The per-device program has {len(colls)} collectives but its Plan records "
            f"{len(plan.collectives)} (or they differ in kind), so buckets cannot name the "
            f"values they move: a bug in partita; {_GET_PAST}"
        )
