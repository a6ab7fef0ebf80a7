"""A matmul summed over mesh axes, on the LocalMesh, as one matmul over the joined ``K``.

Under tensor parallelism a row-parallel matmul (and the input gradient of a column-parallel
one) is ``all_reduce(mm(a, w), "sum", group)``: each device multiplies its slice of the
contraction dim, and the all_reduce sums the partial products. Simulated naively that is a
``[devices, M, N]`` stack of partial products and a sum over the group: ``|group|`` times the
output written and read again. But the sum over the group of ``a_g @ w_g`` is
``[a_1 | a_2 | ...] @ [w_1; w_2; ...]``: one matmul over the group's slices side by side along
``K``, the matmul the unsharded program runs. :func:`group_contract` computes it on values as
the LocalMesh holds them (``(value, axes)``, ``runtime.local``); the all_reduce that reads it
then only divides (``avg``) or passes it on (:class:`Summed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partita.mesh import Mesh
from partita.runtime.flat_matmul import broadcast_matmul

__all__ = ["Summed", "group_contract"]

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)


@dataclass(frozen=True)
class Summed:
    """In place of ``axes``: the value is already the sum over the mesh dims ``group`` of
    the per-device values; it varies along ``axes`` (none of the group's)."""

    axes: Axes
    group: frozenset[int]


def group_contract(
    a: Tensor, a_axes: Axes, b: Tensor, b_axes: Axes, group: set[int], mesh: Mesh
) -> tuple[Tensor, Summed] | None:
    """``sum over group of a_g @ b_g`` as one matmul, or None when an operand does not vary
    along every group axis (then the products are not slices of one contraction)."""
    if not group or not all(a_axes[i] and b_axes[i] for i in group):
        return None
    ndim = mesh.ndim
    union = tuple(p or q for p, q in zip(a_axes, b_axes, strict=True))
    rest = [i for i in range(ndim) if union[i] and i not in group]
    joined = sorted(group)
    unit = [i for i in range(ndim) if i not in rest and i not in group]
    size = math.prod(mesh.shape[i] for i in joined)

    def lead(v: Tensor, axes: Axes) -> Tensor:  # [*mesh dims (1 where it does not vary), r, c]
        shape = [mesh.shape[i] if axes[i] else 1 for i in range(ndim)]
        v = v.reshape(*shape, *v.shape[-2:])
        v = v.permute(*rest, *joined, *unit, ndim, ndim + 1)
        return v.reshape(*v.shape[: len(rest)], size, *v.shape[-2:])

    m, k = a.shape[-2:]
    n = b.shape[-1]
    a2 = lead(a, a_axes).movedim(len(rest), -2)  # [*rest, M, group, K]
    a2 = a2.reshape(*a2.shape[: len(rest)], m, size * k)
    b2 = lead(b, b_axes)  # [*rest, group, K, N]
    b2 = b2.reshape(*b2.shape[: len(rest)], size * k, n)
    if rest:
        out = broadcast_matmul(a2, b2, [mesh.shape[i] for i in rest])
    else:
        out = torch.mm(a2, b2)
    return out, Summed(tuple(v and i not in group for i, v in enumerate(union)), frozenset(group))
