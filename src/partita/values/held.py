"""The held form of a sharded value: each distinct tile once, as the LocalMesh holds it.

A value identical along some mesh axes is held once per position of the *other* axes (the
ones it varies along): ``(value, axes)`` with ``axes`` one flag per mesh dim and ``value`` of
shape ``[*(mesh.shape[i] for the flagged axes), *local_shape]``. A weight split over
``model`` and replicated over ``data`` is held as its ``model`` tiles, once; the stacked
``[mesh.size, *local]`` layout (:mod:`partita.values.layout`) repeats them for every ``data``
row. This module converts between a global value, its held form and its stacked form; it
does not run programs (``runtime.local`` reads and writes held values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from partita.errors import ShardingError
from partita.values.layout import check_strided, glue_tiles, local_shape, shard_compact
from partita.values.spec import Sharding

__all__ = ["check_held", "shard_held", "stack_held", "unshard_held"]


def shard_held(value: torch.Tensor, sharding: Sharding) -> tuple[torch.Tensor, tuple[bool, ...]]:
    """A copy of ``value`` cut under the non-partial ``sharding`` as the LocalMesh holds it:
    ``(tiles, axes)``, ``tiles`` once per position of the mesh axes that split a dim
    (``axes[i]``), as :func:`stack_held` reads them. The tiles view one row-major copy of the
    whole value wherever no padding or permute needs a copy, so a weight split by columns is
    held as strided tiles of the global layout and a matmul over its joined tiles reads them
    in place (contiguous tiles would be copied to join them).

    Example:
        >>> from partita.values.mesh import Mesh
        >>> from partita.values.spec import P
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> tiles, axes = shard_held(torch.zeros(6, 8), P(None, "model").to_sharding(mesh, 2))
        >>> tiles.shape, tiles.stride(), axes
        (torch.Size([4, 6, 2]), (2, 8, 1), (False, True))
    """
    check_strided(value, "the value to shard")
    own = value.clone(memory_format=torch.contiguous_format)  # the caller's tensor is not held
    tiles = shard_compact(own, sharding, copy=False)
    ndim = sharding.mesh.ndim
    axes = tuple(k > 1 for k in tiles.shape[:ndim])
    for i in range(ndim - 1, -1, -1):
        if not axes[i]:
            tiles = tiles.select(i, 0)
    return tiles, axes


def check_held(
    value: torch.Tensor, axes: Sequence[bool], sharding: Sharding, shape: tuple[int, ...]
) -> tuple[bool, ...]:
    """``axes`` as bools, after checking that ``value`` holds a value of global ``shape``
    under ``sharding`` once per position of those mesh axes (see :func:`stack_held`)."""
    mesh = sharding.mesh
    flags = tuple(bool(a) for a in axes)
    lead = tuple(n for n, a in zip(mesh.shape, flags, strict=False) if a)
    expected = lead + local_shape(sharding, shape)
    if len(flags) != mesh.ndim or tuple(value.shape) != expected:
        raise ShardingError(
            f"ShardedTensor.from_held got a value of shape {tuple(value.shape)} varying along "
            f"{flags}, but a global shape {shape} under {sharding} on {mesh!r} needs {expected} "
            f"(one leading dim per mesh axis it varies along, then the local shape) and one "
            f"flag per mesh axis ({mesh.ndim}). Check the flags and the global shape."
        )
    return flags


def stack_held(value: torch.Tensor, axes: Sequence[bool], sizes: Sequence[int]) -> torch.Tensor:
    """A value held once per position of the mesh axes it varies along as the stacked
    ``[prod(sizes), *local]`` of every device (``sizes`` the mesh's shape).

    ``value`` is ``[*(sizes[i] for the axes with axes[i] set), *local]``: identical along
    every other axis, so held once for it (the LocalMesh's compact form). A view when it
    varies along every axis or none (a stride-0 device dim), else a copy.

    Example:
        >>> stack_held(torch.tensor([[1], [2]]), (False, True), (3, 2)).flatten().tolist()
        [1, 2, 1, 2, 1, 2]
    """
    n = math.prod(sizes)
    k = sum(bool(a) for a in axes)
    local = value.shape[k:]
    if k == 0:
        return value.expand(n, *local)
    if k == len(sizes):
        return value.reshape(n, *local)
    ones = [size if a else 1 for size, a in zip(sizes, axes, strict=True)]
    return value.reshape(*ones, *local).expand(*sizes, *local).reshape(n, *local)


def unshard_held(
    value: torch.Tensor, axes: Sequence[bool], sharding: Sharding, shape: Sequence[int]
) -> torch.Tensor:
    """``layout.unshard_tensor`` of a held value (see :func:`stack_held`), read in place: no
    stacked copy is made (a new tensor unless the global value is ``value`` itself).

    Example:
        >>> from partita.values.mesh import Mesh
        >>> from partita.values.spec import P
        >>> mesh = Mesh.create((2, 2), ("data", "model"))
        >>> tiles = torch.tensor([[0, 1], [2, 3]])  # [model, local]
        >>> unshard_held(tiles, (False, True), P("model").to_sharding(mesh, 1), (4,)).tolist()
        [0, 1, 2, 3]
    """
    mesh = sharding.mesh
    shape = tuple(shape)
    local = local_shape(sharding, shape)
    ones = [n if a else 1 for n, a in zip(mesh.shape, axes, strict=True)]
    x = value.reshape(*ones, *local).expand(*mesh.shape, *local)
    return glue_tiles(x, sharding, shape, local)
