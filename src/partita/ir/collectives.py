"""The mesh ops of the per-device IR, as ``torch.library`` custom ops in namespace ``partita``.

A partitioned program is an ordinary fx ``GraphModule`` of local aten ops plus these seven ops.
Five communicate (:data:`COLLECTIVE_OPS`); two only read the device's mesh coordinate
(``axis_index``, ``shard_slice``). Every op names the mesh axes it runs over; its *group* is
``Mesh.groups(mesh_axes)``: the devices that differ only along those axes, ordered major-first
by ``mesh_axes`` as listed. A member's index in its group is its row-major coordinate along
``mesh_axes`` (what ``axis_index`` returns).

=====================  =====================================================================
op                     schema
=====================  =====================================================================
all_gather             ``(Tensor x, int dim, str[] mesh_axes, int group_size) -> Tensor``
all_reduce             ``(Tensor x, str reduce_op, str[] mesh_axes, int group_size) -> Tensor``
reduce_scatter         ``(Tensor x, int dim, str reduce_op, str[] mesh_axes, int group_size)``
all_to_all             ``(Tensor x, int split_dim, int concat_dim, str[] mesh_axes,
                       int group_size) -> Tensor``
collective_permute     ``(Tensor x, int[] pairs, str[] mesh_axes) -> Tensor``
axis_index             ``(Tensor like, str[] mesh_axes) -> Tensor`` (0-d int64)
shard_slice            ``(Tensor x, int dim, str[] mesh_axes, int group_size) -> Tensor``
=====================  =====================================================================

**Per-device bytes** of a collective are the bytes of the tensor the op is reported with, as
XLA reports the shapes of results: the *output* for all_gather, all_reduce, all_to_all and
collective_permute, and the *input* (the full un-scattered buffer) for reduce_scatter. The
Plan computes them; this module only documents the convention.

The eager implementations here stand for one device of a mesh on which every device holds the
same ``x`` (with ``group_size == 1`` that is exactly a mesh of one device): they give the right
shapes and, for a replicated input, the right values. The real multi-device semantics live in
the executors (``partita.runtime.stacked`` for the simulated mesh). This module does not decide
where the ops go (``partita.partition`` does) and never communicates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from partita.errors import ArgumentError
from partita.values.layout import ceil_div

__all__ = [
    "COLLECTIVE_OPS",
    "MESH_OPS",
    "REDUCE_OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_index",
    "collective_permute",
    "reduce_scatter",
    "shard_slice",
]

#: The reductions all_reduce and reduce_scatter accept.
REDUCE_OPS = ("sum", "max", "min", "avg")


def _check_reduce_op(reduce_op: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise ArgumentError(f"reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}.")


def _with_size(x: Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


# --- all_gather ------------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::all_gather",
    mutates_args=(),
    schema="(Tensor x, int dim, str[] mesh_axes, int group_size) -> Tensor",
)
def _all_gather(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    return torch.cat([x] * group_size, dim=dim)


@_all_gather.register_fake
def _(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    return x.new_empty(_with_size(x, dim, x.shape[dim] * group_size))


# --- all_reduce ------------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::all_reduce",
    mutates_args=(),
    schema="(Tensor x, str reduce_op, str[] mesh_axes, int group_size) -> Tensor",
)
def _all_reduce(x: Tensor, reduce_op: str, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    _check_reduce_op(reduce_op)
    if reduce_op == "sum":
        return x * group_size
    return x.clone()


@_all_reduce.register_fake
def _(x: Tensor, reduce_op: str, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    return torch.empty_like(x)


# --- reduce_scatter --------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::reduce_scatter",
    mutates_args=(),
    schema="(Tensor x, int dim, str reduce_op, str[] mesh_axes, int group_size) -> Tensor",
)
def _reduce_scatter(
    x: Tensor, dim: int, reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    reduced = _all_reduce(x, reduce_op, mesh_axes, group_size)
    return reduced.narrow(dim, 0, x.shape[dim] // group_size).clone()


@_reduce_scatter.register_fake
def _(x: Tensor, dim: int, reduce_op: str, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    torch._check(
        x.shape[dim] % group_size == 0,
        lambda: (
            f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by "
            f"group_size {group_size}; pad it first."
        ),
    )
    return x.new_empty(_with_size(x, dim, x.shape[dim] // group_size))


# --- all_to_all ------------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::all_to_all",
    mutates_args=(),
    schema=("(Tensor x, int split_dim, int concat_dim, str[] mesh_axes, int group_size) -> Tensor"),
)
def _all_to_all(
    x: Tensor, split_dim: int, concat_dim: int, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    chunk = x.narrow(split_dim, 0, x.shape[split_dim] // group_size)
    return torch.cat([chunk] * group_size, dim=concat_dim)


@_all_to_all.register_fake
def _(
    x: Tensor, split_dim: int, concat_dim: int, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    torch._check(
        x.shape[split_dim] % group_size == 0,
        lambda: (
            f"all_to_all: split dim {split_dim} of size {x.shape[split_dim]} is not "
            f"divisible by group_size {group_size}."
        ),
    )
    shape = _with_size(x, split_dim, x.shape[split_dim] // group_size)
    shape[concat_dim] = shape[concat_dim] * group_size
    return x.new_empty(shape)


# --- collective_permute ----------------------------------------------------------------------


@torch.library.custom_op(
    "partita::collective_permute",
    mutates_args=(),
    schema="(Tensor x, int[] pairs, str[] mesh_axes) -> Tensor",
)
def _collective_permute(x: Tensor, pairs: Sequence[int], mesh_axes: Sequence[str]) -> Tensor:
    return x.clone()


@_collective_permute.register_fake
def _(x: Tensor, pairs: Sequence[int], mesh_axes: Sequence[str]) -> Tensor:
    return torch.empty_like(x)


# --- axis_index ------------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::axis_index", mutates_args=(), schema="(Tensor like, str[] mesh_axes) -> Tensor"
)
def _axis_index(like: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=like.device)


@_axis_index.register_fake
def _(like: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


# --- shard_slice -----------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::shard_slice",
    mutates_args=(),
    schema="(Tensor x, int dim, str[] mesh_axes, int group_size) -> Tensor",
)
def _shard_slice(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    size = ceil_div(x.shape[dim], group_size)
    out = x.new_zeros(_with_size(x, dim, size))
    real = min(size, x.shape[dim])
    out.narrow(dim, 0, real).copy_(x.narrow(dim, 0, real))
    return out


@_shard_slice.register_fake
def _(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    return x.new_empty(_with_size(x, dim, ceil_div(x.shape[dim], group_size)))


# --- Python wrappers -------------------------------------------------------------------------


def all_gather(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    """Concatenate the group members' ``x`` along ``dim``, in group order.

    Output ``dim`` size is ``x.size(dim) * group_size``. Per-device bytes: the output's.

    Example: ``all_gather(x, 0, ["y"], 4)`` on ``Mesh(x=2, y=4)`` with local ``x`` of shape
    ``[2, 32]`` gives every device the ``[8, 32]`` concatenation of its y-row's tiles.
    """
    return torch.ops.partita.all_gather(x, dim, list(mesh_axes), group_size)


def all_reduce(x: Tensor, reduce_op: str, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    """Reduce ``x`` over the group (``reduce_op`` in sum, max, min, avg); every member gets it.

    Per-device bytes: the output's (same as the input's).

    Example: ``all_reduce(partial_sum, "sum", ["y"], 4)``.
    """
    return torch.ops.partita.all_reduce(x, reduce_op, list(mesh_axes), group_size)


def reduce_scatter(
    x: Tensor, dim: int, reduce_op: str, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Reduce ``x`` over the group, then member ``i`` keeps chunk ``i`` of ``dim``.

    ``x.size(dim)`` must be divisible by ``group_size`` (the partitioner pads first). Per-device
    bytes: the *input's* (the full buffer being reduced), as XLA reports it.

    Example: ``reduce_scatter(partial [16, 24], 0, "sum", ["y"], 4)`` -> ``[4, 24]``.
    """
    return torch.ops.partita.reduce_scatter(x, dim, reduce_op, list(mesh_axes), group_size)


