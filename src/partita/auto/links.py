"""The reshard terms of the integer program (:mod:`partita.auto.ilp`): what moving each value
from the sharding its producer gives to the shardings its users need costs.

Per value ``v``: its producer's candidates give it one of the shardings ``s`` (``X[s]``, the
sum of the x columns giving ``s``); each use ``u`` (a block reading ``v`` in one operand)
needs it as one of the shardings ``t`` (``N[u, t]``, the sum of its x columns needing ``t``).

* **Transport** (Alpa's edge variables, between shardings rather than candidates):
  ``f[u, s, t] >= 0`` with ``sum_t f[u, s, t] = X[s]`` and ``sum_s f[u, s, t] = N[u, t]``. At an
  integral point it is 1 on the (given, needed) pair and 0 elsewhere. In the LP relaxation it
  splits the producer's mass among the needs: one unit of "the producer gives ``s``" serves
  one unit of need, never several, which is what keeps the relaxation integral on the
  transformers of ``bench/bench_auto.py``. (An earlier formulation bounded each needed
  sharding's reshard by the producer's mass separately, so a half-chosen producer could serve
  two half-chosen needs for free each; on GPT-S (2, 4) its LP bound was 34 % below the
  integer optimum and the MILP stopped at its time limit.)
* **Price.** The reshard ``s -> t`` is priced on ``f[u, s, t]`` when only one use can need
  ``t``. When several can, the partitioner reshards once and reuses the copy:
  ``w[v, s, t] >= f[u, s, t]`` for every such use, and the price is on ``w`` (copy reuse).
* **Shortcuts.** When the producer gives one sharding (``f = N``) or the use needs one
  (``f = X``), no ``f`` is made: the price goes on the x columns (or bounds ``w`` from them).
  Needs that every given sharding reaches for free are one group, priced 0.

Prices are computed once per (the producer's shardings, the need, shape, dtype): the copies of
a repeated layer share them. A value whose producer columns, shardings and uses repeat
another's (two copies of a layer in one cluster, ``auto.clusters``) shares its variables; its
prices are multiplied by the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.auto.costs import Pricer
from partita.auto.space import Column, Space
from partita.propagate.state import ValueKey
from partita.values.spec import Sharding

__all__ = ["Edges", "Links", "Rows", "add_links"]


class Rows:
    """Sparse rows as flat (row, column, value) lists and their right-hand sides."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.rhs: list[float] = []

    def add(self, cols: list[int], vals: list[float], rhs: float) -> None:
        self.rows.extend([len(self.rhs)] * len(cols))
        self.cols.extend(cols)
        self.vals.extend(vals)
        self.rhs.append(rhs)


@dataclass
class Edges:
    """The reshards as plain data (the greedy pass prices a choice with them): edge ``k`` (a
    value and a sharding it is needed as) is paid when an x column of ``users`` with ``k`` is
    chosen, at the price of ``prices`` with ``k`` whose column is chosen (the producer's)."""

    users: list[tuple[int, int]] = field(default_factory=list)  # (edge, x column)
    prices: list[tuple[int, int, float]] = field(default_factory=list)  # (edge, column, price)


@dataclass
class Links:
    """The columns after the x columns, and what the build counted."""

    columns: int
    #: per column (x and link): the reshard prices it carries (added to the x prices)
    cost: np.ndarray
    edges: Edges
    #: price tables computed (cache misses): a repeated layer adds none
    priced: int = 0
    #: transport and copy variables made
    transport: int = 0
    copies: int = 0


@dataclass
class _Value:
    """One value's link terms as built, to be priced ``count`` times."""

    priced: list[tuple[int, float]] = field(default_factory=list)  # (column, unit price)
    edges: list[tuple[int, list[int]]] = field(default_factory=list)  # (edge, user columns)
    count: int = 1


