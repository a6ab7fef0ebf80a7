"""The overlap schedule of a rank's program: launch collectives early, wait for them late.

On real processes a collective only has to *start* once its input exists and only has to
*finish* before its first use; in between, the rank can compute. :func:`schedule_overlap`
rewrites a bound per-device graph (``runtime.distributed``) so that every collective of
``ASYNC_OPS`` becomes a ``start`` node (launch with ``async_op=True``) and a ``wait`` node, then
re-orders the graph: each start right after its inputs are computed (the next block's
parameter all_gather during this block's compute, a gradient reduce_scatter as soon as the
gradient exists), each wait just before the first use that reads the result (the optimizer
update of one bucket waits only for that bucket). A view of the result (``cost.flops.is_view``:
a bucket's ``getitem``, the transpose or reshape of a gradient on its way to the optimizer)
reads nothing: it moves with the wait, after it (the wait returns the finished tensor, which
the view must be taken of), so that a gradient's reduction overlaps the rest of the backward.
``limit_bytes`` bounds the per-device bytes in flight: a start that would exceed it is deferred
until enough earlier collectives are waited for (or until its own result is needed), which also
bounds how much gathered memory a prefetch holds.
Given the size of every value (``sizes``, measured by the program's first run:
:func:`run_measuring`), a gather is also held until its buffer fits under the peak of the
program as partitioned: a prefetch overlaps compute but does not raise the step's peak.

The knob: the ``overlap_bytes`` option of the compiled program (:mod:`partita.options`; the
environment variable ``PARTITA_OVERLAP_BYTES``), default :data:`DEFAULT_OVERLAP_BYTES`; ``0``
runs every collective where the partitioner put it, synchronously. Only the order of launches
and waits changes: every rank issues the same collectives in the same order, and the results
are the same. The simulated mesh (``LocalMesh``) has no overlap to gain and runs the program as
partitioned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx
from torch.autograd.profiler import record_function

from partita.cost.flops import first_read, is_view, is_view_of, value_bytes
from partita.ir import node_meta
from partita.partition.bucket import reorder
from partita.runtime import ranges

__all__ = ["DEFAULT_OVERLAP_BYTES", "first_run", "run_measuring", "schedule_overlap"]

#: Default bound on the per-device bytes of collectives in flight at once (64 MiB).
DEFAULT_OVERLAP_BYTES = 64 << 20


def schedule_overlap(
    graph: fx.Graph,
    targets: Collection[Any],
    start: Callable[..., Any],
    wait: Callable[..., Any],
    kind_of: Callable[[Any], str],
    limit_bytes: int,
    sizes: Mapping[str, int] | None = None,
    gather_buffers: int = 1,
) -> None:
    """Split each collective of ``targets`` into ``start(kind, *args, node=name)`` and
    ``wait(handle)`` and re-order ``graph`` as the module doc says (in place). ``sizes`` (bytes
    of each node's result, by name: :func:`run_measuring`) lets gathers be held under the
    program's peak (:func:`_hold_under_peak`), each counted as ``gather_buffers`` buffers of its
    size (2 on Gloo, which gathers into a temporary and copies it out when done); without
    ``sizes`` they are not held."""
    size_of = {n: sizes.get(n.name, 0) for n in graph.nodes} if sizes is not None else None
    pairs: list[tuple[fx.Node, fx.Node]] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != "node"}
        if kwargs:  # the graph's mesh ops pass their arguments positionally
            continue
        with graph.inserting_before(node):
            h = graph.call_function(start, (kind_of(node.target), *node.args), {"node": node.name})
            w = graph.call_function(wait, (h,))
        node_meta.set_collective_bytes(h, node_meta.collective_bytes(node))
        if (after := node_meta.regather_after(node)) is not None:
            node_meta.set_regather_after(h, after)
        w.meta.update(node.meta)
        if size_of is not None:
            size_of[w] = size_of.pop(node, 0)
        node.replace_all_uses_with(w)
        graph.erase_node(node)
        pairs.append((h, w))
    if not pairs:
        return
    nodes = list(graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    priority = dict(pos)
    for h, w in pairs:
        priority[h] = max((pos[a] for a in h.all_input_nodes), default=-1.0) + 0.5
        priority[w] = first_read(w, pos, max(pos.values())) - 0.5
        for v in _views_of(w):  # move with the wait (a bucket's getitems, a gradient's
            priority[v] = first_read(v, pos, max(pos.values())) - 0.25  # transpose), not before it
    _hold_regathers(pairs, pos, priority)
    if size_of is not None:
        _hold_under_peak(pairs, nodes, priority, size_of, gather_buffers)
    reorder(graph, priority)
    _bound_in_flight(graph, {h: w for h, w in pairs}, limit_bytes)


def _hold_regathers(
    pairs: list[tuple[fx.Node, fx.Node]], pos: dict[fx.Node, float], priority: dict[fx.Node, float]
) -> None:
    """A re-gather (``partition.regather``) starts after the forward is done with the copy it
    replaces and after the previous re-gather's wait: one bucket ahead in the backward, as
    FSDP2 prefetches, instead of right after its input (a parameter shard, there all along),
    which would hold the gathered copy from the start of the step and save no memory."""
    at = {n.name: p for n, p in pos.items()}
    previous = -1.0
    for h, w in sorted(pairs, key=lambda hw: priority[hw[1]]):
        after = node_meta.regather_after(h)
        if after is None:
            continue
        priority[h] = max(priority[h], at.get(after, -1.0) + 0.5, previous + 0.25)
        previous = priority[w]


def _hold_under_peak(
    pairs: list[tuple[fx.Node, fx.Node]],
    nodes: list[fx.Node],
    priority: dict[fx.Node, float],
    size_of: Mapping[fx.Node, int],
    gather_buffers: int,
) -> None:
    """A gather starts no earlier than the point after which its buffer, added to what the
    program holds, stays within the peak of the program as partitioned (synchronous).

    Prefetching trades memory for overlap: the gathered buffer is held from the launch to
    its first use. Launched where the program already holds its peak (the start of the
    backward, every activation alive), the next re-gather bucket would stack on that peak;
    held until the backward has freed that much, it still overlaps the rest of the block.
    Gathers are placed in order of their waits, each counting the buffers already in flight.
    """
    held = _live_bytes(nodes, size_of)
    # a reduce_scatter's flat copy while it moves; on Gloo (``gather_buffers`` 2) also the
    # all_to_all's receive buffer, the flat copy's size (``runtime.dist_ops``), counted with
    # room for the result as well
    for h, w in pairs:
        if str(h.args[0]).startswith("reduce_scatter"):
            flat = sum(size_of.get(a, 0) for a in h.all_input_nodes)
            extra = flat + (gather_buffers - 1) * (flat + size_of.get(w, 0))
            for i in range(math.floor(priority[h]) + 1, min(math.ceil(priority[w]), len(held))):
                held[i] += extra
    cap = max(held, default=0)
    if not cap:
        return
    at = {n: i for i, n in enumerate(nodes)}
    for h in sorted((h for h, _ in pairs), key=at.__getitem__):
        if not str(h.args[0]).startswith("all_gather"):
            continue
        size = int(node_meta.collective_bytes(h)) * gather_buffers
        q = at[h] - 1  # h sits right before w; the buffer is held from after q up to w
        while q >= 0 and held[q] + size <= cap:
            q -= 1
        priority[h] = max(priority[h], q + 0.5)
        for i in range(max(math.floor(priority[h]) + 1, 0), at[h]):
            held[i] += size


def _writes_first(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place op returning its first operand (``a.add_(b)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    alias, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    if alias is None or first is None or not alias.is_write:
        return False
    return bool(alias.before_set & first.before_set)


def _live_bytes(nodes: list[fx.Node], size_of: Mapping[fx.Node, int]) -> list[int]:
    """Bytes of tensors live while each node runs, the program run in this order with every
    collective synchronous (as ``partition.memory`` counts them: a view holds its base, and
    so does an in-place op's result, ``runtime.in_place``)."""
    root: dict[fx.Node, fx.Node] = {}
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        ins = n.all_input_nodes
        root[n] = root[ins[0]] if ins and (is_view(n) or _writes_first(n)) else n
        for a in ins:
            last[root[a]] = i
    out: list[int] = []
    live = 0
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if root[n] is n and n.op != "output":
            size = size_of.get(n, 0)
            live += size
            if n.op != "placeholder":
                frees[last.get(n, i)] = frees.get(last.get(n, i), 0) + size
        out.append(live)
        live -= frees.pop(i, 0)
    return out


def first_run(
    program: fx.GraphModule,
    gm: fx.GraphModule,
    executor: Any,
    args: Sequence[Any],
    vals: dict[str, Tensor] | None = None,
) -> tuple[Any, dict[str, int]]:
    """A DistributedMesh's first run of per-device program ``gm`` that will overlap: its
    ``program`` bound without the schedule (every collective synchronous, where the
    partitioner put it), measuring each value for the schedule (:func:`run_measuring`). Under
    a profiler the step and each mesh op run in the named ranges of every later step
    (``runtime.ranges``); there are no launches and waits yet. ``vals``: filled as
    :func:`run_measuring` says."""
    if not ranges.enabled():
        return run_measuring(program, args, vals)
    with record_function(ranges.step_name(executor)):
        return run_measuring(ranges.ranged_module(program, gm, executor), args, vals)


def run_measuring(
    gm: fx.GraphModule, args: Sequence[Any], vals: dict[str, Tensor] | None = None
) -> tuple[Any, dict[str, int]]:
    """Run ``gm`` once on ``args``; its result and the bytes of each node's result, by name
    (an fx ``Interpreter``, which frees each value after its last use as the program does).
    ``vals`` (if given) receives each tensor result's metadata, by name, as a tensor on the
    ``meta`` device (the ``meta["val"]`` that ``runtime.rank_calls`` needs)."""
    sizes: dict[str, int] = {}

    class _Measure(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            sizes[n.name] = value_bytes(out)
            if vals is not None and isinstance(out, Tensor):
                vals[n.name] = torch.empty_strided(
                    out.shape, out.stride(), dtype=out.dtype, device="meta"
                )
            return out

    interpreter = _Measure(gm)
    interpreter.extra_traceback = False  # a failing collective's message stays as it is
    return interpreter.run(*args), sizes


def _views_of(node: fx.Node) -> list[fx.Node]:
    """The views of ``node``, and the views of those, to any depth."""
    out: list[fx.Node] = []
    todo = [node]
    while todo:
        m = todo.pop()
        views = [u for u in m.users if is_view_of(u, m)]
        out.extend(views)
        todo.extend(views)
    return out


def _bound_in_flight(graph: fx.Graph, wait_of: dict[fx.Node, fx.Node], limit: int) -> None:
    """Defer starts so that at most ``limit`` bytes are in flight (one start always may go)."""
    start_of = {w: h for h, w in wait_of.items()}
    order: list[fx.Node] = []
    deferred: list[fx.Node] = []
    in_flight = 0

    def launch(h: fx.Node) -> None:
        nonlocal in_flight
        order.append(h)
        in_flight += node_meta.collective_bytes(h)

    for n in list(graph.nodes):
        if n in wait_of:
            if in_flight and in_flight + node_meta.collective_bytes(n) > limit:
                deferred.append(n)
            else:
                launch(n)
            continue
        if n in start_of:
            h = start_of[n]
            while h in deferred:  # launch in order up to this one: every rank issues alike
                launch(deferred.pop(0))
            order.append(n)
            in_flight -= node_meta.collective_bytes(h)
            while deferred and (
                not in_flight or in_flight + node_meta.collective_bytes(deferred[0]) <= limit
            ):
                launch(deferred.pop(0))
            continue
        order.append(n)
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n
