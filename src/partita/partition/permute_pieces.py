"""The *piecewise collective_permute* transition of the reshard planner, and its two local ops.

When neither sharding is partial, every dim's size is divisible by its source and target tile
counts, and per dim the source tile and the target tile divide one another, every target tile is
a union of equal *pieces* (per dim ``min(source tile, target tile)``), each held whole by some
source device. The pieces are scheduled into *rounds*: in a round every device sends at most one
piece and receives at most one (one ``collective_permute`` of the piece shape; a device that
already holds a piece sends it to itself). Per round, ``take_piece`` cuts the piece each device
sends out of its source tile (the piece number depends on the device: a table indexed by
``axis_index`` over all mesh axes); after the last round ``place_pieces`` puts each received
piece at its slot of the target tile (again a table indexed by the device's position).

Steps of one run: ``take_piece, collective_permute, ..., take_piece, collective_permute,
place_pieces``. ``take_piece`` reads the *source*: the value the run started from (its first
``take_piece`` saves it); each later ``take_piece`` and the final ``place_pieces`` also save the
piece the previous ``collective_permute`` received. Only the planning loops over devices; the
stacked implementations and the emitted graph are vectorised.

The schedule is a greedy search over devices, pieces and their holders (its cost grows faster
than the device count), so it is planned only on meshes of at most :data:`MAX_DEVICES`
devices; on a larger mesh the planner's collectives (all_to_all, all_gather) move the value,
and lowering costs the same whatever the mesh's size.

For T02 (``[16,32]``, ``P('y','x')`` -> ``P('x','y')`` on ``Mesh(x=2, y=4)``) the pieces are
``[4,8]`` and two rounds suffice: 2 * 32 elements per device instead of 2 * 128.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from partita.values.layout import tile_coords
from partita.values.spec import Sharding

__all__ = [
    "MAX_DEVICES",
    "emit_place",
    "emit_take",
    "plan_pieces",
    "stacked_place",
    "stacked_take",
]

aten = torch.ops.aten

#: The largest mesh the piecewise schedule is searched on (see the module docstring).
MAX_DEVICES = 64

# (kind, args, mesh_axes, in_local_shape, out_local_shape, reason)
RawStep = tuple[str, tuple[Any, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...], str]


def plan_pieces(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> list[RawStep] | None:
    """The piecewise collective_permute steps from ``src`` to ``dst``, or None if it does not
    apply (partial, uneven tiles, tiles that do not divide one another, an empty value, or a
    mesh of more than :data:`MAX_DEVICES` devices)."""
    # An empty value has no pieces to move (and its tiles have size 0: nothing divides them).
    if src.partial or dst.partial or not shape or 0 in shape or src.mesh.size > MAX_DEVICES:
        return None
    cs, cd = [], []
    for n, ks, kd in zip(shape, src.tile_shape, dst.tile_shape, strict=True):
        if n % ks or n % kd:
            return None
        a, b = n // ks, n // kd
        if a % b and b % a:
            return None
        cs.append(a)
        cd.append(b)
    mesh = src.mesh
    piece = tuple(min(a, b) for a, b in zip(cs, cd, strict=True))
    ns = tuple(a // p for a, p in zip(cs, piece, strict=True))
    nd = tuple(b // p for b, p in zip(cd, piece, strict=True))
    t_src, t_dst = tile_coords(src), tile_coords(dst)
    holders: dict[tuple[int, ...], list[int]] = {}
    for p, t in enumerate(t_src):
        holders.setdefault(tuple(int(i) for i in t), []).append(p)
    n_dev = mesh.size
    send_busy: list[set[int]] = [set() for _ in range(n_dev)]
    recv_busy: list[set[int]] = [set() for _ in range(n_dev)]
    load = [0] * n_dev
    slots_dst = np.indices(nd).reshape(len(nd), -1).T  # [S, ndim]: a target slot's piece coords
    rounds = [[0] * len(slots_dst) for _ in range(n_dev)]
    sends: list[dict[int, tuple[int, int]]] = []  # per round: sender -> (receiver, source slot)
    for s, local in enumerate(slots_dst):
        for q in range(n_dev):
            g = t_dst[q] * np.asarray(nd) + local  # the piece's global piece coords
            tile = tuple(int(i) for i in g // np.asarray(ns))
            slot = int(np.ravel_multi_index(tuple(g % np.asarray(ns)), ns))

            def first_free(h: int, q: int = q) -> int:
                r = 0
                while r in send_busy[h] or r in recv_busy[q]:
                    r += 1
                return r

            r, _, _, h = min((first_free(h), h != q, load[h], h) for h in holders[tile])
            while len(sends) <= r:
                sends.append({})
            sends[r][h] = (q, slot)
            send_busy[h].add(r)
            recv_busy[q].add(r)
            load[h] += 1
            rounds[q][s] = r
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1).T
    steps: list[RawStep] = []
    cur = tuple(cs)
    why = f"piecewise collective_permute of {list(piece)} pieces"
    for r, moves in enumerate(sends):
        slots = tuple(moves[h][1] if h in moves else 0 for h in range(n_dev))
        steps.append(("take_piece", (tuple(cs), piece, slots), (), cur, piece, f"{why} (local)"))
        pairs: list[int] = []
        moved: set[str] = set()
        for h, (q, _) in sorted(moves.items(), key=lambda m: m[1][0]):
            pairs += [mesh.device_ids[h], mesh.device_ids[q]]
            moved |= {a for i, a in enumerate(mesh.axis_names) if coords[h][i] != coords[q][i]}
        axes = tuple(a for a in mesh.axis_names if a in moved)
        reason = f"{why}, round {r + 1} of {len(sends)}"
        steps.append(("collective_permute", (tuple(pairs), axes), axes, piece, piece, reason))
        cur = piece
    table = tuple(tuple(row) for row in rounds)
    steps.append(("place_pieces", (piece, table), (), piece, tuple(cd), f"{why} (local)"))
    return steps


def _interleave(k: int) -> list[int]:
    """``[n0, n1, .., p0, p1, ..]`` -> ``[n0, p0, n1, p1, ..]`` (dims of one tensor)."""
    return [i for d in range(k) for i in (d, k + d)]


def _grid(k: int) -> list[int]:
    """``[n0, p0, n1, p1, ..]`` -> ``[n0, n1, .., p0, p1, ..]``."""
    return [2 * d for d in range(k)] + [2 * d + 1 for d in range(k)]


def _split(tile: Sequence[int], piece: Sequence[int]) -> list[int]:
    return [v for c, p in zip(tile, piece, strict=True) for v in (c // p, p)]


def stacked_take(x: torch.Tensor, tile: Sequence[int], piece: Sequence[int], slots: Sequence[int]):
    """``[N, *tile]`` -> ``[N, *piece]``: row ``p`` keeps its piece number ``slots[p]``."""
    n, k = x.shape[0], len(tile)
    y = x.reshape(n, *_split(tile, piece)).permute(0, *(1 + i for i in _grid(k)))
    y = y.reshape(n, -1, *piece)
    index = torch.tensor(list(slots), dtype=torch.int64, device=x.device)
    return y[torch.arange(n, device=x.device), index]


def stacked_place(
    received: Sequence[torch.Tensor], out: Sequence[int], piece: Sequence[int], table
):
    """Rounds' ``[N, *piece]`` -> ``[N, *out]``: slot ``s`` of row ``p`` is from round
    ``table[p][s]``."""
    y = torch.stack(list(received), dim=1)  # [N, R, *piece]
    n, k = y.shape[0], len(piece)
    index = torch.tensor([list(r) for r in table], dtype=torch.int64, device=y.device)
    z = y[torch.arange(n, device=y.device).unsqueeze(1), index]  # [N, S, *piece]
    nd = [c // p for c, p in zip(out, piece, strict=True)]
    z = z.reshape(n, *nd, *piece).permute(0, *(1 + i for i in _interleave(k)))
    return z.reshape(n, *out)


def _row(graph: fx.Graph, call: Any, like: fx.Node, mesh_axes: list[str], table: list) -> fx.Node:
    """This device's row of ``table`` (indexed by mesh position), as an int64 tensor."""
    pos = call(graph, torch.ops.partita.axis_index.default, (like, mesh_axes))
    pos = call(graph, aten.reshape.default, (pos, [1]))
    values = call(graph, torch.Tensor.new_tensor, (pos, table))
    return call(graph, aten.index_select.default, (values, 0, pos))


