"""Profiler range names of the per-device program's collectives, given while partitioning.

Under ``torch.profiler`` the executors (``runtime.ranges``) open one named range per
collective they run. Its name is made here, once per program, from the Plan's record, so the
runtime needs no Plan: ``partita.all_gather[model] 1536 B #3 @ gpt.py:88 in forward`` — the
kind, the mesh axes, the per-device bytes, the record's index in ``Plan.collectives`` and the
user's line that needed it. A fused call (``partition.bucket``) is named after its members:
``partita.all_reduce_bucket[data] 98304 B x12 #4,5,... @ <first member's line>``.

:func:`collective_order` is read before bucketing, :func:`name_collectives` after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from partita.ir import node_meta
from partita.ir.buckets import BUCKET_OPS
from partita.ir.collectives import COLLECTIVE_OPS
from partita.partition.plan import Plan

__all__ = ["collective_name", "collective_order", "name_collectives"]

_NAMED = frozenset((*COLLECTIVE_OPS, *BUCKET_OPS))


def collective_order(gm: fx.GraphModule) -> list[str]:
    """The names of ``gm``'s collective nodes in program order: before bucketing, in the
    order of ``Plan.collectives`` (``partition.bucket`` checks that they agree)."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in _NAMED]


def collective_name(plan: Plan, members: Sequence[int]) -> str:
    """The range name of one call that runs ``plan.collectives[i] for i in members``."""
    first = plan.collectives[members[0]]
    nbytes = sum(plan.collectives[i].bytes for i in members)
    kind = first.kind if len(members) == 1 else f"{first.kind}_bucket"
    name = f"partita.{kind}[{','.join(first.mesh_axes)}] {nbytes} B"
    if len(members) > 1:
        name += f" x{len(members)}"
    name += " #" + ",".join(map(str, members))
    return name + (f" @ {first.source}" if first.source else "")


def name_collectives(gm: fx.GraphModule, plan: Plan, order: Sequence[str]) -> None:
    """Give every collective node of ``gm`` (fused or not) its range name; ``order`` is
    :func:`collective_order` of ``gm`` before bucketing. Does nothing when the program and
    the Plan disagree (the runtime then names the range by the op alone)."""
    if len(order) != len(plan.collectives):
        return
    index = {name: i for i, name in enumerate(order)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _NAMED:
            continue
        members = [index.get(m) for m in node_meta.bucket_members(node) or [node.name]]
        if members and None not in members:
            node_meta.set_range_name(node, collective_name(plan, members))  # type: ignore[arg-type]
