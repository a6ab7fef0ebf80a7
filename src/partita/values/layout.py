"""Shard arithmetic: which piece of a global tensor each device holds, and how to cut and glue.

Definitions used everywhere in partita (and in the docs, ``docs/concepts.md``):

* **Tile index.** A dim split over mesh axes ``(a, b)`` is cut into ``size(a) * size(b)``
  tiles; the device at mesh coordinate ``(.., a=i, .., b=j, ..)`` holds tile ``i * size(b) + j``
  (major first, as in the spec).
* **Ceil padding.** A dim of size ``n`` cut into ``k`` tiles gives every tile ``ceil(n / k)``
  elements. Tile ``t`` covers ``[t * c, min((t + 1) * c, n))`` of the global dim; the rest of its
  storage is zero padding. Trailing tiles may be all padding (9 rows on 8 devices: ``c = 2``,
  tiles 5, 6 and 7 hold no real row). Every device therefore has the same local shape.
* **Tile assignment** (PyTorch/XLA's conversion): the mesh's device array transposed so that the
  axes of dim 0, then of dim 1, ... come first, followed by every other mesh axis (partial and
  replicated, in mesh order) folded into one trailing replication dim when it has more than one
  device.
* **Replica id.** The row-major index of a device's coordinate along the *replicated* mesh axes
  (axes that split no dim and are not partial), in mesh order. Devices holding the same tile of
  the same value have distinct replica ids ``0 .. num_replicas - 1``; replica 0 is the copy that
  gathers read. Devices along a partial axis hold different addends, so they are not replicas of
  each other and can share a replica id.

The functions here are pure and vectorised (numpy for indices, torch for data): no Python loop
runs over devices when data is cut or glued. This module knows nothing of executors or
communication.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from partita.errors import InputError, ShardingError
from partita.values.spec import Sharding

__all__ = [
    "ceil_div",
    "check_strided",
    "glue_tiles",
    "index_ranges",
    "local_shape",
    "permute_sources",
    "replica_ids",
    "shard_compact",
    "shard_tensor",
    "tile_assignment",
    "tile_coords",
    "unshard_tensor",
]


def ceil_div(n: int, k: int) -> int:
    """``ceil(n / k)`` for positive ``k``: the tile size of ``n`` elements over ``k`` devices.

    Example:
        >>> ceil_div(10, 4)
        3
    """
    return -(-n // k)


def local_shape(sharding: Sharding, shape: Sequence[int]) -> tuple[int, ...]:
    """The (padded) per-device shape of a tensor of global ``shape``.

    Example:
        >>> from partita import Mesh, P
        >>> local_shape(P("x", None).to_sharding(Mesh.create((4,), ("x",)), 2), (10, 6))
        (3, 6)
    """
    try:  # executors ask this of every input and output of every step: remembered
        return _local_shape(sharding, tuple(shape))
    except TypeError:  # an unhashable size (symbolic): computed
        return _local_shape.__wrapped__(sharding, shape)


@functools.lru_cache(maxsize=4096)
def _local_shape(sharding: Sharding, shape: Sequence[int]) -> tuple[int, ...]:
    sharding.check_shape(shape)
    return tuple(ceil_div(n, k) for n, k in zip(shape, sharding.tile_shape, strict=True))


def tile_assignment(sharding: Sharding) -> np.ndarray:
    """The device ids arranged by tile, with a trailing replication dim when there is one.

    Example (``Mesh.create((2, 4), ("x", "y"))``, ``P('y', 'x')``): shape ``(4, 2)``, devices
    ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
    """
    mesh = sharding.mesh
    rest = [a for a in mesh.axis_names if a not in sharding.sharded_axes]
    order = [mesh.axis_index(a) for a in (*sharding.sharded_axes, *rest)]
    arr = mesh.devices.transpose(order)
    n_rest = mesh.axes_size(rest)
    return arr.reshape(sharding.tile_shape + ((n_rest,) if n_rest > 1 else ()))


def tile_coords(sharding: Sharding) -> np.ndarray:
    """For each mesh position, the tile index along each dim: int array ``[n_devices, ndim]``."""
    mesh = sharding.mesh
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)  # [mesh_ndim, n_devices]
    out = np.zeros((mesh.size, sharding.ndim), dtype=np.int64)
    for dim, mesh_axes in enumerate(sharding.dim_axes):
        for a in mesh_axes:
            out[:, dim] = out[:, dim] * mesh.axis_size(a) + coords[mesh.axis_index(a)]
    return out


def permute_sources(
    src: Sharding, dst: Sharding, partial: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """For a permute from ``src`` to ``dst`` (same tile counts): the position ``q[p]`` each
    position ``p`` receives its tile from, and the mesh coordinates ``[n_devices, mesh ndim]``.

    A device that already holds its target tile (and partial slot) keeps it; the others are
    matched in position order with the devices that give up that tile (numpy: one sort, no
    loop over devices).
    """
    mesh = src.mesh
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1).T
    part = [mesh.axis_index(a) for a in partial]
    key_src = np.concatenate([tile_coords(src), coords[:, part]], axis=1)
    key_dst = np.concatenate([tile_coords(dst), coords[:, part]], axis=1)
    _, codes = np.unique(np.concatenate([key_src, key_dst]), axis=0, return_inverse=True)
    code_src, code_dst = codes.reshape(-1)[: mesh.size], codes.reshape(-1)[mesh.size :]
    q = np.arange(mesh.size)
    moving = np.flatnonzero(code_src != code_dst)
    senders = moving[np.argsort(code_src[moving], kind="stable")]
    receivers = moving[np.argsort(code_dst[moving], kind="stable")]
    q[receivers] = senders
    return q, coords


def index_ranges(sharding: Sharding, shape: Sequence[int]) -> np.ndarray:
    """Unpadded ``[start, stop)`` of each device's data per dim: int array ``[n_devices, ndim, 2]``.

    A device holding only padding along a dim gets ``start == stop == shape[dim]``.
    """
    local = np.asarray(local_shape(sharding, shape), dtype=np.int64)
    sizes = np.asarray(shape, dtype=np.int64)
    start = np.minimum(tile_coords(sharding) * local, sizes)
    stop = np.minimum(start + local, sizes)
    return np.stack([start, stop], axis=-1)


def replica_ids(sharding: Sharding) -> np.ndarray:
    """The replica id of each mesh position (see the module docstring)."""
    mesh = sharding.mesh
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
    out = np.zeros(mesh.size, dtype=np.int64)
    for a in sharding.replicated_axes:
        out = out * mesh.axis_size(a) + coords[mesh.axis_index(a)]
    return out


def _dims_layout(sharding: Sharding, shape: Sequence[int]) -> tuple[list[int], list[str]]:
    """The interleaved shape ``[*sizes(axes of dim 0), c0, *sizes(axes of dim 1), c1, ...]``
    of a padded global tensor, and the mesh axis (or ``""`` for a local dim) of each entry."""
    mesh = sharding.mesh
    sizes: list[int] = []
    names: list[str] = []
    for n, mesh_axes in zip(shape, sharding.dim_axes, strict=True):
        for a in mesh_axes:
            sizes.append(mesh.axis_size(a))
            names.append(a)
        sizes.append(ceil_div(n, mesh.axes_size(mesh_axes)))
        names.append("")
    return sizes, names


def check_strided(value: torch.Tensor, what: str) -> None:
    """Raise :class:`~partita.errors.InputError` for a sparse (or other non-strided) tensor:
    shards are slices of a dense tensor's storage."""
    if value.layout != torch.strided:
        raise InputError(
            f"{what} is a {value.layout} tensor of shape {list(value.shape)} ({value.dtype}); "
            f"partita shards dense (torch.strided) tensors only, because a shard is a slice of "
            f"the tensor's elements. Pass t.to_dense() instead."
        )


