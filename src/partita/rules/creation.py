"""Rules of ops that create tensors: ``full``/``zeros``/``ones``/``empty``/``arange``/
``scalar_tensor`` (no tensor operands) and the ``*_like`` ops.

A creation op without operands has result-only pass-through factors, one per dim, and
``handler="localize_shape"``: each device creates only its tile, so the partitioner rewrites
the size argument to the local shape (and, for ``arange``, offsets ``start`` by the tile's
first global index). ``*_like`` ops take the shape of their operand, so they share its factors
like an elementwise op and need no handler. Random creation ops are in ``random.py``.
"""

from __future__ import annotations

from partita.rules.common import Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("creation")

__all__ = ["CREATION_OPS", "create_rule", "like_rule"]

CREATION_OPS = aten_ops(
    [
        "arange.default",
        "arange.start",
        "arange.start_step",
        "empty.memory_format",
        "empty_permuted.default",
        "empty_strided.default",
        "eye.default",
        "full.default",
        "new_empty.default",
        "new_empty_strided.default",
        "new_full.default",
        "new_ones.default",
        "new_zeros.default",
        "ones.default",
        "scalar_tensor.default",
        "zeros.default",
    ]
)


#: Every tile of their result is the same function of the local shape: a result dim no
#: operand has is produced tile by tile (eye's is not, nor the strided/permuted empties').
RULES.declare(
    aten_ops(["arange.default", "arange.start", "arange.start_step"]),
    OpFacts(local_results=True, values_from_index=True),
)
RULES.declare(
    aten_ops(
        [
            "empty.memory_format",
            "full.default",
            "new_empty.default",
            "new_full.default",
            "new_ones.default",
            "new_zeros.default",
            "ones.default",
            "scalar_tensor.default",
            "zeros.default",
        ]
    ),
    OpFacts(local_results=True),
)


@RULES.register(*CREATION_OPS)
def create_rule(info: OpInfo) -> FactorRule:
    """``* -> a b; handler=localize_shape`` for ``full([4, 8], 0.)`` (no operands) and
    ``new_zeros`` (whose operand only supplies a dtype, so it is not sharded)."""
    (out,) = info.results
    names = Names().take(out.ndim)
    if str(info.target).startswith("aten.eye"):
        return build(info, [], [names], need_replication=names, handler=HandlerName.LOCALIZE_SHAPE)
    return build(info, [None] * len(info.operands), [names], handler=HandlerName.LOCALIZE_SHAPE)


@RULES.register(
    *aten_ops(
        ["empty_like.default", "full_like.default", "ones_like.default", "zeros_like.default"]
    ),
    facts=OpFacts(shape_only=True),
)
def like_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b`` for ``zeros_like(x)``."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    return build(info, [names], [names])
