"""What a family module registers its rules into: a :class:`RuleSet`, one per family.

A family declares ``RULES = RuleSet("matmul")`` and decorates each rule function with
``@RULES.register(aten.mm.default)``, with the op's :class:`~partita.rules.facts.OpFacts`
(``facts=``) or, for some ops of a group, ``RULES.declare(ops, facts)``: the rule functions
it hands out return their FactorRule with the op's facts. A RuleSet only collects: the table
of every family (:mod:`partita.rules.table`) merges them, and :mod:`partita.rules.registry`
looks rules up. Nothing here imports a family or the ``partita.rules`` package, so no family
imports back into what imports it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from partita.errors import CompilerError
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import NO_FACTS, OpFacts

__all__ = ["RuleFn", "RuleSet", "flatten_ops", "refuse_twice", "with_facts"]

RuleFn = Callable[[OpInfo], FactorRule]


class RuleSet:
    """The rules of one family, op -> rule function, in registration order."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._rules: dict[Any, RuleFn] = {}
        self._facts: dict[Any, OpFacts] = {}

    def register(self, *ops: Any, facts: OpFacts = NO_FACTS) -> Callable[[RuleFn], RuleFn]:
        """Decorate a rule function with the ops (or sorted tuples of ops) it covers, and
        their facts."""

        def wrap(fn: RuleFn) -> RuleFn:
            for op in flatten_ops(ops):
                refuse_twice(self._rules, op, fn)
                self._rules[op] = fn
            if facts != NO_FACTS:
                self.declare(ops, facts)
            return fn

        return wrap

    def declare(self, ops: Iterable[Any], facts: OpFacts) -> None:
        """Give ``ops`` (some ops of one or more registrations) their facts, once."""
        for op in flatten_ops(ops):
            if op in self._facts:
                raise CompilerError(
                    f"op {op} is given its OpFacts twice in the {self.family} rules "
                    f"({self._facts[op]} and {facts}). Declare each op's facts once, in one "
                    f"OpFacts."
                )
            self._facts[op] = facts

    def items(self) -> Iterator[tuple[Any, RuleFn]]:
        """(op, rule function); a function returns its FactorRule with the op's facts."""
        for op, fn in self._rules.items():
            facts = self._facts.get(op, NO_FACTS)
            yield op, fn if facts == NO_FACTS else with_facts(fn, facts)

    def facts(self) -> Iterator[tuple[Any, OpFacts]]:
        """(op, facts) of every op with facts; each has a rule here."""
        for op, facts in self._facts.items():
            if op not in self._rules:
                raise CompilerError(
                    f"op {op} is given OpFacts in the {self.family} rules but has no rule "
                    f"there. Declare the facts next to the op's rule, in the family that "
                    f"registers it."
                )
            yield op, facts

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


@functools.cache
def with_facts(fn: RuleFn, facts: OpFacts) -> RuleFn:
    """``fn`` returning its FactorRule with ``facts`` (one function per pair)."""

    @functools.wraps(fn)
    def rule(info: OpInfo) -> FactorRule:
        return dataclasses.replace(fn(info), facts=facts)

    return rule
