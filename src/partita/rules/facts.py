"""What the stages must know about an op besides its factors: :class:`OpFacts`, a field of
every :class:`~partita.rules.factor.FactorRule`.

A family declares an op's facts next to its rule (``RULES.register(ops, facts=...)`` or
``RULES.declare(ops, facts)``, :mod:`partita.rules.ruleset`); the rule functions of the table
return their FactorRule with them. Propagation and partitioning read ``rule.facts`` and match
no op by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = ["NO_FACTS", "OpFacts", "SizeArg"]


class SizeArg(NamedTuple):
    """An int argument that is a size of an operand (group norm's ``N``): the local call gets
    the local size."""

    arg: int  # position of the int argument
    operand: int  # the operand whose size it is
    dim: int  # the operand's dim


@dataclass(frozen=True, slots=True)
class OpFacts:
    """Per-op facts of a local call.

    Attributes:
        same_dtype: the op's floating operands must share one dtype (no type promotion); the
            partitioner checks it, since tracing does not for every such op (mm, addmm, ...).
        shape_only: the op reads only its operand's shape and dtype (``zeros_like``): a partial
            operand need not be reduced first.
        index_operands: operands that hold indices (``gather``): their padding gets a valid
            index, 0.
        size_args: int arguments the local call gets as local sizes (:class:`SizeArg`).
        local_results: with ``handler="localize_shape"``, a result dim no operand has is
            produced tile by tile by localising the shape argument (``full``, ``expand``).
        values_from_index: the result's values are a function of their global index
            (``arange``): each tile is computed from its own offset (the ``localize_shape``
            handler's lowering).
        keeps_data: the result is the operand's data in another dtype or memory (``_to_copy``,
            ``clone``): a stored input stays stored through it (propagation, invariant 5).
        moves: which tensor a user collective in a partially manual body moves, for the Plan's
            record: its result (``all_gather``) or its operand (``reduce_scatter``).
        linear: how a partial sum stays partial through the op (``propagate.linear``): ``"addends"``
            when every tensor operand is an addend (``add``, ``sub``), ``"scaled"`` when it is
            linear in any one tensor operand and the others are factors (``mul``), ``"first"``
            when it is linear in its first operand (``div``, ``neg``, views, ``sum``); empty:
            a partial operand is reduced before the op.
    """

    same_dtype: bool = False
    shape_only: bool = False
    index_operands: tuple[int, ...] = ()
    size_args: tuple[SizeArg, ...] = ()
    local_results: bool = False
    values_from_index: bool = False
    keeps_data: bool = False
    moves: Literal["result", "operand"] = "result"
    linear: Literal["", "addends", "scaled", "first"] = ""


#: The facts of an op that has none of the above.
NO_FACTS = OpFacts()
