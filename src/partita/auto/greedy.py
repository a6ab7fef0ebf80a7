"""A greedy coordinate-descent pass over the integer program of :mod:`partita.auto.ilp`,
with numpy only.

It starts from a choice per block (every block's first candidate, which replicates, when
nothing better is known) and visits the blocks that own variables in turn: for each, it tries
every candidate with the others held, prices the change on the block's own columns and on the
edges that touch them, and keeps the cheapest. Sweeps repeat until one changes nothing or the
time is up. A memory budget is honoured the same way as the objective: the bytes over the
budget at the model's peak rows (``auto.memory``) are reduced first, then the price. The
result is a local optimum, with no bound.

It is the solver when scipy is missing, and it polishes a MILP answer that its time limit
stopped far from the LP bound.
"""

from __future__ import annotations

import time

import numpy as np

from partita.auto.ilp import Model, Solution

__all__ = ["Prices", "descend", "greedy_solve", "objective_of", "onehot"]


class Prices:
    """The edges of a model indexed for pricing a choice (``total``) and a block's change."""

    def __init__(self, model: Model) -> None:
        self.model = model
        users = np.array(model.edges.users, dtype=np.int64).reshape(-1, 2)
        prices = np.array([(e, c) for e, c, _ in model.edges.prices], dtype=np.int64)
        prices = prices.reshape(-1, 2)
        vals = np.array([v for _, _, v in model.edges.prices], dtype=np.float64)
        self.u_edge, self.u_col = users[:, 0], users[:, 1]
        self.p_edge, self.p_col, self.p_val = prices[:, 0], prices[:, 1], vals
        n_edges = int(max(self.u_edge.max(initial=-1), self.p_edge.max(initial=-1))) + 1
        self.n_edges = n_edges
        # per column, the edges it touches
        touch: dict[int, set[int]] = {}
        for e, c in zip(self.u_edge.tolist(), self.u_col.tolist(), strict=True):
            touch.setdefault(c, set()).add(e)
        for e, c in zip(self.p_edge.tolist(), self.p_col.tolist(), strict=True):
            touch.setdefault(c, set()).add(e)
        # per owning block: its columns, the entries of its edges
        u_order, p_order = np.argsort(self.u_edge, kind="stable"), np.argsort(self.p_edge)
        u_start = np.searchsorted(self.u_edge[u_order], np.arange(n_edges + 1))
        p_start = np.searchsorted(self.p_edge[p_order], np.arange(n_edges + 1))
        self.local: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for b, w in enumerate(model.widths):
            if model.rep[b] != b or w < 2:
                continue
            lo = int(model.offsets[b])
            edges = sorted({e for c in range(lo, lo + w) for e in touch.get(c, ())})
            eidx = np.array(edges, dtype=np.int64)
            u = [u_order[u_start[e] : u_start[e + 1]] for e in edges]
            p = [p_order[p_start[e] : p_start[e + 1]] for e in edges]
            empty = np.zeros(0, dtype=np.int64)
            self.local[b] = (
                eidx,
                np.concatenate(u) if u else empty,
                np.concatenate(p) if p else empty,
            )

    def edges_price(self, chosen: np.ndarray, eidx: np.ndarray, ui: np.ndarray,
                    pi: np.ndarray) -> float:  # fmt: skip
        """The price of the edges ``eidx`` (entries ``ui``, ``pi``) under ``chosen``."""
        if not len(eidx):
            return 0.0
        pos = np.searchsorted(eidx, self.u_edge[ui])
        need = np.bincount(pos, weights=chosen[self.u_col[ui]], minlength=len(eidx)) > 0
        pos = np.searchsorted(eidx, self.p_edge[pi])
        w = chosen[self.p_col[pi]] * self.p_val[pi]
        return float(need @ np.bincount(pos, weights=w, minlength=len(eidx)))

    def total(self, chosen: np.ndarray) -> float:
        m = self.model
        need = np.bincount(self.u_edge, weights=chosen[self.u_col], minlength=self.n_edges) > 0
        price = np.bincount(
            self.p_edge, weights=chosen[self.p_col] * self.p_val, minlength=self.n_edges
        )
        return float(m.own @ chosen + need @ price)


def descend(
    model: Model, start: list[int], memory: float | None = None, time_limit: float = 10.0
) -> tuple[list[int], float]:
    """Greedy sweeps from ``start`` (see the module): the choice and its objective."""
    t0 = time.perf_counter()
    prices = Prices(model)
    choice = list(start)
    chosen = onehot(model, choice)
    # the bytes held at each peak row's node (``auto.memory``), within ``memory``
    peak = model.memory if memory is not None else None
    rows = np.array(peak.rows) if peak is not None and peak.rows else np.zeros((0, model.n_x))
    held = peak.held(chosen) if peak is not None and peak.rows else np.zeros(0)
    budget = float("inf") if memory is None else float(memory)
    changed = True
    while changed and time.perf_counter() - t0 < time_limit:
        changed = False
        for b, (eidx, ui, pi) in prices.local.items():
            if time.perf_counter() - t0 >= time_limit:
                break
            lo, w = int(model.offsets[b]), model.widths[b]
            now = choice[b]
            best_key, best_i = None, now
            for i in range(w):
                chosen[lo + now] = 0.0
                chosen[lo + i] = 1.0
                s = held - rows[:, lo + now] + rows[:, lo + i]
                key = (
                    max(0.0, float(s.max(initial=0.0)) - budget),
                    model.own[lo + i] + prices.edges_price(chosen, eidx, ui, pi),
                )
                chosen[lo + i] = 0.0
                chosen[lo + now] = 1.0
                if best_key is None or key < best_key:
                    best_key, best_i = key, i
            if best_i != now:
                cur = (
                    max(0.0, float(held.max(initial=0.0)) - budget),
                    model.own[lo + now] + prices.edges_price(chosen, eidx, ui, pi),
                )
                if best_key is not None and best_key < cur:
                    held = held + rows[:, lo + best_i] - rows[:, lo + now]
                    chosen[lo + now], chosen[lo + best_i] = 0.0, 1.0
                    choice[b] = best_i
                    changed = True
    for b in range(len(choice)):
        choice[b] = choice[model.rep[b]]
    return choice, prices.total(chosen)


def greedy_solve(
    model: Model,
    *,
    memory: float | None = None,
    time_limit: float = 30.0,
    start: list[int] | None = None,
    **_: object,
) -> Solution:
    """The solver without scipy: :func:`descend` from ``start`` (a preset's choice) or the
    all-replicated choice."""
    t0 = time.perf_counter()
    first = list(start) if start else [0] * len(model.widths)
    choice, objective = descend(model, first, memory, time_limit)
    rows = len(model.eq_rhs) + len(model.ub_rhs)
    over = memory is not None and model.memory is not None and model.memory.peak(choice)[0] > memory
    return Solution(
        choice, objective, float("nan"), float("nan"), False, "greedy", len(model.cost), rows,
        model.build_seconds, time.perf_counter() - t0,
        status="over the memory budget" if over else "local optimum",
    )  # fmt: skip


def objective_of(model: Model, choice: list[int]) -> float:
    """The model's objective of ``choice`` (its copies and reshards at their prices)."""
    return Prices(model).total(onehot(model, choice))


def onehot(model: Model, choice: list[int]) -> np.ndarray:
    """The x columns of ``choice`` as a 0/1 vector."""
    chosen = np.zeros(model.n_x)
    for b, i in enumerate(choice):
        if model.rep[b] == b and model.widths[b]:
            chosen[model.offsets[b] + i] = 1.0
    return chosen
