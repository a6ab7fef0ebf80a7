"""The rule of partita's own annotation op: an identity on every dim.

The annotation's *result* carries the user's sharding and is never overwritten by propagation;
the rule lets that sharding flow backward into the operand (and forward from it, when the
operand is known first).
"""

from __future__ import annotations

import string

from partita.capture import ANNOTATE_OP
from partita.rules.factor import FactorRule, OpInfo, einsum_rule
from partita.rules.ruleset import RuleSet

RULES = RuleSet("annotate")


@RULES.register(ANNOTATE_OP)
def identity_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a b c`` for the annotated tensor (the op's only tensor operand)."""
    # Parsed form, not text: the text " -> " of a 0-d tensor would describe no tensors at all.
    factors = tuple((c,) for c in string.ascii_lowercase[: info.operands[0].ndim])
    return einsum_rule(((factors,), (factors,)), info.operands, info.results)
