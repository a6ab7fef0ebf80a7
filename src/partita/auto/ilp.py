"""The integer program over a :class:`~partita.auto.space.Space`, built as sparse matrices and
solved with HiGHS (scipy).

Variables, in one vector:

* ``x[b, i]``: block ``b`` takes candidate ``i`` (binary; one per block sums to 1);
* ``y[v, t]``: some user of value ``v`` needs it as sharding ``t`` (``y >= x`` of every
  candidate of every user that needs ``t``): the partitioner reshards a value once per
  sharding it is needed as and reuses that copy for every other user (copy reuse);
* ``e[v, s, t]``: ``v`` is produced as ``s`` and needed as ``t``; ``sum_s e = y`` and
  ``e <= sum of x`` of the producer's candidates that give ``s``; it carries the reshard's price.

Rows: one-hot per block, the copy rows above, and optional ``<=`` rows (per-device stored bytes
under a memory limit; compute at most a bound, for ``objective="bytes"``). The LP relaxation is
solved first (``linprog(method="highs")``); when it is integral on ``x`` it is the optimum with
a certified gap of 0, else a MILP (``milp``, integral ``x``) runs with a time limit and a
relative gap of 1 %.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.auto.costs import Pricer
from partita.auto.highs import MilpResult, milp_with_start
from partita.auto.space import Space
from partita.propagate.state import ValueKey
from partita.values.spec import Sharding

__all__ = ["MIP_GAP", "Edges", "Model", "Solution", "build_model", "solve"]

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
    for b, block in enumerate(space.blocks):
        lo = offsets[b]
        if rep[b] == b:
            eq.add(np.arange(lo, lo + len(block)), np.ones(len(block)), 1.0)
        if block.op is not None:
            prices, comp = pricer.op(block.node, block.op.rule, block.assigns, block.local_bytes)
            cost[lo : lo + len(block)] += prices
            compute[lo : lo + len(block)] += comp
        for f in block.followers:
            prices, comp = pricer.op(f.op.node, f.op.rule, f.assigns, f.local_bytes)
            shape, dtype = space.shapes[f.value], space.dtypes[f.value]
            bucketed = shape in space.stored_shapes
            moves = [
                pricer.reshard(h, n, shape, dtype, bucketed)
                for h, n in zip(f.has, f.needs, strict=True)
            ]
            cost[lo : lo + len(block)] += np.array(prices) + np.array(moves)
            compute[lo : lo + len(block)] += comp
        else:
            mine = np.array(
                [
                    sum(
                        pricer.local_bytes(s, space.shapes[k], space.dtypes[k])
                        for k, s in res.items()
                    )
                    for res in block.results
                ]
            )
            stored[lo : lo + len(block)] += mine
            # ties: of two equal plans, the one storing fewer bytes per device
            cost[lo : lo + len(block)] += mine * pricer.per_stored_byte
    for key in space.outputs:  # a partial result is reduced before it is returned
        b = space.producer[key]
        lo = offsets[b]
        for i, res in enumerate(space.blocks[b].results):
            got = res.get(key)
            if got is not None and got.partial:
                whole = Sharding(got.mesh, got.dim_axes)
                cost[lo + i] += pricer.reshard(got, whole, space.shapes[key], space.dtypes[key])
    extra: list[float] = []
    # value -> (sharding -> x columns of its producer giving it)
    produced: dict[ValueKey, dict[Sharding, list[int]]] = {}
    needed: dict[ValueKey, dict[Sharding, list[tuple[int, list[int]]]]] = {}
    for use in space.uses:
        if use.value not in space.producer:
            continue
        lo = int(offsets[use.block])
        by_need: dict[Sharding, list[int]] = {}
        for i, need in enumerate(use.needs):
            if need is not None:
                by_need.setdefault(need, []).append(lo + i)
        slot = needed.setdefault(use.value, {})
        for need, cols in by_need.items():
            slot.setdefault(need, []).append((use.block, cols))
    n = n_x
    # an edge that repeats one already built (the same columns, the same prices): its e
    # variables, whose prices it adds to
    built: dict[tuple[Any, ...], dict[float, int]] = {}
    edge_of: dict[tuple[Any, ...], int] = {}
    edges = Edges()
    for key, wanted in needed.items():
        p = space.producer[key]
        lo = int(offsets[p])
        gives = produced.get(key)
        if gives is None:
            gives = {}
            for i, res in enumerate(space.blocks[p].results):
                s = res.get(key)
                if s is not None:
                    gives.setdefault(s, []).append(lo + i)
            produced[key] = gives
        shape, dtype = space.shapes[key], space.dtypes[key]
        bucketed = shape in space.stored_shapes  # a parameter's or its gradient's
        for need, users in wanted.items():
            price = {s: pricer.reshard(s, need, shape, dtype, bucketed) for s in gives}
            if all(v == 0.0 for v in price.values()):
                continue  # free whatever the producer does: no variable needed
            # producer shardings grouped by price: one e per price; the free ones need none
            classes: dict[float, list[int]] = {}
            for sg, xcols in gives.items():
                classes.setdefault(round(price[sg], 9), []).extend(xcols)
            free = classes.pop(0.0, [])
            sig = (
                tuple(sorted((p_, tuple(sorted(c))) for p_, c in classes.items())),
                tuple(sorted(free)),
                tuple(sorted({tuple(cols) for _, cols in users})),
            )
            again = built.get(sig)
            if again is not None:
                for p_, xcols in classes.items():
                    extra[again[p_] - n_x] += p_
                    edges.prices.extend((edge_of[sig], c, p_) for c in xcols)
                continue
            edge_of[sig] = len(edge_of)
            edges.users.extend({(edge_of[sig], c) for _, cols in users for c in cols})
            for p_, xcols in classes.items():
                edges.prices.extend((edge_of[sig], c, p_) for c in xcols)
            y = n
            n += 1
            extra.append(0.0)
            for _, cols in users:  # y >= x of every candidate needing it
                ub.add(np.array([*cols, y]), np.array([1.0] * len(cols) + [-1.0]), 0.0)
            e_cols = []
            for p_, xcols in classes.items():
                e = n
                n += 1
                extra.append(p_)
                e_cols.append(e)
                ub.add(np.array([e, *xcols]), np.array([1.0] + [-1.0] * len(xcols)), 0.0)
            built[sig] = dict(zip(classes, e_cols, strict=True))
            # y <= sum e + x of the free producer candidates: a needed copy is paid for
            ub.add(
                np.array([y, *e_cols, *free]),
                np.array([1.0] + [-1.0] * (len(e_cols) + len(free))),
                0.0,
            )
    cost = np.concatenate([cost, np.array(extra)])
    return Model(
        cost, eq.rows, eq.cols, eq.vals, eq.rhs, ub.rows, ub.cols, ub.vals, ub.rhs,
        offsets, n_x, stored, compute, time.perf_counter() - start, rep,
        sum(1 for b in range(nb) if rep[b] == b), [len(b) for b in space.blocks], edges,
    )  # fmt: skip


def _matrix(
    rows: list[np.ndarray], cols: list[np.ndarray], vals: list[np.ndarray], n_rows: int, n: int
) -> Any:
    from scipy.sparse import csr_matrix  # type: ignore[import-untyped,import-not-found,unused-ignore]

    if not rows:
        return None
    return csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n_rows, n)
    )


def solve(
    model: Model,
    *,
    memory: float | None = None,
    compute: float | None = None,
    time_limit: float = 30.0,
    start: list[int] | None = None,
) -> Solution:
    """Solve the model: LP relaxation, then a MILP when it is fractional. ``memory`` bounds the
    per-device stored bytes, ``compute`` the modelled compute seconds. ``start``: a choice per
    block (a preset's, ``auto.start``) the MILP starts from as its incumbent."""
    from scipy.optimize import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        Bounds,
        LinearConstraint,
        linprog,
        milp,
    )
    from scipy.sparse import vstack  # type: ignore[import-untyped,import-not-found,unused-ignore]

    t0 = time.perf_counter()
    n = len(model.cost)
    ub_rows, ub_cols, ub_vals, ub_rhs = (
        list(model.ub_rows), list(model.ub_cols), list(model.ub_vals), list(model.ub_rhs),
    )  # fmt: skip
    for vec, bound in ((model.stored, memory), (model.compute, compute)):
        if bound is None:
            continue
        nz = np.nonzero(vec)[0]
        ub_rows.append(np.full(len(nz), len(ub_rhs), dtype=np.int64))
        ub_cols.append(nz)
        ub_vals.append(vec[nz])
        ub_rhs.append(float(bound))
    a_eq = _matrix(model.eq_rows, model.eq_cols, model.eq_vals, len(model.eq_rhs), n)
    a_ub = _matrix(ub_rows, ub_cols, ub_vals, len(ub_rhs), n)
    b_eq, b_ub = np.array(model.eq_rhs), np.array(ub_rhs)
    rows = len(b_eq) + len(b_ub)
    lp = linprog(
        model.cost, A_ub=a_ub, b_ub=b_ub if a_ub is not None else None, A_eq=a_eq, b_eq=b_eq,
        bounds=(0, 1), method="highs", options={"time_limit": time_limit},
    )  # fmt: skip
    if lp.x is None:
        return Solution(
            [], float("inf"), float("inf"), float("inf"), False, "highs-lp", n, rows,
            model.build_seconds, time.perf_counter() - t0, status=str(lp.message),
        )  # fmt: skip
    x = lp.x[: model.n_x]
    integral = bool(np.all(np.minimum(np.abs(x), np.abs(1 - x)) < 1e-6))
    if integral:
        choice = _decode(model, lp.x)
        return Solution(
            choice, float(lp.fun), float(lp.fun), 0.0, True, "highs-lp", n, rows,
            model.build_seconds, time.perf_counter() - t0, status="optimal",
        )  # fmt: skip
    integrality = np.zeros(n)
    integrality[: model.n_x] = 1
    remaining = max(1.0, time_limit - (time.perf_counter() - t0))
    first = _price(model, start, a_eq, b_eq, a_ub, b_ub) if start else None
    res: Any = None
    if first is not None:
        a_all = a_eq if a_ub is None else vstack([a_eq, a_ub])
        lower = np.concatenate([b_eq, np.full(len(b_ub), -np.inf)])
        res = milp_with_start(
            model.cost, a_all, lower, np.concatenate([b_eq, b_ub]), integrality, first[1],
            remaining, MIP_GAP,
        )  # fmt: skip
    if res is None:
        constraints = [LinearConstraint(a_eq, b_eq, b_eq)]
        if a_ub is not None:
            constraints.append(LinearConstraint(a_ub, -np.inf, b_ub))
        out = milp(
            model.cost, constraints=constraints, integrality=integrality, bounds=Bounds(0, 1),
            options={"time_limit": remaining, "mip_rel_gap": MIP_GAP},
        )  # fmt: skip
        fun = float(out.fun) if out.x is not None else float("inf")
        res = MilpResult(
            out.x, fun, float(getattr(out, "mip_dual_bound", lp.fun) or lp.fun),
            float(getattr(out, "mip_gap", 0.0) or 0.0), str(out.message),
        )  # fmt: skip
        if first is not None and first[0] < fun:  # no incumbent API: the start is kept
            res.x, res.fun = first[1], first[0]
            res.gap = (res.fun - res.bound) / max(abs(res.fun), 1e-12)
    if res.x is None:
        choice = _decode(model, lp.x)  # rounded LP: the caller re-scores it exactly
        return Solution(
            choice, float(lp.fun), float(lp.fun), float("inf"), False, "highs-lp-rounded", n,
            rows, model.build_seconds, time.perf_counter() - t0, status=str(res.message),
        )  # fmt: skip
    bound, gap = max(res.bound, float(lp.fun)), res.gap
    choice, fun, solver = _decode(model, res.x), res.fun, "highs-milp"
    if gap > MIP_GAP:  # stopped by the time limit: the rounded LP may be a better plan
        rounded = _decode(model, lp.x)
        priced = _price(model, rounded, a_eq, b_eq, a_ub, b_ub) if rounded != choice else None
        if priced is not None and priced[0] < fun:
            choice, fun, solver = rounded, priced[0], "highs-milp+rounded-lp"
    gap = max(0.0, (fun - bound) / max(abs(fun), 1e-12))
    return Solution(
        choice, fun, bound, gap, False, solver, n, rows,
        model.build_seconds, time.perf_counter() - t0, status=str(res.message),
    )  # fmt: skip


