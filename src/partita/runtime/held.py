"""Mesh ops on values as the LocalMesh holds them, ``(value, axes)``, without stacking them.

The LocalMesh (``runtime.local``) holds a value once per position of the mesh axes it varies
along: ``value`` is ``[*(mesh.shape[i] for the axes i it varies along), *local]``. An
all_reduce, all_gather or reduce_scatter over a group of mesh axes is then a sum, a
flatten or a split of those leading dims: this module computes them on the value as held,
with no copy to ``[mesh.size, *local]`` and back and no Python work per device. The
results are exactly those of ``runtime.stacked`` on the stacked values (the tests compare
them); the result varies along the input's axes less the group's (all_reduce, all_gather)
or plus them (reduce_scatter). Their results are contiguous, as a collective's buffer is
(ops such as ``_pdist_forward`` need it): a view where the input already is laid out so (FSDP's
dim-0 shards), else a copy. An all_gather of a value that does not vary along some group
axis (its members hold copies) is left to ``runtime.stacked`` (``None`` here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from partita.errors import ArgumentError
from partita.runtime.contraction import Summed
from partita.runtime.stacked import reduce_over
from partita.values.mesh import Mesh

__all__ = ["all_gather_held", "all_reduce_held", "reduce_scatter_held"]

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)


def _held_dim(axes: Sequence[bool], i: int) -> int:
    """Where mesh axis ``i`` sits among the leading dims of a value varying along ``axes``."""
    return sum(bool(a) for a in axes[:i])


def all_reduce_held(
    mesh: Mesh, entry: tuple[Tensor, Any], reduce_op: str, group: set[int]
) -> tuple[Tensor, Axes]:
    """An all_reduce over the mesh dims ``group``: a reduction over the group axes the value
    varies along. Along a group axis it does not vary along, the members hold the same
    value: summing ``k`` of them is ``k`` times it. The result varies along no group axis.
    ``axes`` may be a contraction's marker: :class:`Summed` (already summed over this
    group) or ``None`` (already the sum over the whole mesh)."""
    value, axes = entry
    if isinstance(axes, Summed):
        g = mesh.axes_size([mesh.axis_names[i] for i in group])
        return (value / g if reduce_op == "avg" else value), axes.axes
    if axes is None:
        axes = (False,) * mesh.ndim
        same = 1
        group = set(range(mesh.ndim))
    else:
        same = math.prod(mesh.shape[i] for i in group if not axes[i])
    dims = [_held_dim(axes, i) for i in sorted(group) if axes[i]]
    g = mesh.axes_size([mesh.axis_names[i] for i in group])
    out = reduce_over(value, dims, reduce_op, copies=same, count=g)
    return out, tuple(v and i not in group for i, v in enumerate(axes))


def all_gather_held(
    mesh: Mesh, entry: tuple[Tensor, Axes], dim: int, mesh_axes: Sequence[str]
) -> tuple[Tensor, Axes] | None:
    """Every member gets the group's tiles concatenated along local ``dim``, in member order
    (``mesh_axes`` major first): the group's leading dims moved next to ``dim`` and merged
    into it (a view when they already sit there, as FSDP's dim-0 shards do). ``None`` when
    the value does not vary along every group axis."""
    value, axes = entry
    group = [mesh.axis_index(a) for a in mesh_axes]
    if not isinstance(axes, tuple) or not all(axes[i] for i in group):
        return None
    k = sum(axes)
    local = list(value.shape[k:])
    keep = [_held_dim(axes, i) for i in range(mesh.ndim) if axes[i] and i not in group]
    order = [*keep, *range(k, k + dim), *(_held_dim(axes, i) for i in group)]
    order += range(k + dim, k + len(local))
    local[dim] *= math.prod(mesh.shape[i] for i in group)
    out = value.permute(order).reshape(*(value.shape[d] for d in keep), *local).contiguous()
    return out, tuple(v and i not in group for i, v in enumerate(axes))


def reduce_scatter_held(
    mesh: Mesh,
    entry: tuple[Tensor, Axes | None],
    dim: int,
    reduce_op: str,
    mesh_axes: Sequence[str],
) -> tuple[Tensor, Axes]:
    """Reduce over the group (as :func:`all_reduce_held`), then member ``i`` of each group
    keeps chunk ``i`` of local ``dim``: ``dim`` split into the group's axes and the chunk, the
    group's parts moved to the leading dims (a view of the reduction when ``dim`` is the
    outermost local dim). ``axes`` ``None``: a
    contraction's sum over the whole mesh, only cut."""
    group = [mesh.axis_index(a) for a in mesh_axes]
    g = math.prod(mesh.shape[i] for i in group)
    reduced, raxes = all_reduce_held(mesh, entry, reduce_op, set(group))
    k = sum(raxes)
    local = list(reduced.shape[k:])
    if local[dim] % g:
        raise ArgumentError(
            f"reduce_scatter: dim {dim} of local shape {tuple(local)} is not divisible by the "
            f"group size {g}; pad it first."
        )
    split = reduced.reshape(
        *reduced.shape[:k], *local[:dim], *(mesh.shape[i] for i in group), local[dim] // g,
        *local[dim + 1 :],
    )  # fmt: skip
    out_axes = tuple(raxes[i] or i in group for i in range(mesh.ndim))
    where = {i: _held_dim(raxes, i) for i in range(mesh.ndim) if raxes[i]}
    where.update({i: k + dim + j for j, i in enumerate(group)})
    lead = [where[i] for i in range(mesh.ndim) if out_axes[i]]
    out = split.permute(*lead, *(d for d in range(split.dim()) if d not in lead)).contiguous()
    return out, out_axes
