"""Re-tiling a sharded dim that a slice, narrow or cat moves: collective_permutes of pieces.

``x[:, 4:36]`` of a ``[16, 40]`` value split 4 ways on dim 1 keeps dim 1 split, but the result's
tile ``t`` (8 columns from global column ``4 + 8 t``) no longer starts where ``x``'s tile ``t``
(10 columns from ``10 t``) does: tile 0 needs 2 columns of device 1, tile 3 needs 2 of device 2,
the others hold theirs already. Rather than gathering the dim (or moving it to another dim with
all_to_alls and back), each device receives just the pieces it lacks from the devices that hold
them, as XLA does: here one collective_permute of ``[16, 2]`` (128 B per device).

The same plan serves ``cat`` along a sharded dim (the operands' tiles, side by side, are the
*window* a device cuts pieces from), ``slice_scatter`` (a slice's backward: ``x`` with ``src``
put in place, a cat of three segments) and every step-1 slice (``split``/``chunk`` pieces are
slices; a prefix whose tiles line up needs no piece at all, T11).

Planning (:func:`plan_retile`, pure) lists, for every result tile, the pieces it is made of and
who holds each; the pieces held elsewhere become *messages*, scheduled into *rounds* in which
every device sends at most one and receives at most one (one collective_permute per round, as
wide as the round's widest piece). Lowering (:func:`lower_retile`, the ``retile`` handler) cuts
each device's message out of its window (a per-device index table, read at ``axis_index``),
permutes it, and picks the result tile out of ``[window, received...]`` with a second table.
Padding positions of the result are garbage (index 0), like every tile's padding. Slices of
one value along one dim (the q, k and v of a fused qkv projection) are planned together when
the first is lowered (:func:`plan_retile_many`): their pieces share rounds, and the later
slices only pick their tiles out of what the rounds brought.

This module does not decide shardings (the rules of slice, narrow, cat and slice_scatter make
the dim windowed with this handler; propagation picks the axes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx

from partita.ir import node_meta
from partita.partition import handlers
from partita.partition.handlers import Handler
from partita.partition.lowering_api import LoweringAPI
from partita.partition.neighbours import emit_pairs
from partita.report.explain import op_name
from partita.rules import FactorRule
from partita.rules.common import norm_dim
from partita.rules.handler_names import HandlerName
from partita.values.layout import ceil_div, local_shape

__all__ = [
    "Retile", "Round", "Segment", "plan_retile", "plan_retile_many", "retile_dim", "slice_start",
]  # fmt: skip

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Segment:
    """Result positions ``[out_start, out_start + length)`` are operand ``operand``'s positions
    ``[in_start, in_start + length)`` (global positions along the re-tiled dim)."""

    out_start: int
    operand: int
    in_start: int
    length: int


@dataclass(frozen=True, slots=True)
class Round:
    """One collective_permute: group member ``i`` sends ``width`` positions of its window from
    ``send_from[i]`` to member ``j``, for each ``(i, j)`` in ``pairs``."""

    pairs: tuple[tuple[int, int], ...]
    send_from: tuple[int, ...]
    width: int


@dataclass(frozen=True, slots=True)
class Retile:
    """How each of ``k`` group members builds its tile of every result (``tiles[o]`` positions
    of result ``o``).

    ``window`` is the width of a member's window (its operand tiles side by side); after the
    rounds, member ``p``'s position ``i`` of result ``o`` is position ``takes[o][p][i]`` of the
    window followed by every round's received piece. ``offsets[o]`` is set when that is the
    same plain slice ``[offset, offset + tile)`` on every member (no table needed).
    """

    k: int
    window: int
    rounds: tuple[Round, ...]
    tiles: tuple[int, ...]
    takes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[int | None, ...]


def plan_retile(k: int, sizes: list[int], segments: list[Segment], n_out: int) -> Retile:
    """The pieces and rounds that re-tile ``k``-way tiles of operands of ``sizes`` into ``k``
    tiles of the ``n_out`` result positions ``segments`` describe (:func:`plan_retile_many`
    with one result).

    Example (the ``a[:, 4:36]`` case above):
        >>> r = plan_retile(4, [40], [Segment(0, 0, 4, 32)], 32)
        >>> [(rd.pairs, rd.width) for rd in r.rounds]
        [(((1, 0), (2, 3)), 2)]
    """
    return plan_retile_many(k, sizes, [(segments, n_out)])


def plan_retile_many(k: int, sizes: list[int], outputs: list[tuple[list[Segment], int]]) -> Retile:
    """As :func:`plan_retile` for several results cut from the same operands (the q, k and v
    slices of one qkv projection): their pieces share rounds, so a member that sends a piece
    of q and one of k may send both in one round each instead of one round per result."""
    tiles = [ceil_div(n, k) for n in sizes]
    base = [sum(tiles[:i]) for i in range(len(tiles))]
    window = sum(tiles)
    out_tiles = [ceil_div(n_out, k) for _, n_out in outputs]
    # (result, receiver, result position, length, sender, window position) per piece
    pieces: list[tuple[int, int, int, int, int, int]] = []
    for o, (segments, n_out) in enumerate(outputs):
        tile = out_tiles[o]
        for t in range(k):
            lo, hi = t * tile, min((t + 1) * tile, n_out)
            for seg in segments:
                pos, end = max(lo, seg.out_start), min(hi, seg.out_start + seg.length)
                size = tiles[seg.operand]
                while pos < end:
                    g = seg.in_start + pos - seg.out_start  # the operand's global position
                    j = g // size
                    stop = min(end, pos + (j + 1) * size - g)
                    w = base[seg.operand] + g - j * size
                    pieces.append((o, t, pos - lo, stop - pos, j, w))
                    pos = stop
    messages = sorted((p for p in pieces if p[1] != p[4]), key=lambda p: (-p[3], p[1], p[0], p[2]))
    sends: list[dict[int, tuple[int, int, int, int, int]]] = []  # round -> sender -> piece
    busy_in: list[set[int]] = []
    for o, t, at, n, j, w in messages:
        r = 0
        while r < len(sends) and (j in sends[r] or t in busy_in[r]):
            r += 1
        if r == len(sends):
            sends.append({})
            busy_in.append(set())
        sends[r][j] = (o, t, at, n, w)
        busy_in[r].add(t)
    # None: a padding position
    takes: list[list[list[int | None]]] = [[[None] * n for _ in range(k)] for n in out_tiles]
    for o, t, at, n, j, w in pieces:
        if t == j:
            takes[o][t][at : at + n] = range(w, w + n)
    rounds: list[Round] = []
    start = window  # where the next round's piece lands in [window, received...]
    for moves in sends:
        width = max(m[3] for m in moves.values())
        send_from = [0] * k
        for j, (o, t, at, n, w) in moves.items():
            send_from[j] = min(w, window - width)  # a piece near the window's end: send earlier
            first = start + w - send_from[j]
            takes[o][t][at : at + n] = range(first, first + n)
        pairs = tuple(sorted(((j, m[1]) for j, m in moves.items()), key=lambda p: p[1]))
        rounds.append(Round(pairs, tuple(send_from), width))
        start += width
    offsets: list[int | None] = []
    for take, tile in zip(takes, out_tiles, strict=True):
        # One plain slice does when every member's real positions are the same run (padding
        # positions may read anything in bounds).
        offset = next((row[0] for row in take if row and row[0] is not None), 0)
        uniform = offset + tile <= start and all(
            v is None or v == offset + i for row in take for i, v in enumerate(row)
        )
        offsets.append(offset if uniform else None)
    tables = tuple(tuple(tuple(0 if v is None else v for v in row) for row in t) for t in takes)
    return Retile(k, window, tuple(rounds), tuple(out_tiles), tables, tuple(offsets))


# --- the ``retile`` handler: slice / narrow / narrow_copy / cat along a sharded dim -------------


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def retile_dim(node: fx.Node) -> int:
    """The dim a slice, cat or slice_scatter node re-tiles."""
    i = 2 if str(node.target).startswith("aten.slice_scatter") else 1
    return norm_dim(_arg(node, i, "dim", 0), len(node.meta["val"].shape))


def slice_start(node: fx.Node, i: int, n: int) -> int:
    """The start (argument ``i``) of a slice of a dim of ``n`` positions, clamped as torch
    does."""
    start = _arg(node, i, "start", 0)
    start = 0 if start is None else int(start)
    return min(max(start + n if start < 0 else start, 0), n)


def _segments(low: LoweringAPI, node: fx.Node, dim: int) -> tuple[list[int], list[Segment]]:
    """The operands' sizes along ``dim`` and where the result's positions come from."""
    n_out = int(node.meta["val"].shape[dim])
    target = str(node.target)
    if target.startswith("aten.cat"):
        sizes, segments, at = [], [], 0
        for i, operand in enumerate(low.operand_nodes(node)):
            val = operand.meta["val"]
            n = int(val.shape[dim]) if val.ndim == len(node.meta["val"].shape) else 0
            sizes.append(n)
            segments.append(Segment(at, i, 0, n))
            at += n
        return sizes, segments
    if target.startswith("aten.slice_scatter"):
        # x with src written at [s, s + m): x's own positions stay where they are
        m = int(cast(fx.Node, node.args[1]).meta["val"].shape[dim])  # slice_scatter(x, src, ...)
        s = slice_start(node, 3, n_out)
        parts = [Segment(0, 0, 0, s), Segment(s, 1, 0, m), Segment(s + m, 0, s + m, n_out - s - m)]
        return [n_out, m], [p for p in parts if p.length]
    n = int(cast(fx.Node, node.args[0]).meta["val"].shape[dim])
    return [n], [Segment(0, 0, slice_start(node, 2, n), n_out)]


def _applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    (res,) = low.result_shardings(rule, assign)
    return res is not None and bool(res.dim_axes[retile_dim(node)])


def _table(low: LoweringAPI, pos: fx.Node, rows: Any) -> fx.Node:
    """This member's row of ``rows`` (indexed by its position in the group) as int64."""
    values = low.call(torch.Tensor.new_tensor, pos, [])
    # The rows are set after the node is made: fx walks every leaf of a new node's arguments
    # in Python to warn about raw SymInts (milliseconds for a table of thousands of ints, a
    # tenth of partitioning a GPT); the rows are plain ints computed by plan_retile.
    values.args = (pos, rows)
    row = low.call(aten.index_select.default, values, 0, pos)
    return low.call(aten.reshape.default, row, [-1])


