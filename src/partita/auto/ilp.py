"""The integer program over a :class:`~partita.auto.space.Space`, built as sparse matrices
(:mod:`partita.auto.highs` solves it).

Variables, in one vector:

* ``x[b, i]``: block ``b`` takes candidate ``i`` (binary; one per block sums to 1);
* ``y[v, t]``: some user of value ``v`` needs it as sharding ``t`` (``y >= x`` of every
  candidate of every user that needs ``t``): the partitioner reshards a value once per
  sharding it is needed as and reuses that copy for every other user (copy reuse);
* ``e[v, s, t]``: ``v`` is produced as ``s`` and needed as ``t``; ``sum_s e = y`` and
  ``e <= sum of x`` of the producer's candidates that give ``s``; it carries the reshard's price.

Rows: one-hot per block, the copy rows above, and optional ``<=`` rows (per-device stored bytes
under a memory limit; compute at most a bound, for ``objective="bytes"``).

Prices are computed once per signature (``Block.sig``, ``auto.candidates``): the blocks of a
repeated layer, and the edges between them, reuse the first copy's prices, so the build's
pricing work does not grow with the layers (``Model.priced_ops``, ``Model.priced_edges``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.auto.costs import Pricer
from partita.auto.space import Space
from partita.propagate.state import ValueKey
from partita.values.spec import Sharding

__all__ = ["MIP_GAP", "Edges", "Model", "Solution", "build_model"]

#: The MILP stops within this relative gap of its bound.
MIP_GAP = 0.01


@dataclass
class Model:
    """The LP's arrays, and where each block's x starts."""

    cost: np.ndarray
    eq_rows: list[np.ndarray]
    eq_cols: list[np.ndarray]
    eq_vals: list[np.ndarray]
    eq_rhs: list[float]
    ub_rows: list[np.ndarray]
    ub_cols: list[np.ndarray]
    ub_vals: list[np.ndarray]
    ub_rhs: list[float]
    offsets: np.ndarray  # per block: where its (shared) x columns start; one past the end last
    n_x: int
    stored: np.ndarray  # per x: per-device bytes of the inputs it stores
    compute: np.ndarray  # per x: modelled compute seconds
    build_seconds: float = 0.0
    #: per block, the block whose x columns it shares (``auto.clusters``); itself when none
    rep: list[int] = field(default_factory=list)
    #: blocks that have columns of their own (the clusters' count)
    clusters: int = 0
    #: per block, its number of candidates
    widths: list[int] = field(default_factory=list)
    edges: Edges = field(default_factory=lambda: Edges())
    #: price computations the build did (cache misses): blocks priced, (value, need) edges
    #: priced; a repeated layer adds none
    priced_ops: int = 0
    priced_edges: int = 0


@dataclass
class Edges:
    """The link variables as plain data (the greedy pass prices a choice with them): edge
    ``k`` is paid when an x column of ``users`` with ``k`` is chosen, at the sum of the
    prices of ``prices`` with ``k`` whose column is chosen (the producer's)."""

    users: list[tuple[int, int]] = field(default_factory=list)  # (edge, x column)
    prices: list[tuple[int, int, float]] = field(default_factory=list)  # (edge, column, price)


@dataclass
class Solution:
    """A choice per block and the solver's figures."""

    choice: list[int]
    objective: float
    bound: float
    gap: float
    integral_lp: bool
    solver: str
    variables: int
    rows: int
    build_seconds: float
    solve_seconds: float
    status: str = ""
    extra: dict[str, float] = field(default_factory=dict)


class _Rows:
    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.rhs: list[float] = []

    def add(self, cols: np.ndarray, vals: np.ndarray, rhs: float) -> None:
        r = len(self.rhs)
        self.rows.append(np.full(len(cols), r, dtype=np.int64))
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.asarray(vals, dtype=np.float64))
        self.rhs.append(rhs)