def shard_tensor(value: torch.Tensor, sharding: Sharding) -> torch.Tensor:
    """Cut a global tensor into the stacked per-device layout ``[n_devices, *local_shape]``.

    Padding is zero. For a partial sharding, the value is put on coordinate 0 of the partial
    axes and the identity of ``reduce_op`` (0 for sum; the value itself for max and min) on the
    others, so that reducing over the partial axes gives the value back.
    """
    mesh = sharding.mesh
    compact = _per_mesh(value, sharding)
    local = compact.shape[mesh.ndim :]
    stacked = compact.expand(*mesh.shape, *local)
    if sharding.partial and sharding.reduce_op == "sum":
        keep = torch.zeros(mesh.shape, dtype=torch.bool, device=value.device)
        index = tuple(0 if a in sharding.partial else slice(None) for a in mesh.axis_names)
        keep[index] = True
        keep = keep.reshape(list(mesh.shape) + [1] * len(local))
        stacked = torch.where(
            keep, stacked, torch.zeros((), dtype=value.dtype, device=value.device)
        )
    return stacked.reshape(mesh.size, *local).clone()


def shard_compact(value: torch.Tensor, sharding: Sharding, *, copy: bool = True) -> torch.Tensor:
    """The distinct tiles of a non-partial sharding: ``[*k, *local_shape]`` with ``k[i]`` the
    size of mesh axis ``i`` if it splits a dim, else 1 (every device along it holds the same
    tile). ``shard_tensor`` is this broadcast over the mesh and flattened.

    A copy unless the value is replicated everywhere (then a view: no tile to cut); with
    ``copy=False``, a view of ``value`` wherever no padding or permute needs a copy (the
    caller then must not hand it out, nor write it).

    Example:
        >>> from partita.values.mesh import Mesh
        >>> from partita.values.spec import P
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> shard_compact(torch.zeros(8, 6), P("model").to_sharding(mesh, 2)).shape
        torch.Size([1, 4, 2, 6])
    """
    if sharding.partial:
        raise ShardingError(f"shard_compact: {sharding} is partial; use shard_tensor.")
    compact = _per_mesh(value, sharding)
    return compact if sharding.is_replicated or not copy else compact.clone()


