"""Rules of the scans that return indices: ``cummax`` and ``cummin`` (values, indices).

Decision: the scanned dim is need-replication (every element depends on all before it, and the
indices are global positions); the other dims pass through. ``cumsum``, ``cumprod`` and
``logcumsumexp`` have the same rule in ``reduction.py``. A sharded scan (a local scan plus an
exclusive prefix of the tiles' totals) is not written yet.
"""

from __future__ import annotations

from partita.rules import register_rule
from partita.rules.common import Names, aten_ops, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo

__all__ = ["cum_extreme_rule"]


@register_rule(*aten_ops(["cummax.default", "cummin.default"]))
def cum_extreme_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b, a b; need-replication=b`` for ``cummax(x, 1)``."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    rep = [names[norm_dim(info.arg(1, "dim"), x.ndim)]] if x.ndim else []
    return build(info, [names], [names, names], need_replication=rep)
