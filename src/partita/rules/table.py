"""The table of built-in rules: every family module, imported by name, merged into one map.

Adding a family means adding its module here (keep the tuple sorted). An op registered by two
families fails when this module is imported, naming both rule functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partita.rules import (
    annotate,
    attention,
    control_flow,
    conv,
    creation,
    elementwise,
    embedding,
    fft,
    grouped,
    indexing,
    linalg,
    loss,
    matmul,
    misc,
    norm,
    random,
    reduction,
    scan,
    shape,
    slicing,
)
from partita.rules.facts import OpFacts
from partita.rules.ruleset import RuleFn, RuleSet, refuse_twice

__all__ = ["FACTS", "FAMILIES", "TABLE", "build_table"]

#: Each family's rules, sorted by family name.
FAMILIES: tuple[RuleSet, ...] = (
    annotate.RULES,
    attention.RULES,
    control_flow.RULES,
    conv.RULES,
    creation.RULES,
    elementwise.RULES,
    embedding.RULES,
    fft.RULES,
    grouped.RULES,
    indexing.RULES,
    linalg.RULES,
    loss.RULES,
    matmul.RULES,
    misc.RULES,
    norm.RULES,
    random.RULES,
    reduction.RULES,
    scan.RULES,
    shape.RULES,
    slicing.RULES,
)


def build_table(families: tuple[RuleSet, ...]) -> dict[Any, RuleFn]:
    """op -> rule function over every family; an op in two families fails."""
    table: dict[Any, RuleFn] = {}
    for family in families:
        for op, fn in family.items():
            refuse_twice(table, op, fn)
            table[op] = fn
    return table


TABLE: Mapping[Any, RuleFn] = build_table(FAMILIES)
#: op -> its OpFacts, for the ops that have some.
FACTS: Mapping[Any, OpFacts] = {op: facts for family in FAMILIES for op, facts in family.facts()}
