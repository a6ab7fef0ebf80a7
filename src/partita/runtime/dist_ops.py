"""The communicating mesh ops on this rank's local tensors, each split at its wait.

Every op here is a *generator*: it prepares its buffers, launches one ``torch.distributed``
call with ``async_op=True`` and yields; resumed, it waits for that call and finishes the result
(reordering chunks from the torch group's member order to partita's). :func:`run` drives one to
the end at once (a synchronous collective); the overlap schedule (``runtime.overlap``) resumes it
later, so that local compute runs while the bytes move. An op whose group is this device alone
returns without yielding.

The chunk orders are those of ``runtime.distributed`` (its module doc); the fused ``*_bucket``
ops (``partita.ir.buckets``) move all their values as one flat buffer. Failures become
:class:`~partita.errors.DistributedError` through ``runtime.comm.call_collective``, at launch and
at wait. This module knows no graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from partita.runtime.comm import (
    ALL_GATHER,
    REDUCE_SCATTER,
    Group,
    call_collective,
    check_divisible,
    finish_avg,
    torch_reduce_op,
)
from partita.runtime.stacked import reduce_over

__all__ = [
    "InFlight",
    "Op",
    "all_gather",
    "all_gather_bucket",
    "all_reduce",
    "all_reduce_bucket",
    "all_to_all",
    "alone",
    "reduce_scatter",
    "reduce_scatter_bucket",
    "run",
]

#: A mesh op in flight: resumed once, it returns its result (``StopIteration.value``).
Op = Generator[None, None, Any]


class InFlight:
    """A launched mesh op (``op`` to resume) or its result already (``value``)."""

    __slots__ = ("op", "value")

    def __init__(self, op: Op | None, value: Any) -> None:
        self.op = op
        self.value = value


def alone(kind: str, x: Any) -> Any:
    """What mesh op ``kind`` returns on a group of one device (a copy, as the simulated mesh
    does; a gather returns its input)."""
    if kind == "all_gather":
        return x
    if kind == "all_gather_bucket":
        return list(x)
    if kind.endswith("_bucket"):
        return [t.clone() for t in x]
    return x.clone()


def run(op: Op) -> Any:
    """Drive ``op`` to the end now: launch, wait, finish."""
    try:
        while True:
            next(op)
    except StopIteration as stop:
        return stop.value


def _launch(
    node: str, kind: str, mesh_axes: Sequence[str], g: Group, fn: Callable[[], Any]
) -> Generator[None, None, None]:
    """Launch ``fn`` (an ``async_op=True`` call), yield, then wait for it."""
    work: list[Any] = []
    call_collective(node, kind, mesh_axes, g, lambda: work.append(fn()))
    yield
    call_collective(node, kind, mesh_axes, g, lambda: work[0].wait())


def _member_order(g: Group, parts: Tensor) -> Tensor:
    """Rows in torch group order -> rows in partita member order."""
    if g.same_order:
        return parts
    return parts[torch.tensor([g.torch_order.index(m) for m in g.members], device=parts.device)]


def _gathered(parts: Tensor, shape: Sequence[int], dim: int) -> Tensor:
    """``[n, numel]`` rows of one value (member order) -> the value concatenated along ``dim``."""
    out = list(shape)
    out[dim] *= parts.shape[0]
    rows = parts.reshape(parts.shape[0], *shape)
    return (rows.movedim(0, dim) if dim else rows).reshape(out)


def all_gather(g: Group, x: Tensor, dim: int, mesh_axes: Sequence[str], node: str) -> Op:
    n = len(g.members)
    flat = x.contiguous().reshape(-1)
    out = flat.new_empty(n * flat.numel())
    yield from _launch(node, "all_gather", mesh_axes, g,
                       lambda: ALL_GATHER(out, flat, group=g.pg, async_op=True))  # fmt: skip
    return _gathered(_member_order(g, out.reshape(n, -1)), x.shape, dim)


def all_gather_bucket(
    g: Group, xs: Sequence[Tensor], dims: Sequence[int], mesh_axes: Sequence[str], node: str
) -> Op:
    n = len(g.members)
    numel = sum(x.numel() for x in xs)
    out = xs[0].new_empty(n * numel)
    # gathered in place, as FSDP2 does: this rank's values go straight into its own slot of
    # the output, so no separate flat input is held while the bytes move
    mine = out.narrow(0, g.torch_order.index(g.members[g.index]) * numel, numel)
    torch.cat([x.reshape(-1) for x in xs], out=mine)
    yield from _launch(node, "all_gather_bucket", mesh_axes, g,
                       lambda: ALL_GATHER(out, mine, group=g.pg, async_op=True))  # fmt: skip
    parts = _member_order(g, out.reshape(n, -1))
    # every value's [n, numel] columns out of the member-major buffer in one kernel (FSDP2's
    # copy-out), each into a buffer of its own so that each is freed at its own last use
    sizes = [x.numel() for x in xs]
    pieces = [parts.new_empty(n, k) for k in sizes]
    torch.split_with_sizes_copy(parts, sizes, dim=1, out=pieces)
    return [_gathered(p, x.shape, d) for p, x, d in zip(pieces, xs, dims, strict=True)]


def all_reduce(
    g: Group, x: Tensor, reduce_op: str, mesh_axes: Sequence[str], node: str, donate: bool = False
) -> Op:
    """``donate``: nothing else reads ``x`` (``runtime.distributed``): reduced in place."""
    out = x.contiguous() if donate else x.contiguous().clone()
    del x  # not held while the bytes move (as in reduce_scatter_bucket)
    yield from _launch(node, "all_reduce", mesh_axes, g,
          lambda: dist.all_reduce(out, op=torch_reduce_op(reduce_op), group=g.pg,
                                  async_op=True))  # fmt: skip
    return finish_avg(out, reduce_op, len(g.members))


def all_reduce_bucket(
    g: Group, xs: Sequence[Tensor], reduce_op: str, mesh_axes: Sequence[str], node: str
) -> Op:
    flat = torch.cat([x.reshape(-1) for x in xs])
    shapes = [x.shape for x in xs]
    del xs  # not held while the bytes move (as in reduce_scatter_bucket)
    yield from _launch(node, "all_reduce_bucket", mesh_axes, g,
          lambda: dist.all_reduce(flat, op=torch_reduce_op(reduce_op), group=g.pg,
                                  async_op=True))  # fmt: skip
    flat = finish_avg(flat, reduce_op, len(g.members))
    pieces = flat.split([math.prod(s) for s in shapes])
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]


def _scatter_rows(g: Group, x: Tensor, dim: int, node: str, kind: str) -> Tensor:
    """``x`` cut along ``dim`` into one chunk per member, rows in torch group order: a view
    ``[n, chunk, *other dims]`` of ``x`` (a copy when the orders differ)."""
    n = len(g.members)
    check_divisible(kind, node, x, dim, n)
    chunks = (x.movedim(dim, 0) if dim else x).unflatten(0, (n, x.shape[dim] // n))
    if not g.same_order:  # torch group rank t receives the chunk of its partita member
        chunks = chunks[torch.tensor(g.to_torch, device=x.device)]
    return chunks


def _scatter_reduced(
    node: str, kind: str, mesh_axes: Sequence[str], g: Group, flat: Tensor, reduce_op: str
) -> Generator[None, None, Tensor]:
    """This member's chunk of ``flat`` (``n`` equal chunks, torch group order) reduced over the
    group. On Gloo (``g.scatter_by_all_to_all``) an all_to_all brings every member's copy of
    this member's chunk here, and they are reduced in torch group order (the ranks', that is
    the devices' order) by the simulated mesh's own reduction (``runtime.stacked.reduce_over``,
    which ``runtime.held`` applies over a group's mesh dims in the same order): the same bits
    as the simulated mesh. Elsewhere the backend's reduce_scatter."""
    n = len(g.members)
    if g.scatter_by_all_to_all:
        recv = torch.empty_like(flat)
        yield from _launch(node, kind, mesh_axes, g,
              lambda: dist.all_to_all_single(recv, flat, group=g.pg, async_op=True))  # fmt: skip
        del flat  # the sent buffer is free once the bytes have moved
        return reduce_over(recv.view(n, -1), [0], reduce_op)
    out = flat.new_empty(flat.numel() // n)
    yield from _launch(node, kind, mesh_axes, g,
          lambda: REDUCE_SCATTER(out, flat, op=torch_reduce_op(reduce_op), group=g.pg,
                                 async_op=True))  # fmt: skip
    return finish_avg(out, reduce_op, n)


def reduce_scatter(
    g: Group, x: Tensor, dim: int, reduce_op: str, mesh_axes: Sequence[str], node: str
) -> Op:
    chunks = _scatter_rows(g, x, dim, node, "reduce_scatter")
    shape = chunks.shape[1:]
    op = _scatter_reduced(
        node, "reduce_scatter", mesh_axes, g, chunks.flatten(0, 1).contiguous().reshape(-1),
        reduce_op,
    )  # fmt: skip
    del x, chunks  # not held while the bytes move (as in reduce_scatter_bucket)
    out = (yield from op).reshape(shape)
    return out.movedim(0, dim).contiguous() if dim else out


def reduce_scatter_bucket(
    g: Group,
    xs: Sequence[Tensor],
    dims: Sequence[int],
    reduce_op: str,
    mesh_axes: Sequence[str],
    node: str,
) -> Op:
    n = len(g.members)
    chunked = [
        _scatter_rows(g, x, d, node, "reduce_scatter_bucket") for x, d in zip(xs, dims, strict=True)
    ]
    shapes = [c.shape[1:] for c in chunked]
    sizes = [math.prod(s) for s in shapes]
    rows = xs[0].new_empty(n, sum(sizes))  # member-major: member m's chunks in row m
    # each chunk copied once, straight from its value into its place (a chunk cut along
    # another dim than 0 is a strided view: no contiguous copy of it first)
    for c, dest in zip(chunked, rows.split(sizes, dim=1), strict=True):
        dest.view(c.shape).copy_(c)
    op = _scatter_reduced(node, "reduce_scatter_bucket", mesh_axes, g, rows.view(-1), reduce_op)
    # the flat copy is what moves: the inputs (a block's unsharded gradients) are not held
    # while the bytes move, so each is freed at the launch once the program is done with it;
    # the flat buffer itself only by ``op``, which frees it once the bytes have moved
    del xs, chunked, c, dest, rows
    out = yield from op
    return [
        p.reshape(shape).movedim(0, d).contiguous() if d else p.reshape(shape)
        for p, shape, d in zip(out.split(sizes), shapes, dims, strict=True)
    ]


def all_to_all(
    g: Group, x: Tensor, split_dim: int, concat_dim: int, mesh_axes: Sequence[str], node: str
) -> Op:
    n = len(g.members)
    check_divisible("all_to_all", node, x, split_dim, n)
    chunks = list(x.chunk(n, dim=split_dim))  # chunk j goes to partita member j
    send = torch.stack([chunks[j] for j in g.to_torch]).contiguous()
    recv = torch.empty_like(send)
    yield from _launch(node, "all_to_all", mesh_axes, g,
          lambda: dist.all_to_all_single(recv, send, group=g.pg, async_op=True))  # fmt: skip
    received = [recv[g.torch_order.index(m)] for m in g.members]  # in sender order
    return torch.cat(received, dim=concat_dim)
