"""The integer program of :mod:`partita.auto.ilp` solved with HiGHS (scipy).

:func:`solve` solves the LP relaxation first (``linprog(method="highs")``); when it is
integral on ``x`` it is the optimum with a certified gap of 0. Else a MILP (integral ``x``)
runs with a time limit and a relative gap of 1 %, from a starting incumbent when one is given
(a preset's plan, ``auto.start``).

``scipy.optimize.milp`` takes no starting point. scipy ships HiGHS's own Python bindings
(``scipy.optimize._highspy._core``, the ``highspy`` API); with them the model is passed as
``milp`` passes it and a feasible solution is handed to HiGHS (``setSolution``) before it
runs, so its branch and bound starts with that incumbent and prunes against it. When the
bindings are missing (an older or newer scipy that moved them) :func:`milp_with_start`
returns None and the caller runs ``milp`` without the start (keeping the start itself when it
is cheaper).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from partita.auto.ilp import MIP_GAP, Model, Solution

__all__ = ["MilpResult", "milp_with_start", "solve"]


@dataclass
class MilpResult:
    """``x`` (None: no feasible point), its objective, HiGHS's dual bound and relative gap."""

    x: np.ndarray | None
    fun: float
    bound: float
    gap: float
    message: str


def _bindings() -> Any:
    try:
        from scipy.optimize._highspy import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
            _core,
        )
    except ImportError:
        return None
    needed = ("_Highs", "HighsLp", "HighsSolution", "HighsVarType", "MatrixFormat")
    return _core if all(hasattr(_core, n) for n in needed) else None


def milp_with_start(
    cost: np.ndarray,
    a: Any,
    lower: np.ndarray,
    upper: np.ndarray,
    integral: np.ndarray,
    start: np.ndarray,
    time_limit: float,
    rel_gap: float,
) -> MilpResult | None:
    """min ``cost @ x`` over ``lower <= a @ x <= upper``, ``0 <= x <= 1``, ``x`` integral
    where ``integral``, from the feasible ``start``; None without HiGHS's bindings."""
    h = _bindings()
    if h is None:
        return None
    csc = a.tocsc()
    n, m = len(cost), csc.shape[0]
    lp = h.HighsLp()
    lp.num_col_, lp.num_row_ = n, m
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
    lp.a_matrix_.format_ = h.MatrixFormat.kColwise
    lp.col_cost_ = np.asarray(cost, dtype=np.float64)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.ones(n)
    lp.row_lower_ = np.asarray(lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(upper, dtype=np.float64)
    lp.a_matrix_.start_ = csc.indptr.astype(np.int32)
    lp.a_matrix_.index_ = csc.indices.astype(np.int32)
    lp.a_matrix_.value_ = csc.data.astype(np.float64)
    lp.integrality_ = [h.HighsVarType(int(i)) for i in integral]
    highs = h._Highs()
    for key, value in (
        ("output_flag", False),
        ("time_limit", float(time_limit)),
        ("mip_rel_gap", float(rel_gap)),
    ):
        highs.setOptionValue(key, value)
    if highs.passModel(lp) == h.HighsStatus.kError:
        return None
    sol = h.HighsSolution()
    sol.col_value = np.asarray(start, dtype=np.float64)
    sol.value_valid = True
    highs.setSolution(sol)
    highs.run()
    info = highs.getInfo()
    status = highs.getModelStatus()
    message = highs.modelStatusToString(status)
    fun = float(info.objective_function_value)
    if not np.isfinite(fun) or abs(fun) >= 1e30:
        return MilpResult(None, float("inf"), float("inf"), float("inf"), message)
    x = np.array(highs.getSolution().col_value)
    return MilpResult(x, fun, float(info.mip_dual_bound), float(info.mip_gap), message)


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
    per-device bytes of the model's peak rows (``model.memory``), ``compute`` the modelled
    compute seconds. ``start``: a choice per
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
    bounded: list[tuple[np.ndarray, float]] = []
    if memory is not None:  # the bytes held at each peak row's node, within the budget
        assert model.memory is not None, "memory= needs the model's rows (ilp.add_memory)"
        peak = model.memory
        bounded += [(r, memory - c) for r, c in zip(peak.rows, peak.consts, strict=True)]
    if compute is not None:
        bounded.append((model.compute, compute))
    for vec, bound in bounded:
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
    extra = {"lp_objective": float(lp.fun)}
    x = lp.x[: model.n_x]
    integral = bool(np.all(np.minimum(np.abs(x), np.abs(1 - x)) < 1e-6))
    if integral:
        choice = _decode(model, lp.x)
        return Solution(
            choice, float(lp.fun), float(lp.fun), 0.0, True, "highs-lp", n, rows,
            model.build_seconds, time.perf_counter() - t0, status="optimal", extra=extra,
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
            extra=extra,
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
        model.build_seconds, time.perf_counter() - t0, status=str(res.message), extra=extra,
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
