"""The modelled time of one run of a partitioned program on named hardware.

:func:`estimate_step` walks the per-device program once: every local op costs its roofline
time (``partita.cost``: FLOPs at the profile's sustained rate or bytes at its memory bandwidth,
at least its launch cost), every collective of the Plan its alpha-beta time on the link its
mesh axes cross (a bucket is one call of its members' summed bytes). The model runs them one
after another — no overlap of communication with compute — so the estimate is an upper bound
on a step whose collectives partita's scheduler overlaps. Shapes come from fake tensors of the
per-device inputs, so nothing runs and a plan for a mesh of any size costs the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from partita.cost.flops import node_bytes, node_flops
from partita.cost.model import Hardware, get_profile, wire_bytes

__all__ = ["StepEstimate", "collective_calls", "estimate_step"]


@dataclass(frozen=True)
class StepEstimate:
    """The modelled time of one run of a per-device program.

    Attributes:
        hardware: the profile's name.
        compute: seconds of local ops.
        collectives: ``{kind: seconds}`` of the collectives.
        flops: floating-point operations per device.
        wire_bytes: bytes each device sends (ring algorithms).
        ops: local ops counted.
    """

    hardware: str
    compute: float
    collectives: Mapping[str, float] = field(default_factory=dict)
    flops: int = 0
    wire_bytes: float = 0.0
    ops: int = 0

    @property
    def communication(self) -> float:
        """Seconds of all collectives."""
        return sum(self.collectives.values())

    @property
    def total(self) -> float:
        """Modelled seconds of the run: compute plus communication (no overlap)."""
        return self.compute + self.communication

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.collectives.items()))
        return (
            f"{self.total * 1e3:.4g} ms on {self.hardware}: compute {self.compute * 1e3:.4g} ms "
            f"({self.flops / 1e9:.4g} GFLOP in {self.ops} ops), communication "
            f"{self.communication * 1e3:.4g} ms" + (f" ({parts})" if parts else "")
        )


def estimate_step(
    plan: Any, hardware: str | Hardware, vals: Mapping[fx.Node, Any] | None = None
) -> StepEstimate:
    """The modelled time of one run of a :class:`~partita.partition.plan.Plan`'s per-device
    program on ``hardware`` (a profile name of ``partita.cost.PROFILES`` or a ``Hardware``);
    ``vals`` are the program's fake values when already computed
    (``partition.memory.fake_values``)."""
    hw = get_profile(hardware)
    compute, flops, ops = 0.0, 0, 0
    if plan.local_program is not None:
        if vals is None:
            from partita.partition.memory import fake_values

            vals = fake_values(plan.local_program, plan.local_inputs)
        for node in plan.local_program.graph.nodes:
            f = node_flops(node, vals)
            b = node_bytes(node, vals)
            if f or b:
                compute += hw.op_seconds(f, b)
                flops += f
                ops += 1
    times: dict[str, float] = {}
    wire = 0.0
    for kind, nbytes, axes in collective_calls(plan):
        times[kind] = times.get(kind, 0.0) + hw.collective_seconds(kind, nbytes, plan.mesh, axes)
        wire += wire_bytes(kind, nbytes, plan.mesh.axes_size(axes))
    return StepEstimate(hw.name, compute, times, flops, wire, ops)


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
