"""Rule look-up: the built-in table plus the rules a user registers.

Propagation and partitioning read rules only through :func:`get_rule`. ``partita.register_rule``
adds a rule for an op that has none (a custom op); registering an op that already has a rule
fails at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partita.rules.facts import NO_FACTS, OpFacts
from partita.rules.ruleset import RuleFn, flatten_ops, refuse_twice, with_facts
from partita.rules.table import FACTS, TABLE

__all__ = ["RuleFn", "facts_of", "get_rule", "has_rule", "register_rule", "registered_ops"]

_REGISTRY: dict[Any, RuleFn] = dict(TABLE)
_FACTS: dict[Any, OpFacts] = dict(FACTS)


def register_rule(*ops: Any, facts: OpFacts = NO_FACTS) -> Callable[[RuleFn], RuleFn]:
    """Register one rule function for one or more op overloads that have no rule yet
    (``facts``: the ops' :class:`~partita.rules.facts.OpFacts`, if any).

    Example:
        >>> @register_rule(mylib.scale_rows.default)   # doctest: +SKIP
        ... def scale_rows(info: OpInfo) -> FactorRule:
        ...     return einsum_rule("m n, m -> m n", info.operands, info.results)
    """

    def wrap(fn: RuleFn) -> RuleFn:
        for op in flatten_ops(ops):
            refuse_twice(_REGISTRY, op, fn)
            _REGISTRY[op] = fn if facts == NO_FACTS else with_facts(fn, facts)
            if facts != NO_FACTS:
                _FACTS[op] = facts
        return fn

    return wrap


def has_rule(op: Any) -> bool:
    return op in _REGISTRY


def get_rule(op: Any) -> RuleFn | None:
    """The rule function of an op, or None."""
    return _REGISTRY.get(op)


def registered_ops() -> tuple[Any, ...]:
    """Every op with a rule, sorted by name."""
    return tuple(sorted(_REGISTRY, key=str))


def facts_of(op: Any) -> OpFacts:
    """The op's facts (those its rule returns), also for an op run replicated."""
    return _FACTS.get(op, NO_FACTS)
