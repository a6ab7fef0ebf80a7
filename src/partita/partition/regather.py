"""Re-gathering: free a gathered parameter after its forward uses, gather it again for the backward.

Under FSDP every parameter is all_gathered before the forward reads it. By default the
gathered copy is kept until its last use in the backward: one all_gather per parameter per
step, the fewest bytes, but every block's gathered parameters are alive at once at the start of
the backward, beside all the activations. :func:`regather` is the other choice, what FSDP2 calls
``reshard_after_forward=True``: the gathered copy is freed after its last *forward* use and the
all_gather is issued again just before its first *backward* use, so only the blocks being
computed hold gathered parameters, at the price of a second all_gather of each such parameter.

Which gathers and where (on the per-device program, before bucketing):

- a gathered value is an all_gather of a program input (a parameter shard, possibly through
  views of it) with its views (``permute``, ``view``, ...: they share its storage);
- its uses (the ops that read it or one of its views) are sorted by position and it is split at
  the widest gap between two consecutive uses *during which other parameters are gathered*
  (the forward of later blocks, then the backward of the ones after it): a gap no other gather
  falls in frees nothing another gather could reuse (the last block's weights, read by the
  forward and right after by the backward, stay gathered, as FSDP2 keeps its root's);
- the uses after the gap read a new all_gather of the same input (and copies of the views they
  read), placed just before the first of them. The new node's ``node_meta.regather_of`` names the
  original, ``node_meta.regather_after`` the last use before the gap: bucketing fuses re-gathers
  only with re-gathers, and the overlap schedule of real processes launches one no earlier
  than that (``runtime.overlap``).

The Plan gains one :class:`~partita.partition.plan.CollectiveRecord` per re-issued all_gather
(so its bytes and ``Plan.memory()`` reflect the choice). The knob: the ``regather`` option
(:mod:`partita.options`; the environment variable ``PARTITA_REGATHER``), default off. Values
computed are the same either way, bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx

from partita.cost.flops import is_view
from partita.ir import node_meta
from partita.ir.collectives import COLLECTIVE_OPS
from partita.partition.plan import CollectiveRecord, Plan

__all__ = ["regather"]

_ALL_GATHER = torch.ops.partita.all_gather.default


def regather(gm: fx.GraphModule, plan: Plan) -> int:
    """Split each parameter all_gather of ``gm`` as the module doc says, in place; add the new
    all_gathers to ``plan.collectives`` in program order. Returns how many were added."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    colls = [n for n in nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]
    if len(colls) != len(plan.collectives):
        return 0  # bucket_collectives reports the mismatch with its message
    record: dict[fx.Node, CollectiveRecord] = dict(zip(colls, plan.collectives, strict=True))
    gathers = [n for n in colls if n.target is _ALL_GATHER and _of_input(n)]
    gather_pos = sorted(pos[g] for g in gathers)
    added = 0
    for g in gathers:
        closure = _views(g)
        uses = sorted({pos[u] for c in closure for u in c.users if u not in closure})
        if not uses or nodes[uses[-1]].op == "output":
            continue  # returned gathered: nothing to free
        gap = _widest_gap(uses, gather_pos, g, pos)
        if gap is None:
            continue
        last_fwd, first_bwd = gap
        _split(graph, g, closure, pos, nodes, last_fwd, first_bwd, record)
        added += 1
    if added:
        graph.lint()
        gm.recompile()
        order = [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]
        plan.collectives[:] = [record[n] for n in order]
    return added


def _of_input(node: fx.Node) -> bool:
    """Whether the all_gather's input is a program input or a view of one (alive all along)."""
    x = node.args[0]
    while isinstance(x, fx.Node) and x.op != "placeholder":
        if not is_view(x) or not x.all_input_nodes:
            return False
        x = x.all_input_nodes[0]
    return isinstance(x, fx.Node)


def _views(g: fx.Node) -> list[fx.Node]:
    """``g`` and every view of it (transitively), in program order of discovery."""
    out, todo = [g], [g]
    seen = {g}
    while todo:
        c = todo.pop()
        for u in c.users:
            if u not in seen and u.op == "call_function" and is_view(u) and u.args[0] is c:
                seen.add(u)
                out.append(u)
                todo.append(u)
    return out


def _widest_gap(
    uses: list[int], gather_pos: list[int], g: fx.Node, pos: dict[fx.Node, int]
) -> tuple[int, int] | None:
    """The widest ``(last use before, first use after)`` that other gathers fall in, if any."""
    best: tuple[int, int] | None = None
    for a, b in itertools.pairwise(uses):
        if any(a < p < b for p in gather_pos if p != pos[g]):
            if best is None or b - a > best[1] - best[0]:
                best = (a, b)
    return best


def _split(
    graph: fx.Graph,
    g: fx.Node,
    closure: list[fx.Node],
    pos: dict[fx.Node, int],
    nodes: list[fx.Node],
    last_fwd: int,
    first_bwd: int,
    record: dict[fx.Node, CollectiveRecord],
) -> None:
    """Give the uses at or after ``first_bwd`` (and views made after ``last_fwd``) a new
    all_gather of ``g``'s input, placed before the first of them."""
    in_closure = set(closure)
    late_views = [v for v in closure if v is not g and pos[v] > last_fwd]
    at = nodes[min([first_bwd, *(pos[v] for v in late_views)])]
    with graph.inserting_before(at):
        g2 = graph.call_function(cast(Callable[..., Any], g.target), g.args, dict(g.kwargs))
    g2.meta.update(g.meta)
    node_meta.set_regather(g2, g.name)
    node_meta.set_regather_after(g2, nodes[last_fwd].name)
    rec = record[g]
    record[g2] = dataclasses.replace(
        rec, reason=f"gathered again for the backward (regather=True); first: {rec.reason}"
    )
    new: dict[fx.Node, fx.Node] = {g: g2}

    def copy_of(c: fx.Node) -> fx.Node:
        """The view ``c`` of the forward copy, made on the new one (an early view is copied)."""
        if c not in new:
            src = cast(fx.Node, c.args[0])  # a view's input
            base = copy_of(src)
            with graph.inserting_before(at):
                new[c] = graph.node_copy(c, lambda n: base if n is src else n)
        return new[c]

    for v in late_views:  # made after the forward: read the new copy in place
        src = cast(fx.Node, v.args[0])
        v.replace_input_with(src, copy_of(src))
        new[v] = v
    for c in closure:
        for u in list(c.users):
            if u not in in_closure and pos.get(u, first_bwd) >= first_bwd:
                u.replace_input_with(c, copy_of(c))
