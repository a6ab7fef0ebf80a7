"""Partitioning: a propagated program -> one per-device program + its Plan.

``partition(gm, mesh, strict=False)`` lowers a GraphModule whose nodes carry
``meta["sharding"]`` / ``meta["factor_axes"]`` / ``meta["rule"]`` (from ``partita.propagate``)
into a per-device GraphModule of local aten ops and partita mesh ops, and a
:class:`~partita.partition.plan.Plan` describing every collective. The reshard transition table
is in ``partition.reshard``; special lowerings in ``partition.handlers``.

Nothing here runs a program; executors live in ``partita.runtime``.
"""

from __future__ import annotations

import torch.fx as fx

from partita.mesh import Mesh
from partita.partition.plan import CollectiveRecord, Plan

__all__ = ["CollectiveRecord", "Plan", "partition"]


def partition(
    gm: fx.GraphModule, mesh: Mesh, *, strict: bool = False
) -> tuple[fx.GraphModule, Plan]:
    """Lower a propagated program; returns ``(per_device_program, plan)``.

    ``strict=True`` turns an involuntary full rematerialization into a
    :class:`~partita.errors.RematerializationError` (otherwise a warning).
    """
    from partita.partition.lower import Lowering

    return Lowering(gm, mesh, strict=strict).run()
