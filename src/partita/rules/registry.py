"""Rule look-up: the built-in table plus the rules a user registers.

Propagation and partitioning read rules only through :func:`get_rule`. ``partita.register_rule``
adds a rule for an op that has none (a custom op); registering an op that already has a rule
fails at once. A rule may be registered under an op's name (``str(op)``,
``"transformers.grouped_mm_fallback.default"``): a library's op that exists only once the
library is imported; the look-up tries the op, then its name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from partita.rules.facts import NO_FACTS, OpFacts
from partita.rules.ruleset import Rule, RuleFn, flatten_ops, refuse_twice, with_facts
from partita.rules.table import FACTS, TABLE

__all__ = ["RuleFn", "facts_of", "get_rule", "has_rule", "register_rule", "registered_ops"]

_REGISTRY: dict[Any, RuleFn] = dict(TABLE)
_FACTS: dict[Any, OpFacts] = dict(FACTS)


def register_rule(*ops: Any, facts: OpFacts = NO_FACTS) -> Callable[[Rule], Rule]:
    """Register one rule function for one or more op overloads that have no rule yet
    (``facts``: the ops' :class:`~partita.rules.facts.OpFacts`, if any).

    Example:
        >>> @register_rule(mylib.scale_rows.default)   # doctest: +SKIP
        ... def scale_rows(info: OpInfo) -> FactorRule:
        ...     return einsum_rule("m n, m -> m n", info.operands, info.results)
    """

    def wrap(fn: Rule) -> Rule:
        for op in flatten_ops(ops):
            refuse_twice(_REGISTRY, op, fn)
            _REGISTRY[op] = fn if facts == NO_FACTS else with_facts(fn, facts)
            if facts != NO_FACTS:
                _FACTS[op] = facts
        return fn

    return wrap


def _key(op: Any) -> Any:
    """``op`` if it has a rule, else its name (a rule registered by name), else ``op``."""
    if op in _REGISTRY or isinstance(op, str):
        return op
    name = str(op) if isinstance(op, torch._ops.OpOverload) else None
    return name if name in _REGISTRY else op


def has_rule(op: Any) -> bool:
    return _key(op) in _REGISTRY


def get_rule(op: Any) -> RuleFn | None:
    """The rule function of an op, or None."""
    return _REGISTRY.get(_key(op))


def _resolve(name: str) -> Any:
    """The op a rule registered by name stands for, or None while its library is not loaded."""
    namespace, _, rest = name.partition(".")
    opname, _, overload = rest.partition(".")
    try:
        torch._C._get_schema(f"{namespace}::{opname}", "" if overload == "default" else overload)
        return getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError):
        return None


def registered_ops() -> tuple[Any, ...]:
    """Every op with a rule, sorted by name (an op registered by name once its library has
    registered it)."""
    ops = [op if not isinstance(op, str) else _resolve(op) for op in _REGISTRY]
    return tuple(sorted({op for op in ops if op is not None}, key=str))


def facts_of(op: Any) -> OpFacts:
    """The op's facts (those its rule returns), also for an op run replicated."""
    return _FACTS.get(_key(op), NO_FACTS)