def emit_take(graph, call, x, tile, piece, slots, mesh_axes) -> fx.Node:
    """Per-device graph of ``take_piece``: cut the tile into pieces, keep this device's one."""
    k = len(tile)
    y = call(graph, aten.reshape.default, (x, _split(tile, piece)))
    y = call(graph, aten.permute.default, (y, _grid(k)))
    y = call(graph, aten.reshape.default, (y, [math.prod(tile) // math.prod(piece), *piece]))
    index = _row(graph, call, x, mesh_axes, list(slots))
    y = call(graph, aten.index_select.default, (y, 0, index))
    return call(graph, aten.reshape.default, (y, list(piece)))


def emit_place(graph, call, received, out, piece, table, mesh_axes) -> fx.Node:
    """Per-device graph of ``place_pieces``: stack the rounds, pick each slot's round, glue."""
    k = len(piece)
    y = call(graph, aten.stack.default, (list(received), 0))
    index = _row(graph, call, received[0], mesh_axes, [list(r) for r in table])
    index = call(graph, aten.reshape.default, (index, [-1]))
    y = call(graph, aten.index_select.default, (y, 0, index))
    nd = [c // p for c, p in zip(out, piece, strict=True)]
    y = call(graph, aten.reshape.default, (y, [*nd, *piece]))
    y = call(graph, aten.permute.default, (y, _interleave(k)))
    return call(graph, aten.reshape.default, (y, list(out)))
