"""Rules of the scans that return indices: ``cummax`` and ``cummin`` (values, indices).

Decision: the scanned dim passes through with the mandatory ``handler="sharded_scan"``: split,
each device scans its tile and combines it with the running extreme of the tiles before it,
gathered as one value per tile (``partition/special/scan.py``); the generic per-tile lowering
alone would be wrong (every element depends on all before it, and the indices are global
positions). The other dims pass through. ``cumsum``, ``cumprod`` and ``logcumsumexp`` are
need-replication on the scanned dim in ``reduction.py``.
"""

from __future__ import annotations

from partita.rules.common import Names, aten_ops, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("scan")

__all__ = ["cum_extreme_rule"]


@RULES.register(*aten_ops(["cummax.default", "cummin.default"]))
def cum_extreme_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b, a b; handler=sharded_scan`` for ``cummax(x, 1)``."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    norm_dim(info.arg("dim"), x.ndim)  # validates the dim
    return build(info, [names], [names, names], handler=HandlerName.SHARDED_SCAN)
