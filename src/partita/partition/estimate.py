"""The modelled time of one run of a partitioned program on named hardware.

:func:`estimate_step` walks the per-device program once: every local op costs its roofline
time (``partita.cost``: FLOPs at the profile's sustained rate or bytes at its memory bandwidth,
at least its launch cost), every collective of the Plan its alpha-beta time on the link its
mesh axes cross (a bucket is one call of its members' summed bytes). Shapes come from fake
tensors of the per-device inputs, so nothing runs and a plan for a mesh of any size costs the
same.

**Overlap.** On real processes partita's runtime (``runtime.overlap``) launches every
all_gather, all_reduce, reduce_scatter and all_to_all (and their buckets) right after its
inputs are computed and waits for it just before its result is first used; a
collective_permute runs where it stands. The estimate walks the program the same way
(:func:`exposed_times`): local ops advance a clock one after another, a launched collective
runs on one channel in launch order (from the later of its launch and the end of the previous
collective), and a wait stalls the clock until the collective is done. While a collective runs
beside compute, only the fraction ``overlap_efficiency`` of the profile hides; the rest slows
the compute (on a CPU, Gloo's threads take the cores the compute needs). So a collective's
*exposed* time is its stall at the wait plus ``(1 - overlap_efficiency)`` of the compute that
ran beside it (of the share beside a call's overhead, its wait for its peers, ``(1 -
overhead_efficiency)``: waiting takes no core), and the step is the compute plus the exposed
communication. A call's overhead depends on the compute since the previous launch
(``Hardware.call_seconds``), which the walk knows (:func:`overlap_calls` with the ops'
costs). ``overlap=False`` runs every collective where it stands, synchronously: compute plus
all communication (each call at its place), the model of a run with ``overlap_bytes=0``. The
walk ignores the runtime's two holds (the bytes in flight, 64 MiB by default, and a gather held
until its buffer fits under the step's peak); both only delay launches, so where they bind the
estimate is optimistic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from torch import fx

from partita.cost.copies import call_copies
from partita.cost.flops import first_read, node_bytes, node_flops
from partita.cost.model import Hardware, get_profile, wire_bytes
from partita.ir import node_meta
from partita.ir.buckets import BUCKET_OPS
from partita.ir.collectives import COLLECTIVE_OPS

__all__ = [
    "Call",
    "StepEstimate",
    "add_copies",
    "collective_calls",
    "estimate_step",
    "exposed_times",
    "overlap_calls",
]

#: The collective kinds the runtime launches asynchronously (``runtime.distributed.ASYNC_OPS``).
ASYNC_KINDS = frozenset(("all_gather", "all_reduce", "reduce_scatter", "all_to_all"))
_MESH_CALLS = frozenset((*COLLECTIVE_OPS, *BUCKET_OPS))


@dataclass(frozen=True)
class StepEstimate:
    """The modelled time of one run of a per-device program.

    Attributes:
        hardware: the profile's name.
        compute: seconds of local ops.
        collectives: ``{kind: seconds}`` of the collectives, all of their time.
        flops: floating-point operations per device.
        wire_bytes: bytes each device sends (ring algorithms).
        ops: local ops counted.
        exposed: ``{kind: seconds}`` of the collectives' time not hidden behind compute (the
            module doc's walk); equal to ``collectives`` when the estimate has no overlap.
        spared: ``{mesh axes: seconds}`` of call overhead the calls over those axes wait less
            than the whole ``call_overhead`` (each after little compute since the previous
            launch, ``Hardware.call_seconds``); ``collectives`` already counts it.
        copies: seconds of the runtime's copies around the collective calls (packing a
            bucket, unpacking a gathered value: ``cost.copies``), part of ``compute``.
    """

    hardware: str
    compute: float
    collectives: Mapping[str, float] = field(default_factory=dict)
    flops: int = 0
    wire_bytes: float = 0.0
    ops: int = 0
    exposed: Mapping[str, float] | None = None
    spared: Mapping[tuple[str, ...], float] = field(default_factory=dict)
    copies: float = 0.0

    @property
    def communication(self) -> float:
        """Seconds of all collectives, hidden or not."""
        return sum(self.collectives.values())

    @property
    def exposed_communication(self) -> float:
        """Seconds of communication the step waits for (``communication`` without overlap)."""
        return self.communication if self.exposed is None else sum(self.exposed.values())

    @property
    def hidden(self) -> float:
        """Seconds of communication hidden behind compute (negative when waiting for the
        channel behind collectives launched early costs more than overlap saves)."""
        return self.communication - self.exposed_communication

    @property
    def total(self) -> float:
        """Modelled seconds of the run: compute plus the exposed communication."""
        return self.compute + self.exposed_communication

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.collectives.items()))
        hidden = (
            f", {self.exposed_communication * 1e3:.4g} ms of it exposed"
            if self.exposed is not None
            else ""
        )
        return (
            f"{self.total * 1e3:.4g} ms on {self.hardware}: compute {self.compute * 1e3:.4g} ms "
            f"({self.flops / 1e9:.4g} GFLOP in {self.ops} ops), communication "
            f"{self.communication * 1e3:.4g} ms" + (f" ({parts})" if parts else "") + hidden
        )


@dataclass(frozen=True, slots=True)
class Call:
    """One collective call in the walk of :func:`exposed_times`.

    Attributes:
        seconds: its modelled time.
        issue: the index of the op after which it is launched.
        wait: the index of the op before which its result is waited for (``issue == wait``
            with ``asynchronous=False``: it runs there, the clock stopped).
        asynchronous: whether it is launched and waited for apart.
        compute_before: seconds of compute since the previous call's launch (None: the
            first call, or not known); its overhead is ``Hardware.call_seconds`` of it.
        overhead: the part of ``seconds`` that is the call's overhead (its wait for peers).
        axes: the mesh axes it runs over.
        at: the index of its own node in the program (-1: not known).
    """

    seconds: float
    issue: int
    wait: int
    asynchronous: bool = True
    compute_before: float | None = None
    overhead: float = 0.0
    axes: tuple[str, ...] = ()
    at: int = -1


def exposed_times(
    compute: Sequence[float],
    calls: Sequence[Call],
    efficiency: float,
    overhead_efficiency: float | None = None,
) -> list[float]:
    """Seconds each of ``calls`` adds to a run whose ops take ``compute`` seconds in order.

    One clock for the ops, one channel for the collectives (in launch order). A synchronous
    call waits for the channel and stops the clock while it runs. An asynchronous one runs from
    the later of its launch and the channel's end; at its wait the clock moves to its end (the
    stall) and further by ``(1 - efficiency)`` of the compute that ran beside it; the share
    of that compute beside a call's ``overhead`` (its part of the call's time) is charged at
    ``(1 - overhead_efficiency)`` instead (None: ``efficiency``).

    >>> exposed_times([10.0, 0.0], [Call(4.0, 1, 1, False)], 1.0)  # where it stands
    [4.0]
    >>> exposed_times([10.0, 0.0], [Call(4.0, -1, 1)], 1.0)  # launched before 10 s of ops
    [0.0]
    >>> exposed_times([10.0, 0.0], [Call(4.0, -1, 1)], 0.5)  # half of it hides
    [2.0]
    >>> exposed_times([2.0, 0.0], [Call(4.0, -1, 1)], 1.0)  # 2 s hide, the wait stalls 2 s
    [2.0]
    """
    launches: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    for k, c in enumerate(calls):
        if c.asynchronous:
            launches.setdefault(c.issue, []).append(k)
        waits.setdefault(c.wait, []).append(k)
    clock = channel = 0.0
    begin, end = [0.0] * len(calls), [0.0] * len(calls)
    out = [0.0] * len(calls)
    segments: list[tuple[float, float]] = []  # when the ops ran (clock intervals)

    def launch(k: int) -> None:
        nonlocal channel
        begin[k] = max(clock, channel)
        end[k] = channel = begin[k] + calls[k].seconds

    def beside(k: int) -> float:  # seconds of ops that ran while call k ran
        return sum(max(0.0, min(b, end[k]) - max(a, begin[k])) for a, b in segments)

    for k in launches.get(-1, []):
        launch(k)
    for i in range(max([len(compute) - 1, *(c.wait for c in calls)]) + 1):
        for k in waits.get(i, []):
            before = clock
            if calls[k].asynchronous:
                clock = max(clock, end[k])
                slowed = _slowed(calls[k], beside(k), efficiency, overhead_efficiency)
                if slowed:
                    segments.append((clock, clock + slowed))
                    clock += slowed
            else:
                launch(k)
                clock = end[k]
            out[k] = clock - before
        if i < len(compute) and compute[i]:
            segments.append((clock, clock + compute[i]))
            clock += compute[i]
        for k in launches.get(i, []):
            launch(k)
    return out


def _slowed(call: Call, beside: float, efficiency: float, overhead: float | None) -> float:
    """How much slower the ``beside`` seconds of compute ran next to ``call``: ``(1 -
    efficiency)`` of it, the share beside the call's overhead at ``(1 - overhead)``."""
    waiting = call.overhead / call.seconds if overhead is not None and call.seconds > 0 else 0.0
    eta = overhead if overhead is not None else efficiency
    return beside * ((1.0 - efficiency) * (1.0 - waiting) + (1.0 - eta) * waiting)