def _per_mesh(value: torch.Tensor, sharding: Sharding) -> torch.Tensor:
    """``[*k, *local_shape]``: the tiles, mesh axes that split nothing of size 1 (a view of
    ``value`` where no padding or permute needs a copy)."""
    check_strided(value, "the value to shard")
    shape = tuple(value.shape)
    padded_shape, sizes, order, view_shape = _tiling(sharding, shape)
    if padded_shape != shape:
        padded = value.new_zeros(padded_shape)
        padded[tuple(slice(0, n) for n in shape)] = value
    else:
        padded = value
    return padded.reshape(sizes).permute(order).reshape(view_shape)


@functools.lru_cache(maxsize=4096)
def _tiling(
    sharding: Sharding, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """How :func:`_per_mesh` cuts a value of ``shape`` (the same for every step of a
    program, so remembered): the padded shape, the interleaved split shape, the permute
    that brings the mesh-axis entries to the front in mesh order, and the result's shape."""
    sharding.check_shape(shape)
    mesh = sharding.mesh
    local = local_shape(sharding, shape)
    padded_shape = tuple(c * k for c, k in zip(local, sharding.tile_shape, strict=True))
    sizes, names = _dims_layout(sharding, shape)
    # Mesh-axis entries to the front in mesh order, local dims after; size-1 dims for the
    # mesh axes that split nothing.
    split_entries = sorted(
        (i for i, n in enumerate(names) if n), key=lambda i: mesh.axis_index(names[i])
    )
    local_entries = [i for i, n in enumerate(names) if not n]
    view_shape = (*(mesh.axis_size(a) if a in names else 1 for a in mesh.axis_names), *local)
    return padded_shape, tuple(sizes), (*split_entries, *local_entries), view_shape


def unshard_tensor(stacked: torch.Tensor, sharding: Sharding, shape: Sequence[int]) -> torch.Tensor:
    """Glue the stacked per-device layout back into the global tensor of ``shape``.

    Partial axes are reduced with ``reduce_op``; replicated axes are read from replica 0;
    padding is sliced off.
    """
    mesh = sharding.mesh
    shape = tuple(shape)
    local = local_shape(sharding, shape)
    if tuple(stacked.shape) != (mesh.size, *local):
        raise ShardingError(
            f"Stacked storage has shape {tuple(stacked.shape)}, expected {(mesh.size, *local)} "
            f"for global shape {shape} under {sharding} on {mesh!r}."
        )
    return glue_tiles(stacked.reshape(*mesh.shape, *local), sharding, shape, local)


def glue_tiles(
    x: torch.Tensor, sharding: Sharding, shape: tuple[int, ...], local: tuple[int, ...]
) -> torch.Tensor:
    """``[*mesh.shape, *local]`` tiles (a stacked value viewed per mesh axis) as the global
    value of ``shape`` (what :func:`unshard_tensor` returns)."""
    mesh = sharding.mesh
    for a in sharding.partial:
        i = mesh.axis_index(a)
        if sharding.reduce_op == "sum":
            x = x.sum(dim=i, keepdim=True, dtype=x.dtype)  # keep int32/bool dtypes
        elif sharding.reduce_op == "max":
            x = x.amax(dim=i, keepdim=True)
        else:
            x = x.amin(dim=i, keepdim=True)
    for a in sharding.replicated_axes:
        i = mesh.axis_index(a)
        x = x.narrow(i, 0, 1)
    # Now x is [*mesh.shape with only sharded axes > 1, *local]; interleave per dim.
    order: list[int] = []
    for d, mesh_axes in enumerate(sharding.dim_axes):
        order.extend(mesh.axis_index(a) for a in mesh_axes)
        order.append(mesh.ndim + d)
    unused = [mesh.axis_index(a) for a in mesh.axis_names if a not in sharding.sharded_axes]
    x = x.permute((*order, *unused))
    padded_shape = [c * k for c, k in zip(local, sharding.tile_shape, strict=True)]
    x = x.reshape(padded_shape) if padded_shape else x.reshape(())
    if tuple(padded_shape) != shape:
        x = x[tuple(slice(0, n) for n in shape)]
    return x.contiguous()


def num_devices_with_data(sharding: Sharding, shape: Sequence[int]) -> int:
    """How many devices hold at least one real (non-padding) element."""
    r = index_ranges(sharding, shape)
    return (
        int(np.all(r[:, :, 1] > r[:, :, 0], axis=1).sum()) if sharding.ndim else sharding.mesh.size
    )