def add_links(space: Space, pricer: Pricer, offsets: np.ndarray, n_x: int, eq: Rows,
              ub: Rows) -> Links:  # fmt: skip
    """The link columns and rows of every value (see the module); rows go into ``eq`` and
    ``ub``, x columns start at ``offsets[block]``."""
    # needs and producer shardings are columns (``space.Block.columns``): one object per op
    # template, shared by every copy of a layer, so their ``id`` keys the caches below
    uses_of: dict[ValueKey, dict[tuple[int, int], Column]] = {}
    permuted: set[ValueKey] = set()  # read through a follower permute somewhere
    starts = offsets.tolist()  # Python ints: one look-up per use, no numpy scalar
    producer = space.producer
    for use in space.uses:
        used = use.value
        if used in producer:
            needs = use.needs
            uses_of.setdefault(used, {}).setdefault((starts[use.block], id(needs)), needs)
            if use.through:
                permuted.add(used)
    state = _Build(pricer, n_x, eq, ub)
    built: dict[tuple[Any, ...], _Value] = {}
    blocks, shapes, dtypes, stored = space.blocks, space.shapes, space.dtypes, space.stored_shapes
    kept: dict[int, bool] = {}  # id(shape) -> shape in stored (the copies share shape objects)
    for key, uses in uses_of.items():
        p = producer[key]
        lo = starts[p]
        column = blocks[p].columns[key]
        ids = id(column)
        shape, dtype = shapes[key], dtypes[key]
        # a parameter's or its gradient's collective is bucketed; not a reshard for a reader
        # through a permute: the partitioner runs it where that reader is, one call of its own
        bucketed = kept.get(id(shape))
        if bucketed is None:
            bucketed = kept[id(shape)] = shape in stored
        bucketed = bucketed and key not in permuted
        sig = (lo, ids, shape, dtype, bucketed, tuple(sorted(uses)))
        found = built.get(sig)
        if found is not None:
            found.count += 1
            continue
        gives = state.gives(ids, column)
        built[sig] = state.value(lo, gives, ids, list(uses.items()), (shape, dtype, bucketed))
    cost = np.zeros(state.next)
    edges = Edges()
    for value in built.values():
        for c, price in value.priced:
            cost[c] += price * value.count
        for edge, users in value.edges:
            edges.users.extend((edge, c) for c in users)
        for edge, _ in value.edges:
            edges.prices.extend((edge, c, price * value.count) for c, price in state.producer[edge])
    return Links(state.next, cost, edges, state.priced, state.transport, state.copies)


