"""The fused (bucketed) mesh ops: several collectives of one kind in one call on a flat buffer.

``partita.partition.bucket`` replaces independent collectives of the same kind, mesh axes,
reduce op and dtype by one of these three ops; each takes a *list* of local tensors and returns
the list of results, exactly what the single ops (``partita.ir.collectives``) would return one by
one. The executors move the whole list as one flat buffer: one ``torch.distributed`` call on
real processes (``runtime.distributed``), which is what makes a bucket cheaper than its
members (one latency instead of one per value).

=======================  ==================================================================
op                       schema
=======================  ==================================================================
all_gather_bucket        ``(Tensor[] xs, int[] dims, str[] mesh_axes, int group_size)
                         -> Tensor[]``
all_reduce_bucket        ``(Tensor[] xs, str reduce_op, str[] mesh_axes, int group_size)
                         -> Tensor[]``
reduce_scatter_bucket    ``(Tensor[] xs, int[] dims, str reduce_op, str[] mesh_axes,
                         int group_size) -> Tensor[]``
=======================  ==================================================================

Per-device bytes of a bucket are the sum of its members' bytes (the flat buffer holds each
member once); the Plan keeps one record per member so bytes stay attributed to values.

As in ``partita.ir.collectives``, the eager implementations stand for one device of a mesh on which
every device holds the same values. This module never communicates and does not decide what to
fuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from partita.ir import collectives

__all__ = [
    "BUCKET_OF",
    "BUCKET_OPS",
    "all_gather_bucket",
    "all_reduce_bucket",
    "reduce_scatter_bucket",
]

ops = torch.ops.partita


@torch.library.custom_op(
    "partita::all_gather_bucket",
    mutates_args=(),
    schema="(Tensor[] xs, int[] dims, str[] mesh_axes, int group_size) -> Tensor[]",
)
def _all_gather_bucket(
    xs: Sequence[Tensor], dims: Sequence[int], mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    return [
        collectives.all_gather(x, d, mesh_axes, group_size) for x, d in zip(xs, dims, strict=True)
    ]


@_all_gather_bucket.register_fake
def _(
    xs: Sequence[Tensor], dims: Sequence[int], mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    out = []
    for x, d in zip(xs, dims, strict=True):
        shape = list(x.shape)
        shape[d] *= group_size
        out.append(x.new_empty(shape))
    return out


@torch.library.custom_op(
    "partita::all_reduce_bucket",
    mutates_args=(),
    schema="(Tensor[] xs, str reduce_op, str[] mesh_axes, int group_size) -> Tensor[]",
)
def _all_reduce_bucket(
    xs: Sequence[Tensor], reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    return [collectives.all_reduce(x, reduce_op, mesh_axes, group_size) for x in xs]


@_all_reduce_bucket.register_fake
def _(
    xs: Sequence[Tensor], reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    return [torch.empty_like(x) for x in xs]


@torch.library.custom_op(
    "partita::reduce_scatter_bucket",
    mutates_args=(),
    schema=(
        "(Tensor[] xs, int[] dims, str reduce_op, str[] mesh_axes, int group_size) -> Tensor[]"
    ),
)
def _reduce_scatter_bucket(
    xs: Sequence[Tensor],
    dims: Sequence[int],
    reduce_op: str,
    mesh_axes: Sequence[str],
    group_size: int,
) -> list[Tensor]:
    return [
        collectives.reduce_scatter(x, d, reduce_op, mesh_axes, group_size)
        for x, d in zip(xs, dims, strict=True)
    ]


@_reduce_scatter_bucket.register_fake
def _(
    xs: Sequence[Tensor],
    dims: Sequence[int],
    reduce_op: str,
    mesh_axes: Sequence[str],
    group_size: int,
) -> list[Tensor]:
    out = []
    for x, d in zip(xs, dims, strict=True):
        shape = list(x.shape)
        shape[d] //= group_size
        out.append(x.new_empty(shape))
    return out


def all_gather_bucket(
    xs: Sequence[Tensor], dims: Sequence[int], mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    """``[all_gather(x, d, mesh_axes, group_size) for x, d in zip(xs, dims)]`` in one call."""
    return ops.all_gather_bucket(list(xs), [int(d) for d in dims], list(mesh_axes), group_size)


def all_reduce_bucket(
    xs: Sequence[Tensor], reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> list[Tensor]:
    """``[all_reduce(x, reduce_op, mesh_axes, group_size) for x in xs]`` in one call."""
    return ops.all_reduce_bucket(list(xs), reduce_op, list(mesh_axes), group_size)


def reduce_scatter_bucket(
    xs: Sequence[Tensor],
    dims: Sequence[int],
    reduce_op: str,
    mesh_axes: Sequence[str],
    group_size: int,
) -> list[Tensor]:
    """``[reduce_scatter(x, d, reduce_op, ...) for x, d in zip(xs, dims)]`` in one call."""
    return ops.reduce_scatter_bucket(
        list(xs), [int(d) for d in dims], reduce_op, list(mesh_axes), group_size
    )


#: The fused ops.
BUCKET_OPS = (
    ops.all_gather_bucket.default,
    ops.all_reduce_bucket.default,
    ops.reduce_scatter_bucket.default,
)

#: The fused op of each single collective that can be bucketed.
BUCKET_OF = {
    ops.all_gather.default: ops.all_gather_bucket.default,
    ops.all_reduce.default: ops.all_reduce_bucket.default,
    ops.reduce_scatter.default: ops.reduce_scatter_bucket.default,
}
