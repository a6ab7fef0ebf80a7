"""Selections through collective_permutes on the LocalMesh: read rows where they were sent from.

The partitioner re-aligns a slice that crosses device boundaries (``q|k|v`` cut out of a
column-parallel fused projection, and its gradient on the way back) as: each device takes a
range of a value, ``collective_permute`` sends it to the device that needs it, the received
pieces are ``cat`` with the local one, and each device selects its range of the cat at a
per-device index (``runtime.device_index``). On the simulated mesh every device's data is in
this process, so such a selection can read each of its rows from the value the rows were taken
from, on the device that sent them (:func:`route_permutes`): the permutes, the takes that only
feed them and the cat do not run. At run time (:meth:`RoutedTake.run`):

* every device reads one range of one source, at an address that is an affine function of the
  device's mesh coordinates (the fused projection's output laid out as the global matmul's
  result, so ``q`` of device ``m`` starts ``64 m`` columns further): a strided view of that
  source, no copy;
* otherwise each device's runs are copied once into one new stack (rows from a device that
  received nothing are zeros, as the permute gives): one strided copy for all devices when
  the runs form a regular pattern (``runtime.block_copy``: the q|k|v gradients' way back),
  else one per device and run.

The result equals the per-device program's, device by device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, fx

from partita.errors import IndexRangeError
from partita.runtime.block_copy import copy_at_once, unravel
from partita.runtime.device_index import DeviceTake, take_inputs
from partita.values.mesh import Mesh

__all__ = ["Piece", "RoutedTake", "route_permutes"]

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)
#: ``(source, sender, source start, destination start, length)``; source -1: zeros.
Run = tuple[int, int, int, int, int]

_PERMUTE = torch.ops.partita.collective_permute.default


@dataclass(frozen=True)
class Piece:
    """One piece of what a routed take selects from: on flat device ``p`` it is source
    ``source`` as held on device ``sender[p]`` (``None``: ``p`` itself; ``-1``: zeros),
    rows ``rows[sender[p]]`` of it (``None``: the whole source, in order)."""

    source: int
    sender: tuple[int, ...] | None = None
    rows: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class RoutedTake:
    """A per-device ``index_select`` (``table[p]``: flat device ``p``'s indices into the
    pieces laid end to end) whose pieces were collective_permutes, read from their sources."""

    dim: int
    table: tuple[tuple[int, ...], ...]
    sources: tuple[fx.Node, ...]
    pieces: tuple[Piece, ...]
    from_cat: bool
    starts: None = None  # as DeviceTake's: not one contiguous range per device
    _runs: dict[tuple[int, ...], tuple[tuple[Run, ...], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def run(self, inputs: list[tuple[Tensor, Axes]], mesh: Mesh) -> tuple[Tensor, Axes]:
        """The selection on its sources as held, ``(value, axes)`` (``runtime.local``)."""
        value, axes = inputs[0]
        dim = self.dim % max(value.dim() - sum(axes), 1)
        sizes = tuple(v.shape[sum(a) + dim] for v, a in inputs)
        runs = self._runs.get(sizes)
        if runs is None:
            runs = self._runs[sizes] = self._device_runs(sizes)
        view = _as_view(runs, inputs, dim, len(self.table[0]), mesh)
        if view is not None:
            return view
        index_axes = _varies(list(self.table), mesh)
        return _copy(runs, inputs, dim, len(self.table[0]), index_axes, mesh)

    def _device_runs(self, sizes: tuple[int, ...]) -> tuple[tuple[Run, ...], ...]:
        """Each flat device's rows as runs of consecutive source rows (cached per sizes)."""
        lengths = [sizes[pc.source] if pc.rows is None else len(pc.rows[0]) for pc in self.pieces]
        ends = list(itertools.accumulate(lengths))
        out = []
        for p, row in enumerate(self.table):
            runs: list[list[int]] = []
            for at, g in enumerate(row):
                j = next((j for j, e in enumerate(ends) if g < e), None)
                if j is None or g < 0:
                    raise IndexRangeError(
                        f"LocalMesh: a per-device index_select on device {p} reads row {g} of "
                        f"pieces of {lengths} rows along dim {self.dim}: out of range."
                    )
                piece, offset = self.pieces[j], g - (ends[j] - lengths[j])
                sender = p if piece.sender is None else piece.sender[p]
                if sender < 0:
                    src, r = -1, 0
                else:
                    src = piece.source
                    r = offset if piece.rows is None else piece.rows[sender][offset]
                last = runs[-1] if runs else None
                if (
                    last
                    and last[0] == src
                    and last[1] == sender
                    and (src < 0 or r == last[2] + last[4])
                ):
                    last[4] += 1
                else:
                    runs.append([src, sender, r, at, 1])
            out.append(tuple((a, b, c, d, e) for a, b, c, d, e in runs))
        return tuple(out)


