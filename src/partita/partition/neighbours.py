"""Shifting a local value to mesh neighbours: one collective_permute along some mesh axes.

Halo exchanges (conv, pooling, pad) and the re-alignment of an uneven prefix slice both send
each device's edge rows to the next (or previous) member of its group (:func:`emit_shift`);
re-tiling a sliced or concatenated dim (``partition.retile``) sends pieces between any two
members (:func:`emit_pairs`). This module emits the permute and its Plan record; callers say
what the rows are for.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.fx as fx

from partita.ir import node_meta
from partita.partition.lowering_api import LoweringAPI
from partita.partition.plan import CollectiveRecord

__all__ = ["emit_pairs", "emit_shift"]


def emit_shift(
    low: LoweringAPI,
    node: fx.Node,
    x: fx.Node,
    axes: tuple[str, ...],
    shift: int,
    shape: list[int],
    dtype: torch.dtype,
    reason: str,
    value: str | None = None,
) -> fx.Node:
    """Every group member ``i`` sends ``x`` to member ``i + shift`` along ``axes``; members
    with no sender receive zeros. ``shape`` is the per-device shape recorded in the Plan;
    ``value`` names the value moved (default: ``node``, whose source line the record gives)."""
    k = low.mesh.axes_size(axes)
    pairs = [(i, i + shift) for i in range(k) if 0 <= i + shift < k]
    detail = f"shift {shift:+d}"
    return emit_pairs(low, node, x, axes, pairs, shape, dtype, reason, value, detail)


def emit_pairs(
    low: LoweringAPI,
    node: fx.Node,
    x: fx.Node,
    axes: tuple[str, ...],
    pairs: list[tuple[int, int]],
    shape: list[int],
    dtype: torch.dtype,
    reason: str,
    value: str | None = None,
    detail: str = "",
) -> fx.Node:
    """In every group along ``axes``, member ``i`` sends ``x`` to member ``j`` for each
    ``(i, j)`` of ``pairs`` (group positions; each member sends and receives at most once);
    members with no sender receive zeros. ``shape``, ``value``: as for :func:`emit_shift`."""
    groups = low.mesh.device_groups(axes)
    members = np.asarray(low.mesh.groups(axes), dtype=np.int64)  # [groups, size], numpy
    senders, receivers = (np.asarray([p[k] for p in pairs], dtype=np.int64) for k in (0, 1))
    flat: list[int] = np.stack([members[:, senders], members[:, receivers]], -1).ravel().tolist()
    out = low.call(torch.ops.partita.collective_permute.default, x, flat, list(axes))
    low.plan.collectives.append(
        CollectiveRecord(
            kind="collective_permute",
            mesh_axes=tuple(axes),
            groups=groups,
            shape=tuple(shape),
            dtype=dtype,
            value=value or node.name,
            reason=reason,
            source=node_meta.source(node),
            detail=detail or " ".join(f"{i}->{j}" for i, j in pairs),
        )
    )
    return out