def all_to_all(
    x: Tensor, split_dim: int, concat_dim: int, mesh_axes: Sequence[str], group_size: int
) -> Tensor:
    """Split ``x`` along ``split_dim`` into ``group_size`` chunks; chunk ``j`` goes to member ``j``;
    each member concatenates what it receives along ``concat_dim`` in member order.

    Per-device bytes: the output's (same as the input's).

    Example: ``all_to_all(x [4, 32], 1, 0, ["y"], 4)`` -> ``[16, 8]`` (rows -> columns).
    """
    return torch.ops.partita.all_to_all(x, split_dim, concat_dim, list(mesh_axes), group_size)


def collective_permute(x: Tensor, pairs: Sequence[int], mesh_axes: Sequence[str]) -> Tensor:
    """Send ``x`` from device ``pairs[2k]`` to device ``pairs[2k + 1]`` (device ids).

    A device sends to at most one device and receives from at most one; a device that receives
    nothing gets zeros. ``mesh_axes`` are the axes the permutation moves along (for the Plan).
    Per-device bytes: the output's.

    Example: ``collective_permute(x, [0, 1, 1, 0], ["y"])`` swaps devices 0 and 1.
    """
    return torch.ops.partita.collective_permute(x, [int(p) for p in pairs], list(mesh_axes))


def axis_index(like: Tensor, mesh_axes: Sequence[str]) -> Tensor:
    """The device's row-major coordinate along ``mesh_axes``, a 0-d int64 tensor.

    Not communication. ``like`` only gives the op a tensor input (and a device).

    Example: on ``Mesh(x=2, y=4)``, ``axis_index(t, ["y", "x"])`` is ``2 * y + x``.
    """
    return torch.ops.partita.axis_index(like, list(mesh_axes))


def shard_slice(x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int) -> Tensor:
    """The local tile of a replicated ``x``: zero-pad ``dim`` to a multiple of ``group_size``
    (ceil padding) and keep chunk number ``axis_index(mesh_axes)``.

    Not communication. Output ``dim`` size is ``ceil(x.size(dim) / group_size)``.

    Example: ``shard_slice(x [10, 6], 0, ["x"], 4)`` -> ``[3, 6]``; device 3 holds one real row.
    """
    return torch.ops.partita.shard_slice(x, dim, list(mesh_axes), group_size)


#: The five ops that communicate.
COLLECTIVE_OPS = (
    torch.ops.partita.all_gather.default,
    torch.ops.partita.all_reduce.default,
    torch.ops.partita.reduce_scatter.default,
    torch.ops.partita.all_to_all.default,
    torch.ops.partita.collective_permute.default,
)

#: Every mesh op: the collectives plus the two that read the device's mesh coordinate.
MESH_OPS = (
    *COLLECTIVE_OPS,
    torch.ops.partita.axis_index.default,
    torch.ops.partita.shard_slice.default,
)