def estimate_step(
    plan: Any,
    hardware: str | Hardware,
    vals: Mapping[fx.Node, Any] | None = None,
    overlap: bool = True,
) -> StepEstimate:
    """The modelled time of one run of a :class:`~partita.partition.plan.Plan`'s per-device
    program on ``hardware`` (a profile name of ``partita.cost.PROFILES`` or a ``Hardware``);
    ``vals`` are the program's fake values when already computed
    (``partition.memory.fake_values``). With ``overlap`` (the runtime's default) the
    collectives it launches early are hidden behind compute as the module doc says; without,
    every collective adds its whole time."""
    hw = get_profile(hardware)
    compute, flops, ops = 0.0, 0, 0
    costs: list[float] = []
    nodes: list[fx.Node] = []
    if plan.local_program is not None:
        if vals is None:
            from partita.partition.memory import fake_values

            vals = fake_values(plan.local_program, plan.local_inputs)
        nodes = list(plan.local_program.graph.nodes)
        for node in nodes:
            f = node_flops(node, vals)
            b = node_bytes(node, vals)
            cost = hw.op_seconds(f, b) if f or b else 0.0
            costs.append(cost)
            if f or b:
                compute += cost
                flops += f
                ops += 1
    times: dict[str, float] = {}
    wire = 0.0
    for kind, nbytes, axes in collective_calls(plan):
        times[kind] = times.get(kind, 0.0) + hw.collective_seconds(kind, nbytes, plan.mesh, axes)
        wire += wire_bytes(kind, nbytes, plan.mesh.axes_size(axes))
    copies = add_copies(plan, hw, nodes, vals or {}, costs)
    compute += copies
    calls = overlap_calls(plan, hw, nodes, costs)
    spared: dict[tuple[str, ...], float] = {}
    for kind, call in calls:  # a call after little compute waits less for its peers
        if call.compute_before is not None:
            less = hw.call_overhead - call.overhead
            times[kind] -= less
            spared[call.axes] = spared.get(call.axes, 0.0) + less
    exposed = _exposed(calls, costs, hw, times) if overlap else None
    return StepEstimate(hw.name, compute, times, flops, wire, ops, exposed, spared, copies)


