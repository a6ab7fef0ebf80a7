"""The order of the LocalMesh's steps, and when their values die.

``runtime.segments`` cuts a program into segments of local ops between mesh ops; this module
cuts a segment further where a contraction (``runtime.contraction``: a matmul read only by a
sum over mesh axes, a weight gradient under data parallelism) has its operands, so the
contraction runs there and its operands can go (:func:`chunks_at_contractions`), and names,
per step, the values nothing reads after it (:func:`last_uses`), which ``LocalMesh`` drops
there. Before, the contractions ran after their whole segment and every value lived until
the step returned: an FSDP GPT step held every layer's activations and output gradients at
the end of its backward (peak 315 MB above the step's start for GPT-S on 8 devices, against
168 MB for the unsharded torch step; now 194 MB).
"""

from __future__ import annotations

import operator
from typing import Any, cast

from torch import fx
from torch.utils import _pytree as pytree

from partita.runtime.device_index import take_inputs

__all__ = ["chunks_at_contractions", "last_uses", "step_reads"]


#: A segment is cut where a contraction's operands are complete only after this many nodes.
_MIN_CHUNK = 24


def chunks_at_contractions(
    nodes: list[fx.Node], contractions: list[fx.Node]
) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """One depth's local nodes (in graph order) cut so that each contraction runs right after
    the chunk that completes its operands, not after the whole segment: its operands (a
    layer's activations and output gradient) are then dropped there, as autograd drops them,
    instead of every layer's living until the backward ends. ``(chunk, contractions after
    it)``; the first chunk may be empty (contractions of earlier values)."""
    nodes = _items_with_their_op(nodes)
    pos = {n: k for k, n in enumerate(nodes)}
    ready: dict[int, list[fx.Node]] = {}
    for c in contractions:
        at = max((pos[i] for i in c.all_input_nodes if i in pos), default=-1)
        ready.setdefault(at, []).append(c)
    out: list[tuple[list[fx.Node], list[fx.Node]]] = [([], ready.pop(-1, []))]
    start, waiting = 0, []
    for at in sorted(ready):
        waiting += ready[at]
        if at + 1 - start >= _MIN_CHUNK:
            out.append((nodes[start : at + 1], waiting))
            start, waiting = at + 1, []
    out.append((nodes[start:], waiting))
    return [(ns, cs) for ns, cs in out if ns or cs]


def _items_with_their_op(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` with each ``getitem`` of a multi-output op among them moved to just after
    that op, so no cut falls between them: a segment reading the op's tuple of results (an
    attention backward's three gradients) cannot be traced flat, and the whole step was
    never fused (GLM under ``tp``)."""
    inside = set(nodes)
    items: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        if n.target is operator.getitem and n.args[0] in inside:
            items.setdefault(cast(fx.Node, n.args[0]), []).append(n)
    if not items:
        return nodes
    moved = {n for ns in items.values() for n in ns}
    out: list[fx.Node] = []
    for n in nodes:
        if n not in moved:
            out += [n, *items.get(n, ())]
    return out


def step_reads(step: Any, takes: dict[fx.Node, Any]) -> list[fx.Node]:
    """The values one step of a plan reads (``LocalMesh._execute`` runs them)."""
    if not isinstance(step, fx.Node):  # a Segment
        return step.inputs
    if step in takes:
        return take_inputs(step, takes[step])
    return step.all_input_nodes


def last_uses(
    placeholders: list[fx.Node],
    steps: list[Any],
    takes: dict[fx.Node, Any],
    output: Any,
) -> list[tuple[fx.Node, ...]]:
    """Per step, the values last read (or made and never read) there, graph outputs kept."""
    last: dict[fx.Node, int] = dict.fromkeys(placeholders, 0)
    for i, step in enumerate(steps):
        for node in (step,) if isinstance(step, fx.Node) else step.outputs:
            last[node] = i
        for node in step_reads(step, takes):
            last[node] = i
    kept = {x for x in pytree.tree_leaves(output) if isinstance(x, fx.Node)}
    frees: list[list[fx.Node]] = [[] for _ in steps]
    for node, i in last.items():
        if node not in kept and steps:
            frees[i].append(node)
    return [tuple(f) for f in frees]