def _held(value: Tensor, axes: Axes, flat: int, mesh: Mesh) -> Tensor:
    """Device ``flat``'s local value of ``(value, axes)`` (a view)."""
    coords = unravel(flat, mesh.shape)
    return value[tuple(c for c, v in zip(coords, axes, strict=True) if v)]


def _varies(keys: list[object], mesh: Mesh) -> Axes:
    """The mesh axes along which the per-flat-device ``keys`` differ."""
    shape = mesh.shape
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return tuple(
        any(keys[p] != keys[p - strides[i]] for p in range(len(keys)) if unravel(p, shape)[i])
        for i in range(len(shape))
    )


def _as_view(
    runs: tuple[tuple[Run, ...], ...],
    inputs: list[tuple[Tensor, Axes]],
    dim: int,
    length: int,
    mesh: Mesh,
) -> tuple[Tensor, Axes] | None:
    """One range of one source per device at an affine address: a strided view, else None."""
    if any(len(r) != 1 for r in runs) or len({r[0][0] for r in runs}) != 1 or runs[0][0][0] < 0:
        return None
    value, axes = inputs[runs[0][0][0]]
    lead = sum(axes)
    lead_strides = [value.stride(i) for i in range(lead)]
    row_stride = value.stride(lead + dim)

    def address(p: int) -> int:
        _, sender, start, _, _ = runs[p][0]
        coords = unravel(sender, mesh.shape)
        held = [c for c, v in zip(coords, axes, strict=True) if v]
        return sum(c * s for c, s in zip(held, lead_strides, strict=True)) + start * row_stride

    addresses = [address(p) for p in range(mesh.size)]
    base = addresses[0]
    shape = mesh.shape
    steps = [
        addresses[math.prod(shape[i + 1 :])] - base if shape[i] > 1 else 0
        for i in range(len(shape))
    ]
    if any(s < 0 for s in steps):
        return None
    for p in range(mesh.size):
        coords = unravel(p, shape)
        if addresses[p] != base + sum(c * s for c, s in zip(coords, steps, strict=True)):
            return None
    out_axes = tuple(s != 0 for s in steps)
    local = list(value.shape[lead:])
    local[dim] = length
    size = [shape[i] for i in range(len(shape)) if out_axes[i]] + local
    stride = [s for s in steps if s != 0] + list(value.stride()[lead:])
    return value.as_strided(size, stride, value.storage_offset() + base), out_axes


def _copy(
    runs: tuple[tuple[Run, ...], ...],
    inputs: list[tuple[Tensor, Axes]],
    dim: int,
    length: int,
    index_axes: Axes,
    mesh: Mesh,
) -> tuple[Tensor, Axes]:
    """Each distinct device's runs copied into one new stack: the output written once."""

    def key(p: int) -> tuple[object, ...]:
        return tuple(
            (k, () if k < 0 else _held_coords(s, inputs[k][1], mesh), *rest)
            for k, s, *rest in runs[p]
        )

    out_axes = _varies([key(p) for p in range(mesh.size)], mesh)
    lead = [mesh.shape[i] for i, v in enumerate(out_axes) if v]
    first = next((value, axes) for value, axes in inputs)
    local = list(first[0].shape[sum(first[1]) :])
    local[dim] = length
    out = _global_layout(first[0], out_axes, index_axes, local, dim, mesh)
    strides = [math.prod(mesh.shape[i + 1 :]) for i in range(mesh.ndim)]
    if copy_at_once(out, out_axes, index_axes, runs, inputs, dim, mesh):
        return out, out_axes
    for pos in itertools.product(*(range(s) for s in lead)):
        it = iter(pos)
        coords = [next(it) if v else 0 for v in out_axes]
        p = sum(c * s for c, s in zip(coords, strides, strict=True))
        dst = out[pos]
        for k, sender, src, at, n in runs[p]:
            if k < 0:
                dst.narrow(dim, at, n).zero_()
            else:
                x = _held(*inputs[k], sender, mesh)
                dst.narrow(dim, at, n).copy_(x.narrow(dim, src, n))
    return out, out_axes