def _price(
    model: Model, choice: list[int], a_eq: Any, b_eq: np.ndarray, a_ub: Any, b_ub: np.ndarray
) -> tuple[float, np.ndarray] | None:
    """The objective of ``choice`` (its copy and edge variables at their cheapest) and the
    full vector, or None when it breaks a row (a memory budget)."""
    from scipy.optimize import linprog  # type: ignore[import-untyped,import-not-found,unused-ignore]

    lo = np.zeros(len(model.cost))
    hi = np.ones(len(model.cost))
    hi[: model.n_x] = 0.0
    for b, i in enumerate(choice):
        if model.rep[b] == b and model.widths[b]:
            lo[model.offsets[b] + i] = hi[model.offsets[b] + i] = 1.0
    res = linprog(
        model.cost, A_ub=a_ub, b_ub=b_ub if a_ub is not None else None, A_eq=a_eq, b_eq=b_eq,
        bounds=np.stack([lo, hi], axis=1), method="highs",
    )  # fmt: skip
    return (float(res.fun), np.asarray(res.x)) if res.status == 0 else None


def _decode(model: Model, x: np.ndarray) -> list[int]:
    offs = model.offsets
    return [
        int(np.argmax(x[offs[b] : offs[b] + w])) if w else 0 for b, w in enumerate(model.widths)
    ]
