"""Collectives for shard_map bodies, over named mesh axes, each with its gradient.

Every function here lowers to the mesh ops of :mod:`partita.ir.collectives` (the ops the
partitioner itself emits), so the simulated mesh and ``torch.distributed`` run them unchanged.
Each is a ``torch.autograd.Function`` whose backward is the transposed collective:

==============  ============================  ==============================================
function        forward (mesh op)             gradient
==============  ============================  ==============================================
psum            all_reduce sum                identity (the cotangent is replicated)
pmean           all_reduce sum / n            divided by n
pmax            all_reduce max                to the devices holding the max (ties share)
all_gather      all_gather                    psum_scatter
psum_scatter    reduce_scatter sum            all_gather
all_to_all      all_to_all(split, concat)     all_to_all(concat, split)
ppermute        collective_permute            the inverse permutation
==============  ============================  ==============================================

``axis_name`` is one manual mesh axis or a tuple of them (major first). A collective over an
axis the region is not manual over, or outside any region, is a :class:`ShardMapError`.
Which axes each result varies over follows JAX (:mod:`partita.manual.vma`): psum, pmean and
pmax give invariant results; the others give results varying over ``axis_name``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from partita.capture.source import format_source, user_frame
from partita.errors import ShardMapError
from partita.ir import collectives as mesh_ops
from partita.manual.vma import Region, current_region, pvary, set_vma, vma

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
]

AxisName = str | Sequence[str]


def _axes(axis_name: AxisName, what: str) -> tuple[Region, tuple[str, ...]]:
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    region = current_region()
    where = format_source(user_frame()) or "an unknown line"
    if region is None:
        raise ShardMapError(
            f"partita.{what}(..., {axis_name!r}) at {where} runs outside a shard_map body. "
            f"Collectives over named mesh axes only exist inside per-device code; call it "
            f"from the function you pass to partita.shard_map."
        )
    bad = [a for a in axes if a not in region.manual_axes]
    if bad:
        raise ShardMapError(
            f"partita.{what}(..., {axis_name!r}) at {where} in {region.name} names mesh "
            f"axes {bad} that are not manual there: the region is manual over "
            f"{region.manual_axes} of {region.mesh!r}. Collectives can only run over manual "
            f"axes; add them to shard_map(..., axes=...) or leave the collective to the "
            f"partitioner."
        )
    return region, axes


class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, axes: tuple[str, ...], n: int, op: str) -> Tensor:
        return mesh_ops.all_reduce(x, op, axes, n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.axes, ctx.n, ctx.op = inputs[1:]
        if ctx.op == "max":
            ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        if ctx.op == "sum":
            return grad, None, None, None
        x, out = ctx.saved_tensors
        hit = (x == out).to(grad.dtype)
        count = mesh_ops.all_reduce(hit, "sum", ctx.axes, ctx.n)
        return grad * hit / count, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, axes: tuple[str, ...], n: int) -> Tensor:
        return mesh_ops.all_gather(x, dim, axes, n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.axes, ctx.n = inputs[1:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return mesh_ops.reduce_scatter(grad, ctx.dim, "sum", ctx.axes, ctx.n), None, None, None


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, axes: tuple[str, ...], n: int) -> Tensor:
        return mesh_ops.reduce_scatter(x, dim, "sum", axes, n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim, ctx.axes, ctx.n = inputs[1:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return mesh_ops.all_gather(grad, ctx.dim, ctx.axes, ctx.n), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, split: int, concat: int, axes: tuple[str, ...], n: int) -> Tensor:
        return mesh_ops.all_to_all(x, split, concat, axes, n)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.split, ctx.concat, ctx.axes, ctx.n = inputs[1:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        back = mesh_ops.all_to_all(grad, ctx.concat, ctx.split, ctx.axes, ctx.n)
        return back, None, None, None, None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, pairs: tuple[int, ...], axes: tuple[str, ...]) -> Tensor:
        return mesh_ops.collective_permute(x, pairs, axes)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pairs = inputs[1]
        ctx.inverse = tuple(p for k in range(0, len(pairs), 2) for p in (pairs[k + 1], pairs[k]))
        ctx.axes = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return mesh_ops.collective_permute(grad, ctx.inverse, ctx.axes), None, None


def _reduce(x: Tensor, axis_name: AxisName, op: str, what: str) -> Tensor:
    region, axes = _axes(axis_name, what)
    x = pvary(x, axes)  # an invariant addend counts once per device, as in JAX
    out = _Psum.apply(x, axes, region.mesh.axes_size(axes), op)
    return set_vma(out, vma(x) - set(axes))


def psum(x: Tensor, axis_name: AxisName) -> Tensor:
    """The sum of ``x`` over the devices along ``axis_name``; every device gets it.

    Example: ``psum(x_local.sum(), "data")`` is the global sum of a batch sharded over data.
    """
    return _reduce(x, axis_name, "sum", "psum")


def pmean(x: Tensor, axis_name: AxisName) -> Tensor:
    """The mean of ``x`` over the devices along ``axis_name``."""
    return psum(x, axis_name) / axis_size(axis_name)


def pmax(x: Tensor, axis_name: AxisName) -> Tensor:
    """The elementwise max of ``x`` over the devices along ``axis_name``."""
    return _reduce(x, axis_name, "max", "pmax")


def _varying(x: Tensor, axis_name: AxisName, what: str) -> tuple[Region, tuple[str, ...], Tensor]:
    region, axes = _axes(axis_name, what)
    return region, axes, pvary(x, axes)


def all_gather(x: Tensor, axis_name: AxisName, *, dim: int = 0, tiled: bool = True) -> Tensor:
    """Concatenate the blocks of the devices along ``axis_name`` on ``dim`` (``tiled=False``
    stacks them on a new ``dim`` instead). The result counts as varying over ``axis_name``.

    Example: ``all_gather(w_local, "model", dim=1)`` rebuilds a column-sharded weight.
    """
    region, axes, x = _varying(x, axis_name, "all_gather")
    dim = dim % (x.ndim + (0 if tiled else 1))
    if not tiled:
        x = x.unsqueeze(dim)
    out = _AllGather.apply(x, dim, axes, region.mesh.axes_size(axes))
    return set_vma(out, vma(x))


def psum_scatter(
    x: Tensor, axis_name: AxisName, *, scatter_dim: int = 0, tiled: bool = True
) -> Tensor:
    """Sum ``x`` over ``axis_name``; device ``i`` keeps block ``i`` of ``scatter_dim``
    (``tiled=False``: the dim must have size n and is dropped)."""
    region, axes, x = _varying(x, axis_name, "psum_scatter")
    n = region.mesh.axes_size(axes)
    scatter_dim = scatter_dim % x.ndim
    if x.shape[scatter_dim] % n:
        raise ShardMapError(
            f"partita.psum_scatter over {axes} (size {n}) in {region.name}: dim {scatter_dim} "
            f"of the local shape {tuple(x.shape)} is not divisible by {n}. Pad it first."
        )
    out = set_vma(_PsumScatter.apply(x, scatter_dim, axes, n), vma(x))
    return out if tiled else set_vma(out.squeeze(scatter_dim), vma(x))


def all_to_all(x: Tensor, axis_name: AxisName, split_dim: int, concat_dim: int) -> Tensor:
    """Split ``split_dim`` into n blocks, send block ``j`` to device ``j`` along
    ``axis_name`` and concatenate what arrives on ``concat_dim``."""
    region, axes, x = _varying(x, axis_name, "all_to_all")
    n = region.mesh.axes_size(axes)
    split_dim, concat_dim = split_dim % x.ndim, concat_dim % x.ndim
    if x.shape[split_dim] % n:
        raise ShardMapError(
            f"partita.all_to_all over {axes} (size {n}) in {region.name}: split dim "
            f"{split_dim} of the local shape {tuple(x.shape)} is not divisible by {n}."
        )
    return set_vma(_AllToAll.apply(x, split_dim, concat_dim, axes, n), vma(x))


def ppermute(x: Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Tensor:
    """Send ``x`` from index ``src`` to index ``dst`` along ``axis_name`` for each pair of
    ``perm``; a device nothing is sent to gets zeros.

    Example: a ring shift on n devices: ``ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)])``.
    """
    region, axes, x = _varying(x, axis_name, "ppermute")
    n = region.mesh.axes_size(axes)
    srcs, dsts = [int(s) for s, _ in perm], [int(d) for _, d in perm]
    if (
        len(set(srcs)) != len(srcs)
        or len(set(dsts)) != len(dsts)
        or not all(0 <= i < n for i in srcs + dsts)
    ):
        raise ShardMapError(
            f"partita.ppermute over {axes} (size {n}) in {region.name}: perm {list(perm)} must "
            f"be (source, destination) index pairs in [0, {n}) with no source or destination "
            f"twice."
        )
    pairs = tuple(
        dev
        for group in region.mesh.groups(axes)
        for s, d in zip(srcs, dsts, strict=True)
        for dev in (group[s], group[d])
    )
    return set_vma(_Permute.apply(x, pairs, axes), vma(x))


def axis_index(axis_name: AxisName) -> Tensor:
    """This device's index along ``axis_name`` (row-major over a tuple), a 0-d int64 tensor."""
    region, axes = _axes(axis_name, "axis_index")
    like = region.anchor.detach() if region.anchor is not None else torch.zeros(())
    out = mesh_ops.axis_index(like, axes)
    return set_vma(out, frozenset(axes))


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (a Python int)."""
    region, axes = _axes(axis_name, "axis_size")
    return region.mesh.axes_size(axes)
