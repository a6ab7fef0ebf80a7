"""What a family module registers its rules into: a :class:`RuleSet`, one per family.

A family declares ``RULES = RuleSet("matmul")`` and decorates each rule function with
``@RULES.register(aten.mm.default)``. A RuleSet only collects: the table of every family
(:mod:`partita.rules.table`) merges them, and :mod:`partita.rules.registry` looks rules up.
Nothing here imports a family or the ``partita.rules`` package, so no family imports back into
what imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from partita.errors import CompilerError
from partita.rules.factor import FactorRule, OpInfo

__all__ = ["RuleFn", "RuleSet", "flatten_ops", "refuse_twice"]

RuleFn = Callable[[OpInfo], FactorRule]


class RuleSet:
    """The rules of one family, op -> rule function, in registration order."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._rules: dict[Any, RuleFn] = {}

    def register(self, *ops: Any) -> Callable[[RuleFn], RuleFn]:
        """Decorate a rule function with the ops (or sorted tuples of ops) it covers."""

        def wrap(fn: RuleFn) -> RuleFn:
            for op in flatten_ops(ops):
                refuse_twice(self._rules, op, fn)
                self._rules[op] = fn
            return fn

        return wrap

    def items(self) -> Iterator[tuple[Any, RuleFn]]:
        return iter(self._rules.items())

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"RuleSet({self.family!r}, {len(self._rules)} ops)"


def flatten_ops(ops: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        if isinstance(op, (tuple, list)):
            out.extend(flatten_ops(op))
        else:
            out.append(op)
    return out


def refuse_twice(rules: dict[Any, RuleFn], op: Any, fn: RuleFn) -> None:
    """Fail if ``op`` already has a rule in ``rules``: an op gets exactly one rule."""
    if op in rules:
        raise CompilerError(
            f"op {op} already has the sharding rule {rules[op].__module__}."
            f"{rules[op].__qualname__}; {fn.__module__}.{fn.__qualname__} would register it "
            f"twice. An op has exactly one rule: delete one registration, or change the "
            f"existing rule function."
        )
