"""THE registry of per-op sharding rules.

Every op partita can shard has exactly one rule function. A family module (``matmul.py``,
``norm.py``, ...) collects its rules in a :class:`~partita.rules.ruleset.RuleSet` with
``@RULES.register(aten.mm.default)``; :mod:`partita.rules.table` imports each family by name and
merges them into one table; :mod:`partita.rules.registry` looks rules up and takes the rules a
user adds with ``partita.register_rule``. An op registered twice fails at import. A rule
function takes an :class:`~partita.rules.factor.OpInfo` and returns a
:class:`~partita.rules.factor.FactorRule`.

Propagation and partitioning read rules only through :func:`get_rule`.
"""

from __future__ import annotations

from partita.rules.factor import FactorKind, FactorRule, OpInfo, TensorMeta, einsum_rule
from partita.rules.handler_names import HandlerName
from partita.rules.registry import get_rule, has_rule, register_rule, registered_ops
from partita.rules.ruleset import RuleFn

__all__ = [
    "FactorKind",
    "FactorRule",
    "HandlerName",
    "OpInfo",
    "RuleFn",
    "TensorMeta",
    "einsum_rule",
    "get_rule",
    "has_rule",
    "register_rule",
    "registered_ops",
]
