"""The rule of partita's own annotation op: an identity on every dim.

The annotation's *result* carries the user's sharding and is never overwritten by propagation;
the rule lets that sharding flow backward into the operand (and forward from it, when the
operand is known first).
"""

from __future__ import annotations

import string

from partita.rules import register_rule
from partita.rules.factor import FactorRule, OpInfo, einsum_rule


def identity_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a b c`` for the first operand and the single result."""
    (x,) = info.operands[:1]
    letters = " ".join(string.ascii_lowercase[: x.ndim])
    extra = ", *" * (len(info.operands) - 1)
    return einsum_rule(f"{letters}{extra} -> {letters}", info.operands, info.results)


def _annotate_op():
    import torch

    import partita.capture.annotate  # noqa: F401  (registers partita::annotate)

    return torch.ops.partita.annotate.default


try:
    register_rule(_annotate_op())(identity_rule)
except (ImportError, AttributeError):  # TODO(lead): remove once partita.capture.annotate lands
    pass
