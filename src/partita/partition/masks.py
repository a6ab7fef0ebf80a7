"""Padding masks and device-position arithmetic emitted into the per-device program.

Uneven shards carry ceil padding (``partita.values.layout``). After elementwise ops the padding
holds
garbage — ``exp(0) = 1`` — which is harmless until a value is reduced or contracted along the
padded dim. Before such an op the partitioner replaces the padding by the reduction's identity
(0 for sum, -inf for max, +inf for min) with ``where``, never with a multiply, so NaN or inf in
the padding cannot leak into real values.

This module emits nodes by calling ops on ``torch.fx.Proxy`` values of the per-device graph
(``partition.emit``); it decides nothing about where masks are needed.
"""

from __future__ import annotations

import torch

from partita.errors import InternalError
from partita.partition.proxy import Proxy
from partita.values.layout import ceil_div
from partita.values.mesh import Mesh

__all__ = [
    "arange",
    "axis_index",
    "identity_of",
    "mask_padding",
    "tile_offset",
    "valid_mask",
]

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
    raise InternalError(
        f"masks.identity_of: no identity element for reduce_op {reduce_op!r} (sum, avg, max, "
        f"min have one). {InternalError.REPORT}"
    )


def axis_index(like: Proxy, mesh_axes: tuple[str, ...]) -> Proxy:
    """This device's position in its group along ``mesh_axes`` (0-d int64)."""
    return partita_ops.axis_index.default(like, list(mesh_axes))


def arange(like: Proxy, n: int, dtype: torch.dtype = torch.int64) -> Proxy:
    """``[0, n)`` in ``like``'s graph (a constructor has no proxy argument to trace through)."""
    return like.tracer.create_proxy("call_function", aten.arange.default, (n,), {"dtype": dtype})


def tile_offset(like: Proxy, mesh_axes: tuple[str, ...], tile: int) -> Proxy:
    """``axis_index(mesh_axes) * tile``: where this device's tile starts (0-d int64)."""
    return axis_index(like, mesh_axes) * tile


def valid_mask(
    like: Proxy, mesh: Mesh, mesh_axes: tuple[str, ...], size: int, ndim: int, dim: int
) -> Proxy:
    """A bool tensor broadcastable to a local value: True on the real (unpadded) part of
    ``dim``, which has global ``size`` split over ``mesh_axes``."""
    tile = ceil_div(size, mesh.axes_size(mesh_axes))
    offset = tile_offset(like, mesh_axes, tile)
    position = arange(like, tile) + offset
    return (position < size).reshape([tile] + [1] * (ndim - dim - 1))


def mask_padding(
    x: Proxy,
    mesh: Mesh,
    mesh_axes: tuple[str, ...],
    size: int,
    ndim: int,
    dim: int,
    fill: float | int | bool,
) -> Proxy:
    """``where(real, x, fill)`` along ``dim`` (a no-op when the split is even)."""
    if not mesh_axes or size % mesh.axes_size(mesh_axes) == 0:
        return x
    return torch.where(valid_mask(x, mesh, mesh_axes, size, ndim, dim), x, fill)