_SLICES = ("aten.narrow.default", "aten.narrow_copy.default", "aten.slice.Tensor")


@dataclass(frozen=True, slots=True)
class _Planned:
    """A sibling slice whose pieces an earlier sibling's rounds brought: pick its tile."""

    whole: fx.Node
    pos: fx.Node
    plan: Retile
    index: int


#: Per Lowering: sibling slice node -> its already-received pieces.
_PLANNED: weakref.WeakKeyDictionary[Any, dict[fx.Node, _Planned]] = weakref.WeakKeyDictionary()


def _siblings(low: LoweringAPI, node: fx.Node, dim: int, axes: tuple[str, ...]) -> list[fx.Node]:
    """``node`` and the later slices of the same value along the same dim that need the same
    operand sharding and split their result the same way (q, k and v of one qkv output)."""
    if str(node.target) not in _SLICES:
        return [node]
    rule = node_meta.rule(node)
    assert rule is not None  # a retiled slice has its rule
    assign = low.representable(node.target, rule, node_meta.factor_axes(node))
    factors = rule.operands[0]
    assert factors is not None  # a slice's input is a tensor
    want = low.dims_of(factors, assign)
    out = [node]
    for user in cast(fx.Node, node.args[0]).users:
        if user is node or str(user.target) not in _SLICES or (user, None) in low.values:
            continue
        r = node_meta.rule(user)
        if r is None or r.handler != HandlerName.RETILE.value or retile_dim(user) != dim:
            continue
        a = low.representable(user.target, r, node_meta.factor_axes(user))
        (res,) = low.result_shardings(r, a)
        factors = r.operands[0]  # a slice's input is a tensor
        if res is not None and factors is not None and res.dim_axes[dim] == axes:
            if low.dims_of(factors, a) == want:
                out.append(user)
    return out


