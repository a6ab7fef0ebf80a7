"""A reshard's collectives, planned once per *signature* (:func:`collectives`).

The solver prices every (sharding a value has, sharding a user needs, shape) it meets with
the partitioner's own planner (``partition.reshard.plan_reshard``), and most of that time is
the piecewise collective_permute schedule the planner compares against. Many of those shapes
plan the same way: the planner's choices depend on a dim's size only through whether the dim's
tiles divide evenly, and a dim split by neither sharding is never touched. So each dim is
normalised before planning:

* a dim split by neither sharding becomes 1: no step reads its size, and every local shape
  keeps it whole;
* a dim whose size the mesh's device count divides becomes that count: every tile count (a
  product of mesh axes' sizes) then divides it, so no step pads, every ``ceil_div`` is exact,
  the piecewise schedule's piece counts are the same, and every local shape along the dim is
  the normalised one times ``size / count``;
* any other dim (uneven tiles: padding decides) keeps its size.

The plan of the normalised shape has the same steps as the plan of the real one, each local
shape's element count multiplied by one factor (the product of ``size / normalised size``),
and the planner's choice between its collectives and the piecewise schedule compares byte
counts that both scale by it, so the choice is the same. ``tests/test_auto_costs.py`` checks
the equality against ``plan_reshard`` on the real shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from partita.partition.reshard import plan_reshard
from partita.values.spec import Sharding

__all__ = ["Move", "collectives", "moved_elements", "signature"]

#: one collective of a reshard: (kind, mesh axes, elements per device in the Plan's convention:
#: output elements; input elements for a reduce_scatter)
Move = tuple[str, tuple[str, ...], int]


def signature(src: Sharding, dst: Sharding, shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """The normalised shape (see the module) and the factor its element counts scale by."""
    if 0 in shape:
        return tuple(shape), 1
    devices = src.mesh.size
    out: list[int] = []
    scale = 1
    for n, a, b in zip(shape, src.dim_axes, dst.dim_axes, strict=True):
        m = 1 if not a and not b else devices if n % devices == 0 else n
        out.append(m)
        scale *= n // m
    return tuple(out), scale


def collectives(src: Sharding, dst: Sharding, shape: Sequence[int]) -> list[Move]:
    """The collectives of ``plan_reshard(src, dst, shape)``, planned on the normalised shape."""
    norm, scale = signature(src, dst, shape)
    return [(kind, axes, n * scale) for kind, axes, n in _planned(src, dst, norm)]


def moved_elements(src: Sharding, dst: Sharding, shape: Sequence[int]) -> int:
    """The elements per device the reshard's collectives move, counted as the partitioner
    counts them to choose the copy a reshard starts from (``partition.resharding``)."""
    return sum(n for _, _, n in collectives(src, dst, shape))


@functools.lru_cache(maxsize=16384)
def _planned(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple[Move, ...]:
    out = []
    for step in plan_reshard(src, dst, shape):
        if step.is_collective:
            local = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            out.append((step.kind, tuple(step.mesh_axes), math.prod(local)))
    return tuple(out)
