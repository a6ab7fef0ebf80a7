"""A MILP solved by HiGHS with a starting incumbent.

``scipy.optimize.milp`` takes no starting point. scipy ships HiGHS's own Python bindings
(``scipy.optimize._highspy._core``, the ``highspy`` API); with them the model is passed as
``milp`` passes it and a feasible solution is handed to HiGHS (``setSolution``) before it
runs, so its branch and bound starts with that incumbent and prunes against it. When the
bindings are missing (an older or newer scipy that moved them) :func:`milp_with_start`
returns None and the caller runs ``milp`` without the start (keeping the start itself when it
is cheaper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MilpResult", "milp_with_start"]


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