def add_copies(
    plan: Any,
    hw: Hardware,
    nodes: Sequence[fx.Node],
    vals: Mapping[fx.Node, Any],
    costs: list[float],
) -> float:
    """Add to ``costs`` (each node's seconds, in place) the runtime's copies around each
    collective call of ``nodes`` (``cost.copies``, each priced by ``Hardware.copy_seconds``):
    the packing to the op after which the call is launched, the unpacking to the op before
    which it is waited for (where the runtime runs them). Returns their seconds."""
    total = 0.0
    for _, call in _placed(plan, hw, nodes):
        if call.at < 0:
            continue
        launch, wait = call_copies(nodes[call.at], vals)
        for at, sizes in ((max(call.issue, 0), launch), (call.wait, wait)):
            seconds = sum(hw.copy_seconds(b) for b in sizes)
            if seconds:
                costs.extend([0.0] * (at + 1 - len(costs)))
                costs[at] += seconds
                total += seconds
    return total


def _exposed(
    calls: list[tuple[str, Call]], costs: list[float], hw: Hardware, times: dict[str, float]
) -> dict[str, float]:
    """``{kind: exposed seconds}``: the walk of :func:`exposed_times` over the program's own
    collectives (``calls``, :func:`overlap_calls`); any time of ``times`` the walk does not
    see (a control-flow body's collectives) counts as exposed."""
    out = dict.fromkeys(times, 0.0)
    seen: dict[str, float] = {}
    walked = exposed_times(
        costs, [c for _, c in calls], hw.overlap_efficiency, hw.overhead_efficiency
    )
    for (kind, call), t in zip(calls, walked, strict=True):
        out[kind] = out.get(kind, 0.0) + t
        seen[kind] = seen.get(kind, 0.0) + call.seconds
    for kind, total in times.items():  # what the walk did not see runs synchronously
        out[kind] += max(0.0, total - seen.get(kind, 0.0))
    return out


