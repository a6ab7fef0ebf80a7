"""The simulated mesh's mesh ops: every ``partita::`` op on *stacked* tensors.

A value on the simulated mesh is one tensor ``[mesh.size, *local_shape]``; row ``p`` is the shard
of device ``mesh.device_ids[p]`` (its flat row-major mesh position). Each function here takes the
:class:`~partita.Mesh` and the op's arguments with ``x`` stacked, and returns the stacked result.
All are vectorised: the stack is viewed as ``[rest, group, *local]`` (the devices that differ only
along ``mesh_axes`` side by side, major-first in the order given, as ``Mesh.groups`` orders them)
and the collective is a sum, max, cat or movedim over the group dim. No Python loop runs over
devices.

:data:`STACKED_IMPLS` maps each ``torch.ops.partita.<name>.default`` to its function; the
LocalMesh executor calls ``STACKED_IMPLS[node.target](mesh, *args)``. :data:`STACKED_BUCKET_IMPLS`
does the same for the fused ops of ``partita.ir.buckets``. This module does not run
graphs (``runtime.local`` does) and knows nothing of shardings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from partita.errors import ArgumentError
from partita.ir import buckets as _buckets  # noqa: F401 - registers the fused ops
from partita.ir import collectives
from partita.values.layout import ceil_div
from partita.values.mesh import Mesh

__all__ = [
    "STACKED_BUCKET_IMPLS",
    "STACKED_IMPLS",
    "all_gather",
    "all_gather_bucket",
    "all_reduce",
    "all_reduce_bucket",
    "all_to_all",
    "axis_index",
    "collective_permute",
    "reduce_scatter",
    "reduce_scatter_bucket",
    "scatter_reduced",
    "shard_slice",
]


def _group_order(mesh: Mesh, mesh_axes: Sequence[str]) -> list[int]:
    """Mesh dims reordered as (other axes in mesh order, ``mesh_axes`` as given)."""
    names = [mesh.axis_name(a) for a in mesh_axes]
    rest = [n for n in mesh.axis_names if n not in names]
    return [mesh.axis_names.index(n) for n in rest + names]


def _to_groups(mesh: Mesh, x: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    """``[n, *local]`` -> ``[n // g, g, *local]``: dim 1 walks a group in member order."""
    local = x.shape[1:]
    order = _group_order(mesh, mesh_axes)
    g = mesh.axes_size(mesh_axes)
    y = x.reshape(*mesh.shape, *local).permute(*order, *range(mesh.ndim, mesh.ndim + len(local)))
    return y.reshape(mesh.size // g, g, *local)


def _from_groups(mesh: Mesh, y: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    """The inverse of :func:`_to_groups` (for any local shape)."""
    local = y.shape[2:]
    order = _group_order(mesh, mesh_axes)
    permuted_shape = [mesh.shape[i] for i in order]
    inverse = list(np.argsort(order))
    z = y.reshape(*permuted_shape, *local)
    z = z.permute(*inverse, *range(mesh.ndim, mesh.ndim + len(local)))
    return z.reshape(mesh.size, *local)


def reduce_over(
    y: Tensor, dims: Sequence[int], reduce_op: str, copies: int = 1, count: int | None = None
) -> Tensor:
    """``y`` reduced over ``dims`` as the members of a group: each element stands for
    ``copies`` members holding the same value (the group axes a value does not vary along),
    and ``avg`` divides by ``count`` members (default: the elements reduced times ``copies``).

    Example:
        >>> reduce_over(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [0], "avg", copies=2)
        tensor([2., 3.])
    """
    if reduce_op in ("max", "min"):
        if not dims:
            return y
        return y.amax(dim=list(dims)) if reduce_op == "max" else y.amin(dim=list(dims))
    if reduce_op not in ("sum", "avg"):
        raise ArgumentError(
            f"reduce_op must be one of {collectives.REDUCE_OPS}, got {reduce_op!r}."
        )
    total = y.sum(dim=list(dims), dtype=y.dtype) if dims else y  # sum(dim=[]) sums everything
    if copies > 1:
        total = total * copies
    if reduce_op == "sum":
        return total
    n = count if count is not None else math.prod(y.shape[d] for d in dims) * copies
    if total.is_floating_point() or total.is_complex():
        return total / n
    return torch.div(total, n, rounding_mode="trunc")


def all_gather(
    mesh: Mesh, x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Every member gets the group's local tensors concatenated along ``dim`` in member order."""
    y = _to_groups(mesh, x, mesh_axes)  # [r, g, *local]
    r, g = y.shape[:2]
    local = list(y.shape[2:])
    cat = y.movedim(1, 1 + dim)  # [r, *local[:dim], g, local[dim], ...]
    local[dim] = local[dim] * g
    cat = cat.reshape(r, 1, *local).expand(r, g, *local)
    return _from_groups(mesh, cat, mesh_axes)


def all_reduce(
    mesh: Mesh, x: Tensor, reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Every member gets the reduction of the group's local tensors."""
    y = _to_groups(mesh, x, mesh_axes)
    reduced = reduce_over(y, [1], reduce_op).unsqueeze(1).expand_as(y)
    return _from_groups(mesh, reduced, mesh_axes)


def reduce_scatter(
    mesh: Mesh, x: Tensor, dim: int, reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Reduce over the group, then member ``i`` keeps chunk ``i`` of ``dim``."""
    y = _to_groups(mesh, x, mesh_axes)
    g = y.shape[1]
    local = list(y.shape[2:])
    if local[dim] % g:
        raise ArgumentError(
            f"reduce_scatter: dim {dim} of local shape {tuple(local)} is not divisible by the "
            f"group size {g}; pad it first."
        )
    return scatter_reduced(mesh, reduce_over(y, [1], reduce_op), dim, mesh_axes)


def scatter_reduced(mesh: Mesh, reduced: Tensor, dim: int, mesh_axes: Sequence[str]) -> Tensor:
    """The scatter half of :func:`reduce_scatter`: ``reduced`` is ``[r, *local]``, one
    reduction per group (``r = mesh.size // group size``); member ``i`` of each group keeps
    chunk ``i`` of ``dim`` of its group's."""
    g = mesh.axes_size(mesh_axes)
    r, local = reduced.shape[0], list(reduced.shape[1:])
    split = reduced.reshape(r, *local[:dim], g, local[dim] // g, *local[dim + 1 :])
    return _from_groups(mesh, split.movedim(1 + dim, 1), mesh_axes)


def all_to_all(
    mesh: Mesh,
    x: Tensor,
    split_dim: int,
    concat_dim: int,
    mesh_axes: Sequence[str],
    group_size: int,
) -> Tensor:
    """Chunk ``j`` of ``split_dim`` goes to member ``j``; received chunks are concatenated along
    ``concat_dim`` in sender order."""
    y = _to_groups(mesh, x, mesh_axes)  # [r, g_src, *local]
    r, g = y.shape[:2]
    local = list(y.shape[2:])
    if local[split_dim] % g:
        raise ArgumentError(
            f"all_to_all: split dim {split_dim} of local shape {tuple(local)} is not divisible "
            f"by the group size {g}."
        )
    s = split_dim
    split = y.reshape(r, g, *local[:s], g, local[s] // g, *local[s + 1 :])

    def pos(d: int) -> int:  # where local dim d sits in `split`
        return 2 + d if d < s else 3 + d

    order = [0, 2 + s]  # rest, receiver
    for d in range(len(local)):
        if d == concat_dim:
            order.append(1)  # the sender dim, just before the concat dim: major in the concat
        order.append(pos(d))
    out_local = list(local)
    out_local[s] = local[s] // g
    out_local[concat_dim] = out_local[concat_dim] * g
    out = split.permute(order).reshape(r, g, *out_local)
    return _from_groups(mesh, out, mesh_axes)


def collective_permute(
    mesh: Mesh, x: Tensor, pairs: Sequence[int], mesh_axes: Sequence[str]
) -> Tensor:
    """Device ``pairs[2k]`` sends to ``pairs[2k + 1]`` (device ids); non-receivers get zeros."""
    if len(pairs) % 2:
        raise ArgumentError(f"collective_permute pairs must be [src, dst, ...]; got {list(pairs)}.")
    srcs = [mesh.position(int(d)) for d in pairs[0::2]]
    dsts = [mesh.position(int(d)) for d in pairs[1::2]]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ArgumentError(
            f"collective_permute pairs {list(pairs)}: a device may send to one device and "
            f"receive from one device only."
        )
    source = torch.full((mesh.size,), -1, dtype=torch.int64)
    source[torch.tensor(dsts, dtype=torch.int64)] = torch.tensor(srcs, dtype=torch.int64)
    source = source.to(x.device)
    moved = x.index_select(0, source.clamp(min=0))  # a new tensor: zeroing rows in place is safe
    missing = (source < 0).nonzero().flatten()
    if missing.numel():  # only the rows that receive nothing (a full permutation has none)
        moved.index_fill_(0, missing, 0)
    return moved


def _coordinate(mesh: Mesh, mesh_axes: Sequence[str]) -> np.ndarray:
    """Each mesh position's row-major coordinate along ``mesh_axes`` (an int array ``[n]``)."""
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
    out = np.zeros(mesh.size, dtype=np.int64)
    for a in mesh_axes:
        out = out * mesh.axis_size(a) + coords[mesh.axis_index(a)]
    return out


def axis_index(mesh: Mesh, like: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    """``[n]`` int64: each device's row-major coordinate along ``mesh_axes``."""
    return torch.from_numpy(_coordinate(mesh, mesh_axes)).to(like.device)


def shard_slice(
    mesh: Mesh, x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Each device keeps chunk ``axis_index(mesh_axes)`` of ``dim`` (zero-padded to a multiple of
    ``group_size`` first)."""
    g = mesh.axes_size(mesh_axes)
    local = list(x.shape[1:])
    chunk = ceil_div(local[dim], g)
    if chunk * g != local[dim]:
        pad = [0, 0] * (len(local) - dim - 1) + [0, chunk * g - local[dim]]
        x = torch.nn.functional.pad(x, pad)
    split = x.reshape(mesh.size, *local[:dim], g, chunk, *local[dim + 1 :]).movedim(1 + dim, 1)
    index = torch.from_numpy(_coordinate(mesh, mesh_axes)).to(x.device)
    return split[torch.arange(mesh.size, device=x.device), index]


def all_gather_bucket(
    mesh: Mesh, xs: Sequence[Tensor], dims: Sequence[int], mesh_axes: Sequence[str], gs: int
) -> list[Tensor]:
    """A bucket of all_gathers: each member exactly as :func:`all_gather` (no flat buffer is
    needed in one process; the values are the same either way)."""
    return [all_gather(mesh, x, d, mesh_axes, gs) for x, d in zip(xs, dims, strict=True)]


def all_reduce_bucket(
    mesh: Mesh, xs: Sequence[Tensor], reduce_op: str, mesh_axes: Sequence[str], gs: int
) -> list[Tensor]:
    """A bucket of all_reduces, each member as :func:`all_reduce`."""
    return [all_reduce(mesh, x, reduce_op, mesh_axes, gs) for x in xs]


def reduce_scatter_bucket(
    mesh: Mesh,
    xs: Sequence[Tensor],
    dims: Sequence[int],
    reduce_op: str,
    mesh_axes: Sequence[str],
    gs: int,
) -> list[Tensor]:
    """A bucket of reduce_scatters, each member as :func:`reduce_scatter`."""
    return [
        reduce_scatter(mesh, x, d, reduce_op, mesh_axes, gs) for x, d in zip(xs, dims, strict=True)
    ]


STACKED_IMPLS: dict[Any, Callable[..., Tensor]] = {
    torch.ops.partita.all_gather.default: all_gather,
    torch.ops.partita.all_reduce.default: all_reduce,
    torch.ops.partita.reduce_scatter.default: reduce_scatter,
    torch.ops.partita.all_to_all.default: all_to_all,
    torch.ops.partita.collective_permute.default: collective_permute,
    torch.ops.partita.axis_index.default: axis_index,
    torch.ops.partita.shard_slice.default: shard_slice,
}

#: The fused ops of ``partita.ir.buckets`` (results are lists, one per member).
STACKED_BUCKET_IMPLS: dict[Any, Callable[..., list[Tensor]]] = {
    torch.ops.partita.all_gather_bucket.default: all_gather_bucket,
    torch.ops.partita.all_reduce_bucket.default: all_reduce_bucket,
    torch.ops.partita.reduce_scatter_bucket.default: reduce_scatter_bucket,
}