class _Build:
    """The running state of :func:`add_links`: the next column, memoised price tables."""

    def __init__(self, pricer: Pricer, n_x: int, eq: Rows, ub: Rows) -> None:
        self.pricer, self.eq, self.ub = pricer, eq, ub
        self.next = n_x
        self.priced = self.transport = self.copies = 0
        self._gives: dict[int, tuple[list[Sharding | None], list[list[int]]]] = {}
        self._tables: dict[tuple[Any, ...], np.ndarray | None] = {}
        #: per edge, the producer's (x column, price) entries
        self.producer: list[list[tuple[int, float]]] = []

    def column(self) -> int:
        self.next += 1
        return self.next - 1

    def gives(self, ids: int, shardings: Column) -> tuple[list[Sharding | None], list[list[int]]]:
        """The producer's distinct shardings of the value and the candidates giving each."""
        found = self._gives.get(ids)
        if found is None:
            order: dict[int, int] = {}
            given: list[Sharding | None] = []
            cands: list[list[int]] = []
            for i, s in enumerate(shardings):
                j = order.setdefault(id(s), len(given))
                if j == len(given):
                    given.append(s)
                    cands.append([])
                cands[j].append(i)
            found = self._gives[ids] = (given, cands)
        return found

    def table(self, ids: int, given: list[Sharding | None], need: Sharding,
              value: tuple[Any, ...]) -> np.ndarray | None:  # fmt: skip
        """The price of reaching ``need`` from each given sharding; None when all are free."""
        key = (ids, id(need), *value)
        if key in self._tables:
            return self._tables[key]
        self.priced += 1
        shape, dtype, bucketed = value
        prices = np.array(
            [0.0 if s is None else self.pricer.reshard(s, need, shape, dtype, bucketed)
             for s in given]
        )  # fmt: skip
        found = self._tables[key] = prices if prices.any() else None
        return found

    def value(
        self,
        lo: int,
        gives: tuple[list[Sharding | None], list[list[int]]],
        ids: int,
        uses: list[tuple[tuple[int, int], Column]],
        shape: tuple[Any, ...],
    ) -> _Value:
        """One value's columns and rows (see the module)."""
        given, cands = gives
        out = _Value()
        tables: dict[int, np.ndarray] = {}
        live: list[dict[int | None, list[int]]] = []
        for (ulo, _), needs in uses:
            groups: dict[int | None, list[int]] = {}
            for i, need in enumerate(needs):
                found = None if need is None else self.table(ids, given, need, shape)
                if found is not None:
                    tables[id(need)] = found
                groups.setdefault(None if found is None else id(need), []).append(ulo + i)
            if any(t is not None for t in groups):
                live.append(groups)
        if not live:
            return out
        needed_by: dict[int, list[int]] = {}
        for groups in live:
            for t, ucols in groups.items():
                if t is not None:
                    needed_by.setdefault(t, []).extend(ucols)
        shared = {t for t in needed_by if sum(t in g for g in live) > 1}
        copy: dict[tuple[int, int], int] = {}
        for t in shared:
            for si, price in enumerate(tables[t]):
                if price > 0:
                    copy[si, t] = self.column()
                    out.priced.append((copy[si, t], float(price)))
        self.copies += len(copy)
        for groups in live:
            self._use(lo, cands, groups, tables, copy, out)
        for t, ucols in needed_by.items():
            edge = len(self.producer)
            self.producer.append(
                [(lo + i, float(p)) for si, p in enumerate(tables[t]) if p > 0 for i in cands[si]]
            )
            out.edges.append((edge, ucols))
        return out

    def _use(
        self,
        lo: int,
        cands: list[list[int]],
        groups: dict[int | None, list[int]],
        tables: dict[int, np.ndarray],
        copy: dict[tuple[int, int], int],
        out: _Value,
    ) -> None:
        """One use's transport (or its shortcut) and its prices."""
        if len(cands) == 1 or len(groups) == 1:
            # f is fixed: N (one sharding given) or X (one sharding needed)
            for t, ucols in groups.items():
                if t is None:
                    continue
                for si, price in enumerate(tables[t]):
                    if price <= 0:
                        continue
                    mass = ucols if len(cands) == 1 else [lo + i for i in cands[si]]
                    if (si, t) in copy:
                        self.ub.add([*mass, copy[si, t]], [1.0] * len(mass) + [-1.0], 0.0)
                    else:
                        out.priced.extend((c, float(price)) for c in mass)
            return
        order = list(groups)
        f = {(si, t): self.column() for si in range(len(cands)) for t in order}
        self.transport += len(f)
        for si, rel in enumerate(cands):  # sum_t f[s, t] = X[s]
            cols = [f[si, t] for t in order] + [lo + i for i in rel]
            self.eq.add(cols, [1.0] * len(order) + [-1.0] * len(rel), 0.0)
        for t in order[:-1]:  # sum_s f[s, t] = N[t] (the last row follows from the others)
            ucols = groups[t]
            cols = [f[si, t] for si in range(len(cands))] + ucols
            self.eq.add(cols, [1.0] * len(cands) + [-1.0] * len(ucols), 0.0)
        for t in order:
            if t is None:
                continue
            for si, price in enumerate(tables[t]):
                if price <= 0:
                    continue
                if (si, t) in copy:
                    self.ub.add([f[si, t], copy[si, t]], [1.0, -1.0], 0.0)
                else:
                    out.priced.append((f[si, t], float(price)))
