"""The Plan: what a partitioned program will do, known before it runs.

A :class:`Plan` holds the sharding of every value of the program, the shardings of its inputs
and outputs, and one :class:`CollectiveRecord` per collective the per-device program runs —
its kind, mesh axes, device groups, per-device shape, dtype and bytes, and the *reason*: the op
and the user's source line that needed it. ``plan.explain()`` renders it for people.

This module only describes; ``partita.partition.lower`` builds Plans.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.errors import ArgumentError
from partita.values.groups import DeviceGroups
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["Bucket", "CollectiveRecord", "Plan", "format_bytes"]


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective of the per-device program.

    Attributes:
        kind: ``all_gather``, ``all_reduce``, ``reduce_scatter``, ``all_to_all`` or
            ``collective_permute`` (a halo exchange is a collective_permute whose reason says so).
        mesh_axes: the mesh axes it runs over.
        groups: the device groups (device ids) that communicate: a
            :class:`~partita.values.groups.DeviceGroups` (computed on demand; equal to the
            tuple of tuples of ids), so a record costs the same on any mesh size.
        shape: the per-device shape it is reported with (see ``partita.ir.collectives``).
        dtype: the element type.
        value: the name of the value being moved (its fx node).
        reason: why it is needed, in words.
        source: the user's source line of the op that needed it, if known.
        detail: the op's extra arguments (reduce op, dims), for display.
    """

    kind: str
    mesh_axes: tuple[str, ...]
    groups: DeviceGroups | tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: str
    reason: str
    source: str | None = None
    detail: str = ""

    @property
    def bytes(self) -> int:
        """Per-device bytes (the size of ``shape`` at ``dtype``)."""
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Several collectives of one kind that run as one fused call on a flat buffer.

    Attributes:
        kind: the kind of its members (``all_gather``, ``all_reduce`` or ``reduce_scatter``).
        members: indices into ``Plan.collectives``, in the fused buffer's order.
    """

    kind: str
    members: tuple[int, ...]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Plan:
    """Everything a partitioned program does, inspectable before running.

    Attributes:
        mesh: the mesh.
        shardings: ``{value name: Sharding}`` for every value of the (global) program.
        input_shardings / output_shardings: in flattened argument / result order.
        collectives: one record per collective value, in program order (a bucketed value
            keeps its own record, so bytes stay attributed to values).
        buckets: the fused calls (``partition.bucket``); a record in no bucket runs alone.
        warnings: involuntary full rematerializations and other things worth knowing.
    """

    mesh: Mesh
    shardings: dict[str, Any] = field(default_factory=dict)
    input_shardings: list[Sharding] = field(default_factory=list)
    output_shardings: list[Sharding] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    program_text: str = ""
    #: a readable name per input placeholder (``parameter 'fc.weight'``, ``x``), set by jit
    input_names: dict[str, str] = field(default_factory=dict)
    # The per-device program and meta tensors of its local inputs, for ``memory()``.
    local_program: Any = field(default=None, repr=False, compare=False)
    local_inputs: list[Any] = field(default_factory=list, repr=False, compare=False)
    _memory: Any = field(default=None, repr=False, compare=False)
    #: how auto-sharding chose this plan (``partita.auto.AutoReport``; None without auto)
    auto: Any = field(default=None, repr=False, compare=False)
    _values: Any = field(default=None, repr=False, compare=False)
    #: the Plan of each control-flow body, by its name in the per-device program (its
    #: collectives run once per iteration or branch taken; ``partition.control_flow``)
    bodies: dict[str, Plan] = field(default_factory=dict)
    #: decisions about control flow, in words: a replicated carry, a reduced predicate
    control_flow: list[str] = field(default_factory=list)

    def _local_values(self) -> Any:
        """Fake values of the per-device program (shapes only), computed once."""
        if self.local_program is None:
            raise ArgumentError(
                "this Plan has no per-device program attached (it was not made by "
                "partita.partition.partition), so there is nothing to estimate. Get the Plan "
                "from partition() or jit(...).lower(*args)."
            )
        if self._values is None:
            from partita.partition.memory import fake_values  # it runs fake tensors

            self._values = fake_values(self.local_program, self.local_inputs)
        return self._values

    def estimate(self, hardware: Any = "cpu-gloo", overlap: bool = True) -> Any:
        """The modelled time of one run on ``hardware`` (a profile name of
        ``partita.cost.PROFILES`` or a ``partita.cost.Hardware``): a
        :class:`~partita.partition.estimate.StepEstimate`, compute and each collective kind;
        ``overlap=False`` adds every collective's whole time (no overlap with compute)."""
        from partita.partition.estimate import estimate_step

        return estimate_step(self, hardware, self._local_values(), overlap)

    def memory(self) -> Any:
        """Per-device peak memory of one run, estimated from the per-device program (a
        :class:`~partita.partition.memory.MemoryEstimate`; computed once, on first call)."""
        if self._memory is None:
            from partita.partition.memory import estimate_memory

            vals = self._local_values()
            self._memory = estimate_memory(self.local_program, self.local_inputs, vals)
        return self._memory

    def memory_breakdown(self) -> Any:
        """The memory of one run by role — parameters, gathered parameters, gradients,
        optimizer state, other inputs, activations, the returned state — at the peak, and the
        state a training step holds (a
        :class:`~partita.partition.memory_split.MemoryBreakdown`)."""
        from partita.partition.memory_split import memory_breakdown

        return memory_breakdown(self)

    @property
    def bytes_per_device(self) -> int:
        """Total per-device bytes of all collectives of one run."""
        return sum(c.bytes for c in self.collectives)

    def counts(self) -> dict[str, int]:
        """``{kind: number of collectives}``."""
        return dict(Counter(c.kind for c in self.collectives))

    def call_counts(self) -> dict[str, int]:
        """``{kind: number of calls}`` as the program runs them: a bucket is one call."""
        out = Counter(c.kind for c in self.collectives)
        for b in self.buckets:
            out[b.kind] -= len(b.members) - 1
        return dict(out)

    def bucket_bytes(self, bucket: Bucket) -> int:
        """Per-device bytes of one fused call: the sum of its members'."""
        return sum(self.collectives[i].bytes for i in bucket.members)

    def summary(self) -> str:
        """One line per collective kind: count and per-device bytes."""
        by_kind: dict[str, list[CollectiveRecord]] = {}
        for c in self.collectives:
            by_kind.setdefault(c.kind, []).append(c)
        if not by_kind:
            return "no collectives"
        lines = [
            f"{kind:<19} x{len(recs):<4} {format_bytes(sum(r.bytes for r in recs))} per device"
            for kind, recs in sorted(by_kind.items())
        ]
        lines.append(
            f"{'total':<19} x{len(self.collectives):<4} "
            f"{format_bytes(self.bytes_per_device)} per device"
        )
        return "\n".join(lines)

    def explain(self, *, values: bool = False) -> str:
        """A readable report: the mesh, inputs and outputs, each collective with its reason.

        ``values=True`` also lists every value of the program with its op, shape, inferred
        sharding and source line (the propagation result), before the collectives.
        """
        lines = [f"Plan on {self.mesh!r}"]
        if values and self.program_text:
            lines.append("values:")
            lines.extend("  " + line for line in self.program_text.splitlines()[1:])
        if self.input_names:  # one line per input, with the name the user knows it by
            lines.append("inputs:")
            width = max(map(len, self.input_names.values()))
            shardings = dict(zip(self.input_names.values(), self.input_shardings, strict=False))
            lines.extend(f"  {name:<{width}}  {s}" for name, s in shardings.items())
        else:
            lines.append("inputs:  " + ", ".join(str(s) for s in self.input_shardings))
        lines.append("outputs: " + ", ".join(str(s) for s in self.output_shardings))
        if not self.collectives:
            lines.append("collectives: none — every op runs on local shards.")
        else:
            lines.append(
                f"collectives: {len(self.collectives)}, "
                f"{format_bytes(self.bytes_per_device)} per device per run"
            )
        for i, c in enumerate(self.collectives):
            groups = (
                c.groups.describe()
                if isinstance(c.groups, DeviceGroups)
                else " ".join("{" + ",".join(map(str, g)) + "}" for g in c.groups)
            )
            dtype = str(c.dtype).removeprefix("torch.")
            head = (
                f"  [{i}] {c.kind}({c.detail}) over {'×'.join(c.mesh_axes) or '-'} "
                f"{dtype}{list(c.shape)} = {format_bytes(c.bytes)}/device"
            )
            lines.append(head)
            lines.append(f"      groups: {groups}")
            name = self.input_names.get(c.value)
            lines.append(f"      value:  %{c.value}" + (f" ({name})" if name else ""))
            lines.append(f"      why:    {c.reason}")
            if c.source:
                lines.append(f"      source: {c.source}")
        if self.buckets:
            calls = sum(self.call_counts().values())
            lines.append(f"buckets: {len(self.buckets)} fused calls; {calls} calls per run in all")
        for j, b in enumerate(self.buckets):
            members = ", ".join(f"[{i}]" for i in b.members)
            lines.append(
                f"  bucket {j}: {b.kind} x{len(b.members)} = "
                f"{format_bytes(self.bucket_bytes(b))}/device: {members}"
            )
        for w in self.warnings:
            lines.append(f"warning: {w}")
        lines.extend(f"control flow: {note}" for note in self.control_flow)
        for name, body in self.bodies.items():  # each runs once per iteration or branch taken
            kinds = ", ".join(f"{c.kind} over {'×'.join(c.mesh_axes)}" for c in body.collectives)
            lines.append(f"body {name}: {len(body.collectives)} collectives per run ({kinds})")
            lines.extend(f"    {line}" for line in body.explain().splitlines()[3:] if kinds)
        if self.auto is not None:
            lines.append(self.auto.explain())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_html(self, path: Any, *, title: str | None = None) -> Any:
        """Write this Plan as one self-contained HTML page to ``path`` and return its ``Path``:
        warnings, bytes per kind and axis, memory over the program, the program by source line
        with each value's tiles on the mesh, every collective (``partita.report.html``)."""
        from partita.report.html import write_plan_html

        return write_plan_html(self, path, title=title)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: bytes as people read them (B, KiB, MiB)."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"
