"""A matmul summed over mesh axes, on the LocalMesh, as one matmul over the joined ``K``.

Under tensor parallelism a row-parallel matmul (and the input gradient of a column-parallel
one) is ``all_reduce(mm(a, w), "sum", group)``: each device multiplies its slice of the
contraction dim, and the all_reduce sums the partial products. Simulated naively that is a
``[devices, M, N]`` stack of partial products and a sum over the group: ``|group|`` times the
output written and read again. But the sum over the group of ``a_g @ w_g`` is
``[a_1 | a_2 | ...] @ [w_1; w_2; ...]``: one matmul over the group's slices side by side along
``K``, the matmul the unsharded program runs. :func:`group_contract` computes it on values as
the LocalMesh holds them (``(value, axes)``, ``runtime.local``); the all_reduce that reads it
then only divides (``avg``) or passes it on (:class:`Summed`). Where joining the slices
would copy an operand (a weight gradient's output gradient, transposed, summed over the
outer mesh axis), the products of the slices are summed in place instead
(:func:`sum_of_slices`): no copy, one output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, fx

from partita.runtime.flat_matmul import broadcast_matmul
from partita.values.mesh import Mesh

__all__ = ["Summed", "contract", "group_contract"]

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)


@dataclass(frozen=True)
class Summed:
    """In place of ``axes``: the value is already the sum over the mesh dims ``group`` of
    the per-device values; it varies along ``axes`` (none of the group's)."""

    axes: Axes
    group: frozenset[int]


def group_contract(
    a: Tensor,
    a_axes: Axes,
    b: Tensor,
    b_axes: Axes,
    group: set[int],
    mesh: Mesh,
    bias: Tensor | None = None,
) -> tuple[Tensor, Summed] | None:
    """``sum over group of a_g @ b_g`` as one matmul, or None when an operand does not vary
    along every group axis (then the products are not slices of one contraction). ``bias``
    (``[*rest (1 where it does not vary), 1, N]`` over the other axes the operands vary
    along, in mesh order) is added to the sum: as the matmul's addend (``addmm``, as the
    unsharded linear layer adds it) where the sum is one matmul, else after it."""
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
    if len(rest) <= 1 and not _joins(a2):
        # Joining the slices would copy ``a`` (a weight gradient's transposed output
        # gradient): sum one batched matmul per slice into the output instead.
        sizes = [mesh.shape[i] for i in rest]
        out = sum_of_slices(a2.movedim(-2, len(rest)), lead(b, b_axes), sizes)
        if bias is not None:
            out = out + bias
        return out, Summed(
            tuple(v and i not in group for i, v in enumerate(union)), frozenset(group)
        )
    a2 = a2.reshape(*a2.shape[: len(rest)], m, size * k)
    b2 = lead(b, b_axes)  # [*rest, group, K, N]
    b2 = b2.reshape(*b2.shape[: len(rest)], size * k, n)
    if rest:
        out = broadcast_matmul(a2, b2, [mesh.shape[i] for i in rest], bias)
    elif bias is not None and bias.dtype == a2.dtype:
        out = torch.addmm(bias.reshape(bias.shape[-2:]), a2, b2)
    else:
        out = torch.mm(a2, b2) if bias is None else torch.mm(a2, b2) + bias
    return out, Summed(tuple(v and i not in group for i, v in enumerate(union)), frozenset(group))


def _joins(a: Tensor) -> bool:
    """Whether ``[..., M, G, K]`` reshapes to ``[..., M, G * K]`` as a view."""
    g, k = a.shape[-2:]
    return g == 1 or k == 1 or a.stride(-2) == k * a.stride(-1)


def sum_of_slices(a: Tensor, b: Tensor, sizes: list[int]) -> Tensor:
    """``sum over g of a[..., g, :, :] @ b[..., g, :, :]`` for ``a [*Ra, G, M, K]`` and
    ``b [*Rb, G, K, N]`` with at most one leading dim ``Ra``, ``Rb`` (1 or ``sizes[0]``):
    ``[*sizes, M, N]``, one (batched) matmul per slice accumulated in place, no operand
    copied (a broadcast operand is a stride-0 batch)."""
    nr = len(sizes)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out: Tensor | None = None
    for g in range(a.shape[nr]):
        ag, bg = a.select(nr, g), b.select(nr, g)
        if nr:
            ag, bg = ag.expand(sizes[0], m, k), bg.expand(sizes[0], k, n)
            out = torch.bmm(ag, bg) if out is None else out.baddbmm_(ag, bg)
        else:
            out = torch.mm(ag, bg) if out is None else out.addmm_(ag, bg)
    assert out is not None  # G >= 1
    return out


Entry = tuple[Any, Any]  # ``(value, axes)`` as the LocalMesh holds it (``axes`` may be a marker)


def contract(
    mesh: Mesh,
    node: fx.Node,
    env: dict[fx.Node, Entry],
    mesh_axes: Sequence[str],
    all_reduce_user: bool,
    all_reduce: Callable[[Entry, str, set[int]], Entry],
) -> Entry:
    """``mm(a, b)`` or ``addmm(c, a, b)`` read only by a sum over ``mesh_axes``. Over the
    whole mesh, with both operands varying along every axis, the per-device products and
    their sum are one ``mm`` over every device's rows: ``(sum, None)`` (the reduction then
    only cuts it). Read by an all_reduce over part of the mesh along which both vary, one
    ``mm`` per tile of the other axes (:func:`group_contract`). Otherwise the per-device
    products, as a segment would give them. ``addmm``'s ``c`` is summed over the group
    (``all_reduce``, on the value as held: it is a bias, small) and added to the sum."""
    if node.target is torch.ops.aten.addmm.default:
        args = cast("tuple[fx.Node, ...]", node.args)  # addmm(c, a, b): three tensors
        bias: Entry | None = env[args[0]]
        (a, ax), (b, bx) = env[args[1]], env[args[2]]
    else:
        bias = None
        args = cast("tuple[fx.Node, ...]", node.args)  # mm(a, b)
        (a, ax), (b, bx) = env[args[0]], env[args[1]]
    n = mesh.size
    group = {mesh.axis_index(x) for x in mesh_axes}
    if n > 1 and all(ax) and all(bx) and mesh.axes_size(list(mesh_axes)) == n and bias is None:
        m, k = a.shape[-2:]
        rows = a.reshape(n, m, k).permute(1, 0, 2).reshape(m, n * k)
        return torch.mm(rows, b.reshape(n * k, b.shape[-1])), None
    if all_reduce_user:  # over part of the mesh: one matmul per tile of the other axes
        if bias is None:
            summed = group_contract(a, ax, b, bx, group, mesh)
            if summed is not None:
                return summed
        elif group and all(ax[i] and bx[i] for i in group):
            # the per-device biases summed over the group (a bias added once: on one
            # member, zeros on the others), then added as the one matmul's addend
            c, c_axes = all_reduce(bias, "sum", group)
            rest = [i for i in range(mesh.ndim) if (ax[i] or bx[i]) and i not in group]
            if all(i in rest or not v for i, v in enumerate(c_axes)):
                sizes = [mesh.shape[i] for i in rest]
                addend = _padded(c, tuple(c_axes[i] for i in rest), sizes)
                summed = group_contract(a, ax, b, bx, group, mesh, addend)
                assert summed is not None  # both operands vary along the group
                return summed
    union = tuple(p or q for p, q in zip(ax, bx, strict=True))
    out = broadcast_matmul(_full(a, ax, mesh), _full(b, bx, mesh), list(mesh.shape))
    if bias is not None:
        c, c_axes = bias
        union = tuple(p or q for p, q in zip(union, c_axes, strict=True))
        out = out + _padded(c, c_axes, list(mesh.shape))
    return out[tuple(slice(None) if v else 0 for v in union)], union


def _full(v: Tensor, axes: Axes, mesh: Mesh) -> Tensor:
    """``[*mesh dims (1 where it does not vary), r, c]`` of a matrix as held."""
    shape = [s if x else 1 for s, x in zip(mesh.shape, axes, strict=True)]
    return v.reshape(*shape, *v.shape[-2:])


def _padded(c: Tensor, axes: Axes, sizes: list[int]) -> Tensor:
    """An addend as held (local rank 1 or 2; leading dims for ``axes``, of the dims
    ``sizes``) as ``[*sizes (1 where it does not vary), r, c]``, broadcasting against the
    products."""
    local = c.shape[sum(axes) :]
    shape = [s if x else 1 for s, x in zip(sizes, axes, strict=True)]
    return c.reshape(*shape, *[1] * (2 - len(local)), *local)
