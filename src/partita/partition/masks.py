"""Padding masks and device-position arithmetic emitted into the per-device program.

Uneven shards carry ceil padding (``partita.layout``). After elementwise ops the padding holds
garbage — ``exp(0) = 1`` — which is harmless until a value is reduced or contracted along the
padded dim. Before such an op the partitioner replaces the padding by the reduction's identity
(0 for sum, -inf for max, +inf for min) with ``where``, never with a multiply, so NaN or inf in
the padding cannot leak into real values.

This module emits fx nodes; it decides nothing about where masks are needed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partita.layout import ceil_div
from partita.mesh import Mesh

__all__ = ["emit_mask_padding", "emit_tile_offset", "emit_valid_mask", "identity_of"]

aten = torch.ops.aten
partita_ops = torch.ops.partita


def identity_of(reduce_op: str, dtype: torch.dtype) -> float | int | bool:
    """The identity element of a reduction for ``dtype``."""
    if reduce_op in ("sum", "avg", "mean"):
        return False if dtype == torch.bool else 0
    big: float | int
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        big = float("inf")
    else:
        big = torch.iinfo(dtype).max
    if reduce_op == "max":
        return -big if dtype.is_floating_point else torch.iinfo(dtype).min
    if reduce_op == "min":
        return big
    raise ValueError(f"no identity for reduce_op {reduce_op!r}")


def emit_tile_offset(
    graph: fx.Graph, like: fx.Node, mesh_axes: tuple[str, ...], tile: int
) -> fx.Node:
    """``axis_index(mesh_axes) * tile``: where this device's tile starts (0-d int64)."""
    idx = graph.call_function(partita_ops.axis_index.default, (like, list(mesh_axes)))
    return graph.call_function(aten.mul.Tensor, (idx, tile))


def emit_valid_mask(
    graph: fx.Graph,
    like: fx.Node,
    mesh: Mesh,
    mesh_axes: tuple[str, ...],
    size: int,
    ndim: int,
    dim: int,
) -> fx.Node:
    """A bool tensor broadcastable to a local value: True on the real (unpadded) part of
    ``dim``, which has global ``size`` split over ``mesh_axes``."""
    k = mesh.axes_size(mesh_axes)
    tile = ceil_div(size, k)
    offset = emit_tile_offset(graph, like, mesh_axes, tile)
    ar = graph.call_function(aten.arange.default, (tile,), {"dtype": torch.int64})
    pos = graph.call_function(aten.add.Tensor, (ar, offset))
    valid = graph.call_function(aten.lt.Scalar, (pos, size))
    shape = [tile] + [1] * (ndim - dim - 1)
    return graph.call_function(aten.reshape.default, (valid, shape))


def emit_mask_padding(
    graph: fx.Graph,
    x: fx.Node,
    mesh: Mesh,
    mesh_axes: tuple[str, ...],
    size: int,
    ndim: int,
    dim: int,
    fill: float | int | bool,
) -> fx.Node:
    """``where(real, x, fill)`` along ``dim`` (a no-op when the split is even)."""
    if not mesh_axes or size % mesh.axes_size(mesh_axes) == 0:
        return x
    valid = emit_valid_mask(graph, x, mesh, mesh_axes, size, ndim, dim)
    return graph.call_function(aten.where.ScalarOther, (valid, x, fill))
