"""Partitioning: a propagated program -> one per-device program + its Plan.

``partition(gm, mesh, options)`` lowers a GraphModule whose nodes carry
``node_meta.sharding`` / ``factor_axes`` / ``rule`` (from ``partita.propagate``)
into a per-device GraphModule of local aten ops and partita mesh ops, and a
:class:`~partita.partition.plan.Plan` describing every collective. The reshard transition table
is in ``partition.reshard``; special lowerings in ``partition.handlers``; fusing collectives
into buckets in ``partition.bucket``.

Importing this package registers every special lowering (``special/``, ``halo/``) and checks
that each :class:`~partita.rules.handler_names.HandlerName` a rule may use has one, so a missing
handler fails here rather than degrading an op to gathered tensors when it runs.

Nothing here runs a program; executors live in ``partita.runtime``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx

from partita.capture.gc_pause import gc_paused
from partita.options import CompileOptions
from partita.options import resolve as resolve_options
from partita.partition import halo as _halo  # noqa: F401 - registers its handler
from partita.partition import handlers
from partita.partition import retile as _retile  # noqa: F401 - registers its handler
from partita.partition import special as _special  # noqa: F401 - registers its handlers
from partita.partition.bucket import bucket_collectives
from partita.partition.lower import Lowering
from partita.partition.plan import Bucket, CollectiveRecord, Plan
from partita.partition.ranges import collective_order, name_collectives
from partita.partition.regather import regather as regather_gathered
from partita.values.layout import local_shape
from partita.values.mesh import Mesh

handlers.check_registry()

__all__ = ["Bucket", "CollectiveRecord", "Plan", "partition"]


def partition(
    gm: fx.GraphModule,
    mesh: Mesh,
    options: CompileOptions | dict[str, Any] | None = None,
) -> tuple[fx.GraphModule, Plan]:
    """Lower a propagated program; returns ``(per_device_program, plan)``.

    ``options`` (a :class:`~partita.options.CompileOptions`, a dict of changes to the current
    options, or None for :func:`partita.options.current`) gives the knobs this stage reads:
    ``strict`` turns an involuntary full rematerialization into a
    :class:`~partita.errors.RematerializationError` (otherwise a warning); ``collectives``
    (``partition.explicit``) refuses or warns about collectives the annotations do not imply;
    ``regather`` frees gathered parameters after the forward and gathers them again for the
    backward (``partition.regather``); ``bucket_bytes`` caps the per-device bytes of one fused
    collective, 0 turns bucketing off (``partition.bucket``).
    """
    opts = resolve_options(options)
    with gc_paused():  # the lowering's nodes and records all live on: see capture.gc_pause
        local, plan = Lowering(gm, mesh, strict=opts.strict, collectives=opts.collectives).run()
        if opts.regather:
            regather_gathered(local, plan)
        order = collective_order(local)
        bucket_collectives(local, plan, opts.bucket_bytes)
        name_collectives(local, plan, order)  # the profiler ranges' names (partition.ranges)
        plan.local_program, plan.local_inputs = local, _local_inputs(gm, plan)
    return local, plan


def _local_inputs(gm: fx.GraphModule, plan: Plan) -> list[Any]:
    """Tensors of the per-device program's input shapes, without data (for ``Plan.memory``):
    fake tensors on the device the program was traced on (the CPU, or meta for a model built
    on the meta device), so that they meet the program's constants on one device."""
    shardings = iter(plan.input_shardings)
    out: list[Any] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = local_shape(next(shardings), tuple(val.shape))
            mode = getattr(val, "fake_mode", None)
            with mode if mode is not None else contextlib.nullcontext():
                device = val.device if mode is not None else "meta"
                out.append(torch.empty(shape, dtype=val.dtype, device=device))
        else:
            out.append(val)
    return out