def overlap_calls(
    plan: Any, hw: Hardware, nodes: Sequence[fx.Node], costs: Sequence[float] | None = None
) -> list[tuple[str, Call]]:
    """``(kind, Call)`` of each collective of ``nodes`` (the per-device program's, in order),
    launched and waited for where ``runtime.overlap`` puts them: after its last input (a
    re-gather also after the op it waits for and after the previous re-gather's wait), waited
    for before the first op that reads its result (through a bucket's getitems); a
    collective_permute where it stands. With ``costs`` (each node's seconds), each call's
    time counts its overhead after the compute since the previous launch (:func:`_spaced`);
    without, the whole overhead."""
    calls = _placed(plan, hw, nodes)
    return _spaced(calls, hw, costs) if costs is not None else calls


def _spaced(
    calls: list[tuple[str, Call]], hw: Hardware, costs: Sequence[float]
) -> list[tuple[str, Call]]:
    """``calls`` with each one's ``compute_before``: the seconds of ``costs`` between the
    previous launch (in launch order, over every axis: each process takes part in a call of
    every axis) and its own, and its time with that call's overhead instead of the whole."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    order = sorted(range(len(calls)), key=lambda k: calls[k][1].issue)  # stable: program order
    out = list(calls)
    previous: int | None = None
    for k in order:
        kind, call = calls[k]
        before = None if previous is None else prefix[call.issue + 1] - prefix[previous + 1]
        if not call.overhead:  # a group of one: no call
            continue
        wait = hw.call_seconds(before)
        seconds = call.seconds + wait - call.overhead
        out[k] = (
            kind,
            dataclasses.replace(call, seconds=seconds, compute_before=before, overhead=wait),
        )
        previous = call.issue
    return out


def _placed(plan: Any, hw: Hardware, nodes: Sequence[fx.Node]) -> list[tuple[str, Call]]:
    index = {n: i for i, n in enumerate(nodes)}
    calls: list[tuple[str, Call]] = []
    previous_regather = -1
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node.target not in _MESH_CALLS:
            continue
        kind = node.target._schema.name.split("::")[-1].removesuffix("_bucket")
        axes = cast(Sequence[str], node.args[2 if kind == "collective_permute" else -2])
        seconds = hw.collective_seconds(kind, node_meta.collective_bytes(node), plan.mesh, axes)
        overhead = hw.call_overhead if seconds > 0 else 0.0
        if kind not in ASYNC_KINDS:
            call = Call(seconds, i, i, False, overhead=overhead, axes=tuple(axes), at=i)
            calls.append((kind, call))
            continue
        issue = max((index[a] for a in node.all_input_nodes), default=-1)
        wait = int(first_read(node, index, len(nodes)))
        if (after := node_meta.regather_after(node)) is not None:
            at = next((index[n] for n in nodes if n.name == after), -1)
            issue = max(issue, at, previous_regather - 1)  # one re-gather ahead
            previous_regather = wait
        call = Call(seconds, issue, wait, overhead=overhead, axes=tuple(axes), at=i)
        calls.append((kind, call))
    return calls


def collective_calls(plan: Any) -> list[tuple[str, int, tuple[str, ...]]]:
    """``(kind, bytes, mesh axes)`` of every collective call of one run of ``plan``: each
    collective in no bucket, then each bucket as one call of its members' summed bytes."""
    in_bucket = {i for b in plan.buckets for i in b.members}
    calls = [
        (c.kind, c.bytes, tuple(c.mesh_axes))
        for i, c in enumerate(plan.collectives)
        if i not in in_bucket
    ]
    for b in plan.buckets:
        first = plan.collectives[b.members[0]]
        calls.append((b.kind, plan.bucket_bytes(b), tuple(first.mesh_axes)))
    return calls