def build_model(space: Space, pricer: Pricer, rep: list[int] | None = None) -> Model:
    """The arrays of the program (see the module); prices from ``pricer``. ``rep[b]``: the
    block whose x columns block ``b`` shares (``auto.clusters``): its prices are added to
    those columns, and its edges that repeat another member's share their variables."""
    start = time.perf_counter()
    nb = len(space.blocks)
    rep = list(range(nb)) if rep is None else rep
    offsets = np.zeros(nb + 1, dtype=np.int64)
    n_x = 0
    for b, block in enumerate(space.blocks):
        if rep[b] == b:
            offsets[b] = n_x
            n_x += len(block)
        else:
            offsets[b] = offsets[rep[b]]
    offsets[nb] = n_x
    cost = np.zeros(n_x)
    compute = np.zeros(n_x)
    stored = np.zeros(n_x)
    eq, ub = _Rows(), _Rows()
    # prices by signature (``Block.sig``): a repeated layer's blocks are priced once
    memo: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    counts = {"ops": 0, "edges": 0}
    for b, block in enumerate(space.blocks):
        lo = offsets[b]
        if rep[b] == b:
            eq.add(np.arange(lo, lo + len(block)), np.ones(len(block)), 1.0)
        bsig = (block.sig, tuple(f.sig for f in block.followers))
        found = memo.get(bsig) if block.sig is not None else None
        if found is None:
            found = _block_prices(space, pricer, block)
            counts["ops"] += 1 + len(block.followers)
            if block.sig is not None:
                memo[bsig] = found
        price, comp, mine = found
        cost[lo : lo + len(block)] += price
        compute[lo : lo + len(block)] += comp
        stored[lo : lo + len(block)] += mine
    for key in space.outputs:  # a partial result is reduced before it is returned
        b = space.producer[key]
        lo = offsets[b]
        for i, res in enumerate(space.blocks[b].results):
            got = res.get(key)
            if got is not None and got.partial:
                whole = Sharding(got.mesh, got.dim_axes)
                cost[lo + i] += pricer.reshard(got, whole, space.shapes[key], space.dtypes[key])
    extra: list[float] = []
    # value -> id of a needed sharding -> (it, {(user's first column, its candidates needing
    # it)}); shardings are interned (``auto.candidates``), so ``id`` means equality, and the
    # candidate tuples are shared by every use with the same needs
    needed: dict[ValueKey, dict[int, tuple[Sharding, dict[tuple[int, int], tuple[int, ...]]]]]
    needed = {}
    grouped: dict[tuple[int, ...], list[tuple[Sharding, tuple[int, ...]]]] = {}
    for use in space.uses:
        if use.value not in space.producer:
            continue
        lo = int(offsets[use.block])
        ids = tuple(map(id, use.needs))
        by_need = grouped.get(ids)
        if by_need is None:
            part: dict[int, tuple[Sharding, list[int]]] = {}
            for i, need in enumerate(use.needs):
                if need is not None:
                    part.setdefault(id(need), (need, []))[1].append(i)
            by_need = grouped[ids] = [(nd, tuple(cs)) for nd, cs in part.values()]
        slot = needed.setdefault(use.value, {})
        for need, cols in by_need:
            slot.setdefault(id(need), (need, {}))[1][(lo, id(cols))] = cols
    n = n_x
    # an edge that repeats one already built (the same columns, the same prices) shares its
    # variables: it only counts again, and its prices are multiplied by the count at the end
    built: dict[tuple[Any, ...], tuple[int, int, list[int]]] = {}  # (edge, cid, its e columns)
    repeats: dict[tuple[Any, ...], int] = {}
    edges = Edges()
    # (the producer's shardings of a value by candidate, as object ids) -> their candidates;
    # with a needed sharding -> the candidates by price class. Copies of a layer share the
    # Sharding objects (``auto.candidates``), so each is computed once per unique layer.
    by_ids: dict[tuple[int, ...], dict[Sharding, list[int]]] = {}
    classed_id: dict[tuple[Any, ...], int] = {}
    classed: list[tuple[dict[float, list[int]], list[int]] | None] = []
    for key, wanted in needed.items():
        p = space.producer[key]
        lo = int(offsets[p])
        results = space.blocks[p].results
        ids = tuple(id(res.get(key)) for res in results)
        gives = by_ids.get(ids)
        if gives is None:
            gives = by_ids[ids] = {}
            for i, res in enumerate(results):
                s = res.get(key)
                if s is not None:
                    gives.setdefault(s, []).append(i)
        shape, dtype = space.shapes[key], space.dtypes[key]
        bucketed = shape in space.stored_shapes  # a parameter's or its gradient's
        for need, users in wanted.values():
            ckey = (ids, id(need), shape, dtype, bucketed)
            cid = classed_id.get(ckey)
            if cid is None:
                counts["edges"] += 1
                cid = classed_id[ckey] = len(classed)
                classed.append(_classes(pricer, gives, need, shape, dtype, bucketed))
            found_classes = classed[cid]
            if found_classes is None:
                continue  # free whatever the producer does: no variable needed
            # the same producer columns, price classes and user columns: a repeat
            sig = (lo, cid, tuple(sorted(users)))
            if sig in built:
                repeats[sig] += 1
                continue
            repeats[sig] = 1
            user_cols = [[u + i for i in needing] for (u, _), needing in users.items()]
            edge = len(built)
            edges.users.extend({(edge, c) for ucols in user_cols for c in ucols})
            y = n
            n += 1
            extra.append(0.0)
            for ucols in user_cols:  # y >= x of every candidate needing it
                ub.add(np.array([*ucols, y]), np.array([1.0] * len(ucols) + [-1.0]), 0.0)
            e_cols = []
            for p_, rel in found_classes[0].items():
                e = n
                n += 1
                extra.append(p_)
                e_cols.append(e)
                ub.add(
                    np.array([e, *(lo + i for i in rel)]), np.array([1.0] + [-1.0] * len(rel)), 0.0
                )
            built[sig] = (edge, cid, e_cols)
            # y <= sum e + x of the free producer candidates: a needed copy is paid for
            free = [lo + i for i in found_classes[1]]
            ub.add(
                np.array([y, *e_cols, *free]),
                np.array([1.0] + [-1.0] * (len(e_cols) + len(free))),
                0.0,
            )
    for sig, (edge, cid, e_cols) in built.items():
        count, lo = repeats[sig], sig[0]
        found_classes = classed[cid]
        assert found_classes is not None
        for e, (p_, rel) in zip(e_cols, found_classes[0].items(), strict=True):
            extra[e - n_x] = p_ * count
            edges.prices.extend((edge, lo + i, p_ * count) for i in rel)
    cost = np.concatenate([cost, np.array(extra)])
    return Model(
        cost, eq.rows, eq.cols, eq.vals, eq.rhs, ub.rows, ub.cols, ub.vals, ub.rhs,
        offsets, n_x, stored, compute, time.perf_counter() - start, rep,
        sum(1 for b in range(nb) if rep[b] == b), [len(b) for b in space.blocks], edges,
        priced_ops=counts["ops"], priced_edges=counts["edges"],
    )  # fmt: skip