def _global_layout(
    like: Tensor, out_axes: Axes, index_axes: Axes, local: list[int], dim: int, mesh: Mesh
) -> Tensor:
    """An empty ``[*lead, *local]`` (``lead``: the ``out_axes`` dims) laid out as the global
    value would be: the mesh dims the index varies along just outside ``dim`` (the slices of
    a column-parallel value side by side), the others outermost. A matmul summed over those
    axes then reads the slices as one operand, without a copy (``runtime.contraction``)."""
    lead = [i for i, v in enumerate(out_axes) if v]
    outer = [i for i in lead if not index_axes[i]]
    inner = [i for i in lead if index_axes[i]]
    # memory order of the result's dims (lead dims numbered by position in ``lead``)
    pos = {a: j for j, a in enumerate(lead)}
    k = len(lead)
    memory = [
        *(pos[a] for a in outer),
        *(k + d for d in range(dim)),
        *(pos[a] for a in inner),
        *(k + d for d in range(dim, len(local))),
    ]
    sizes = [*(mesh.shape[a] for a in lead), *local]
    out = like.new_empty([sizes[d] for d in memory])
    return out.permute(*(memory.index(d) for d in range(len(sizes))))


def _held_coords(flat: int, axes: Axes, mesh: Mesh) -> tuple[int, ...]:
    coords = unravel(flat, mesh.shape)
    return tuple(c for c, v in zip(coords, axes, strict=True) if v)


def _rows(take: DeviceTake, mesh: Mesh) -> tuple[tuple[int, ...], ...]:
    """A DeviceTake's index on every flat device."""
    rows = []
    for p in range(mesh.size):
        coords = unravel(p, mesh.shape)
        rows.append(
            tuple(
                take.table[tuple(c for c, v in zip(coords, take.axes, strict=True) if v)].tolist()
            )
        )
    return tuple(rows)


def route_permutes(
    mesh: Mesh, takes: dict[fx.Node, DeviceTake | RoutedTake], skipped: set[fx.Node]
) -> None:
    """Replace in ``takes`` each take one of whose pieces is a ``collective_permute`` read by
    nothing else by a :class:`RoutedTake`; the permutes, and takes read only by them, join
    ``skipped`` (they do not run)."""
    routed: set[fx.Node] = set()
    for node, take in list(takes.items()):
        if not isinstance(take, DeviceTake):
            continue
        pieces = take_inputs(node, take)
        reader = cast(fx.Node, node.args[0]) if take.from_cat else node
        if not any(_routable(p, reader) for p in pieces):
            continue
        sources: list[fx.Node] = []
        routed_pieces = []
        for p in pieces:
            if not _routable(p, reader):
                routed_pieces.append(Piece(_index(sources, p)))
                continue
            sender = _senders(p, mesh)
            x = cast(fx.Node, p.args[0])  # the permute's input
            inner = takes.get(x)
            if isinstance(inner, DeviceTake) and not inner.from_cat and inner.dim == take.dim:
                src = cast(fx.Node, x.args[0])
                routed_pieces.append(Piece(_index(sources, src), sender, _rows(inner, mesh)))
            else:
                routed_pieces.append(Piece(_index(sources, x), sender))
            routed.add(p)
        takes[node] = RoutedTake(
            take.dim, _rows(take, mesh), tuple(sources), tuple(routed_pieces), take.from_cat
        )
    skipped |= routed
    read = {s for t in takes.values() if isinstance(t, RoutedTake) for s in t.sources}
    for p in routed:  # a take read only by skipped permutes need not run either
        x = cast(fx.Node, p.args[0])  # the permute's input
        if x in takes and x not in read and all(u in skipped for u in x.users):
            skipped.add(x)
            del takes[x]


def _index(sources: list[fx.Node], node: fx.Node) -> int:
    if node not in sources:
        sources.append(node)
    return sources.index(node)


def _routable(piece: fx.Node, reader: fx.Node) -> bool:
    """A collective_permute read by ``reader`` alone (the skipped cat, or the take itself)."""
    return (
        piece.target is _PERMUTE
        and isinstance(piece.args[0], fx.Node)
        and len(piece.args) >= 2
        and not piece.kwargs
        and set(piece.users) == {reader}
    )


def _senders(permute: fx.Node, mesh: Mesh) -> tuple[int, ...]:
    """Per flat device, the flat device the permute's pairs send to it from (-1: none)."""
    pairs = [int(d) for d in cast("Sequence[int]", permute.args[1])]
    sender = [-1] * mesh.size
    for src, dst in zip(pairs[0::2], pairs[1::2], strict=True):
        sender[mesh.position(dst)] = mesh.position(src)
    return tuple(sender)
