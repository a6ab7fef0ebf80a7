"""Partial sums kept through linear ops (invariant 10 of ``partita.propagate``).

After the fixpoint, in program order: an op that ``propagate.linear`` says keeps its partial
operands' sum pending (``add`` of two partial sums, a view of one, a product with a replicated
factor), whose tensors have no split dim, gets a result partial over the same axes and whole
dims, and the assignment ``{}``. The sum is then reduced once, where a user needs it whole or
split, instead of once per operand: the weight gradient of a recurrent loop, the sum of one
partial gradient per time step, costs one reduction per sequence.

The pass runs after the fixpoint because a result's dims may come first from its users (the
optimizer update asks for the parameter's sharding), and refinement never turns a split value
back into a partial one. It changes no operand, so every other op's assignment stands; the
partitioner reshards each user's operand from the partial value, as from any other.
"""

from __future__ import annotations

import torch.fx as fx

from partita.propagate.linear import kept_partial
from partita.propagate.state import OpState, ProgramState

__all__ = ["keep_partial_sums"]


def keep_partial_sums(state: ProgramState) -> list[OpState]:
    """Make the result of every linear op on partial sums partial; the ops it changed."""
    values = state.values

    def look(a: fx.Node) -> tuple[tuple[str, ...], str, bool] | None:
        v = values.get(state.key(a))
        if v is None or v.banned or v.prefix is not None:
            return None  # untracked, or at a partially manual region: reduce as usual
        return v.partial, v.reduce_op, any(v.dims or ())

    changed = []
    for op in state.ops:
        if not op.rule.facts.linear or len(op.results) != 1 or op.results[0] is None:
            continue
        axes = kept_partial(op.node, op.rule, look)
        result = values[op.results[0]]
        if not axes or result.fixed or result.banned or result.prefix is not None:
            continue
        result.dims, result.partial, result.reduce_op = [()] * result.ndim, axes, "sum"
        changed.append(op)
    return changed
