"""What a pipeline costs, read off a Plan: its schedule, bubble and bytes per stage boundary.

:func:`pipeline_report` joins what the :class:`~partita.pipeline.module.Pipeline` knows (its
timetable: stages, micro-batches, rounds, the bubble fraction ``(S - 1) / (V * M + S - 1)``)
with what the compiled program's :class:`~partita.partition.Plan` records: every
``collective_permute`` written in a shard_map body over the stage axis, whose ``detail`` lists
the ``from->to`` positions along the axis. A boundary ``(s, s + 1)`` is counted in both
directions: activations go forward ``s -> s + 1``, their gradients back ``s + 1 -> s``.
The pipeline's input and output are split over the stages by micro-batch; the permutes that
bring stage 0 its input and hand the last stage's results to their stages (and their
gradients back) carry ``M / S`` slots stacked, one dim more than a slot: that is how they are
told apart from the schedule's (``io_bytes``).
Bytes are per device, as everywhere in a Plan (the batch axes split a micro-batch's rows, so
each device sends its block).

This module only reads; it changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partita.partition import Plan
from partita.partition.manual import USER_COLLECTIVE
from partita.pipeline.module import Pipeline
from partita.values.layout import local_shape
from partita.values.spec import P

__all__ = ["PipelineReport", "pipeline_report"]


@dataclass(frozen=True)
class PipelineReport:
    """A pipeline's schedule and its communication in one compiled step.

    Attributes:
        schedule: ``"gpipe"`` or ``"circular"``.
        stages, microbatches, rounds, layers_per_chunk: ``S``, ``M``, ``V``, ``k``.
        iterations: ``V * M + S - 1`` per pass (forward; the backward mirrors it).
        bubble_fraction: ``(S - 1) / (V * M + S - 1)``: the share of a stage's iterations
            spent on no micro-batch.
        boundary_bytes: ``{(s, t): bytes}``, per device, sent from stage ``s`` to stage ``t``
            by the pipeline's permutes in the Plan (forward activations ``s -> s + 1``,
            backward gradients ``s + 1 -> s``).
        slots: ``{(s, t): n}``: micro-batch slots the schedule sends ``s -> t`` in one step,
            forward activations and backward gradients.
        permutes: the number of those permutes in the Plan.
        io_bytes: ``{(s, t): bytes}``, per device, moved by the input's and the output's
            permutes (``o -> 0`` stage ``o``'s input micro-batches, ``S - 1 -> o`` the results
            stage ``o`` holds, and the reverse for their gradients).
        io_permutes: the number of those.
        stage_all_reduce_bytes: per device, the Plan's all_reduces over the stage axis alone
            (none of them the pipeline's own: e.g. the loss summed over the stages' rows).
        param_bytes: per device, of the stacked parameters (``1 / S`` of them).
        param_bytes_total: the stacked parameters unsharded.
    """

    schedule: str
    stages: int
    microbatches: int
    rounds: int
    layers_per_chunk: int
    iterations: int
    bubble_fraction: float
    boundary_bytes: dict[tuple[int, int], int]
    slots: dict[tuple[int, int], int]
    permutes: int
    io_bytes: dict[tuple[int, int], int]
    io_permutes: int
    stage_all_reduce_bytes: int
    param_bytes: int
    param_bytes_total: int

    def boundary(self, s: int, t: int) -> int:
        """Bytes per device across the boundary between stages ``s`` and ``t``, both ways."""
        return self.boundary_bytes.get((s, t), 0) + self.boundary_bytes.get((t, s), 0)

    def explain(self) -> str:
        """The report as text."""
        lines = [
            f"pipeline: {self.schedule}, {self.stages} stages x {self.rounds} round(s) x "
            f"{self.layers_per_chunk} layer(s) per chunk, {self.microbatches} micro-batches",
            f"  iterations per pass: {self.iterations}; bubble fraction (S-1)/(V*M+S-1) = "
            f"{self.bubble_fraction:.3f}",
            f"  stacked parameters: {self.param_bytes} B per device of {self.param_bytes_total} B",
            f"  collective_permutes: {self.permutes} between stages, {self.io_permutes} for "
            f"the input and output ({sum(self.io_bytes.values())} B per device); all_reduce "
            f"over the stage axis: {self.stage_all_reduce_bytes} B per device",
        ]
        pairs = sorted({tuple(sorted(p)) for p in self.boundary_bytes})
        for s, t in pairs:
            fwd, bwd = self.boundary_bytes.get((s, t), 0), self.boundary_bytes.get((t, s), 0)
            lines.append(
                f"  boundary {s}<->{t}: {fwd} B {s}->{t} + {bwd} B {t}->{s} per device "
                f"({self.slots.get((s, t), 0) + self.slots.get((t, s), 0)} slots per step)"
            )
        return "\n".join(lines)


def _pairs(detail: str) -> list[tuple[int, int]]:
    out = []
    for part in detail.split():
        a, _, b = part.partition("->")
        if a.isdigit() and b.isdigit():
            out.append((int(a), int(b)))
    return out


def pipeline_report(pipe: Pipeline, plan: Plan) -> PipelineReport:
    """The :class:`PipelineReport` of ``pipe`` in the program ``plan`` describes (e.g.
    ``step.plan`` of a ``train_step``, or ``jitted.lower(...)``).

    Every ``collective_permute`` over the stage axis alone that a shard_map body wrote is
    counted: another hand-written permute over that axis in the same program would count too.
    """
    sch = pipe.schedule
    axis = (pipe.stage_axis,)
    sent: dict[tuple[int, int], int] = {}
    moved: dict[tuple[int, int], int] = {}
    permutes = io_permutes = reduced = 0
    ours = [
        c
        for c in plan.collectives
        if c.mesh_axes == axis
        and c.kind == "collective_permute"
        and c.reason.startswith(USER_COLLECTIVE)
    ]
    slot_ndim = min((len(c.shape) for c in ours), default=0)
    for c in plan.collectives:
        if c.mesh_axes == axis and c.kind == "all_reduce":
            reduced += c.bytes
    for c in ours:
        io = len(c.shape) > slot_ndim  # M / S slots stacked: the input's or output's move
        into = moved if io else sent
        io_permutes += io
        permutes += not io
        for pair in _pairs(c.detail):
            into[pair] = into.get(pair, 0) + c.bytes
    params = dict(pipe.stack.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    local = 0
    for p in params.values():
        sharding = P(pipe.stage_axis).to_sharding(pipe.mesh, p.ndim)
        local += math.prod(local_shape(sharding, tuple(p.shape))) * p.element_size()
    slots = dict(sch.transfers())
    for (s, t), n in list(slots.items()):
        slots[(t, s)] = slots.get((t, s), 0) + n
    return PipelineReport(
        schedule=sch.kind,
        stages=sch.stages,
        microbatches=sch.microbatches,
        rounds=sch.rounds,
        layers_per_chunk=sch.layers_per_chunk,
        iterations=sch.iterations,
        bubble_fraction=sch.bubble_fraction,
        boundary_bytes=dict(sorted(sent.items())),
        slots=dict(sorted(slots.items())),
        permutes=permutes,
        io_bytes=dict(sorted(moved.items())),
        io_permutes=io_permutes,
        stage_all_reduce_bytes=reduced,
        param_bytes=local,
        param_bytes_total=total,
    )