def _block_prices(
    space: Space, pricer: Pricer, block: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate of ``block``: the price the objective counts (compute, internal
    collectives, its followers' reshards, a tie-break on stored bytes), the modelled compute,
    and the stored bytes per device."""
    width = len(block)
    price, compute = np.zeros(width), np.zeros(width)
    if block.op is not None:
        p, c = pricer.op(block.node, block.op.rule, block.assigns, block.local_bytes)
        price += p
        compute += c
    for f in block.followers:
        p, c = pricer.op(f.op.node, f.op.rule, f.assigns, f.local_bytes)
        shape, dtype = space.shapes[f.value], space.dtypes[f.value]
        bucketed = shape in space.stored_shapes
        moves = [
            pricer.reshard(h, n, shape, dtype, bucketed)
            for h, n in zip(f.has, f.needs, strict=True)
        ]
        price += np.array(p) + np.array(moves)
        compute += c
    mine = np.array(
        [
            sum(pricer.local_bytes(s, space.shapes[k], space.dtypes[k]) for k, s in res.items())
            for res in block.results
        ]
    )
    # ties: of two equal plans, the one storing fewer bytes per device
    return price + mine * pricer.per_stored_byte, compute, mine


def _classes(
    pricer: Pricer,
    gives: dict[Sharding, list[int]],
    need: Sharding,
    shape: tuple[int, ...],
    dtype: Any,
    bucketed: bool,
) -> tuple[dict[float, list[int]], list[int]] | None:
    """The producer's candidates (``gives``: by the sharding they give) grouped by the price
    of resharding to ``need``, and the free ones; None when every one is free."""
    price = {s: pricer.reshard(s, need, shape, dtype, bucketed) for s in gives}
    if all(v == 0.0 for v in price.values()):
        return None
    classes: dict[float, list[int]] = {}
    for sg, rel in gives.items():
        classes.setdefault(round(price[sg], 9), []).extend(rel)
    free = classes.pop(0.0, [])
    return classes, free