def _pick(low: LoweringAPI, dim: int, planned: _Planned) -> fx.Node:
    plan, o = planned.plan, planned.index
    offset, tile = plan.offsets[o], plan.tiles[o]
    if offset is not None:
        return low.call(aten.slice.Tensor, planned.whole, dim, offset, offset + tile)
    take = _table(low, planned.pos, [list(r) for r in plan.takes[o]])
    return low.call(aten.index_select.default, planned.whole, dim, take)


def lower_retile(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """Cut, permute and pick: the result tile of a slice or cat along a sharded dim (and those
    of its sibling slices, whose lowering later only picks)."""
    dim = retile_dim(node)
    planned = _PLANNED.setdefault(low, {})
    if node in planned:
        return _pick(low, dim, planned.pop(node))
    (res,) = low.result_shardings(rule, assign)
    assert res is not None
    axes = res.dim_axes[dim]
    operands = low.operand_nodes(node)
    locals_ = low.localize_operands(node, rule, assign)
    siblings = _siblings(low, node, dim, axes)
    outputs = [_segments(low, s, dim) for s in siblings]
    sizes = outputs[0][0]
    shapes = [int(s.meta["val"].shape[dim]) for s in siblings]
    plan = plan_retile_many(
        low.mesh.axes_size(axes),
        sizes,
        [(seg, n) for (_, seg), n in zip(outputs, shapes, strict=True)],
    )
    kept = [x for x, n in zip(locals_, sizes, strict=True) if n]
    window = kept[0] if len(kept) == 1 else low.call(aten.cat.default, kept, dim)
    pos = low.call(torch.ops.partita.axis_index.default, window, list(axes))
    pos = low.call(aten.reshape.default, pos, [1])
    parts = [window]
    first = operands[0].meta["val"]
    shape = list(local_shape(low.value(operands[0]).sharding, tuple(first.shape)))
    names = ", ".join(f"%{s.name}" for s in siblings)
    for i, rd in enumerate(plan.rounds):
        index = low.call(aten.arange.default, rd.width, dtype=torch.int64)
        index = low.call(aten.add.Tensor, index, _table(low, pos, list(rd.send_from)))
        piece = low.call(aten.index_select.default, window, dim, index)
        shape[dim] = rd.width
        reason = (
            f"{op_name(node.target)} ({names}) re-tiles dim {dim} (split over "
            f"{','.join(axes)}): each device receives the {rd.width} positions of its new "
            f"tile held by another, round {i + 1} of {len(plan.rounds)}"
        )
        parts.append(emit_pairs(low, node, piece, axes, list(rd.pairs), list(shape), first.dtype,
                                reason, value=operands[0].name))  # fmt: skip
    whole = parts[0] if len(parts) == 1 else low.call(aten.cat.default, parts, dim)
    for o, sibling in enumerate(siblings[1:], 1):
        planned[sibling] = _Planned(whole, pos, plan, o)
    return _pick(low, dim, _Planned(whole, pos, plan, 0))


handlers.register(Handler(HandlerName.RETILE.value, _applies, lower_retile))
