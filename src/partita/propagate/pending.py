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

from collections.abc import Callable

import torch.fx as fx

from partita.propagate.linear import kept_partial
from partita.propagate.state import OpState, ProgramState

__all__ = ["keep_partial_sums"]


#: The dims and partial axes an op's assignment gives its first result (``None``: none).
Natural = Callable[[OpState], "tuple[tuple[tuple[str, ...], ...], tuple[str, ...]] | None"]


def keep_partial_sums(state: ProgramState, natural: Natural | None = None) -> list[OpState]:
    """Make the result of every linear op on partial sums partial; the ops it changed.

    With ``natural``, an operand whose dims its users split (an FSDP gradient: the optimizer
    wants the parameter's shard) but which its producer computes as a whole-dims partial sum
    (a matmul or ``sum`` over the batch axis), and which has no other user, counts as that
    partial sum: it becomes one when the linear op keeps the sum, so the per-step addends of a
    recurrent loop are not each reduce-scattered, only their total is."""
    values = state.values
    producers = {op.node: op for op in state.ops if len(op.results) == 1}
    candidates: dict[fx.Node, tuple[str, ...]] = {}

    def look(a: fx.Node) -> tuple[tuple[str, ...], str, bool] | None:
        v = values.get(state.key(a))
        if v is None or v.banned or v.prefix is not None:
            return None  # untracked, or at a partially manual region: reduce as usual
        split = any(v.dims or ())
        if split and natural is not None and not v.fixed and not v.partial and len(a.users) == 1:
            axes = _whole_partial(producers.get(a), natural)
            if axes:
                candidates[a] = axes
                return axes, "sum", False
        return v.partial, v.reduce_op, split

    changed = []
    for op in state.ops:
        if not op.rule.facts.linear or len(op.results) != 1 or op.results[0] is None:
            continue
        candidates.clear()
        axes = kept_partial(op.node, op.rule, look)
        result = values[op.results[0]]
        if not axes or result.fixed or result.banned or result.prefix is not None:
            continue
        if any(result.dims or ()) and _is_output(op.node):
            continue  # a returned gradient keeps the sharding its users gave it
        for a, a_axes in candidates.items():
            v = values[state.key(a)]
            v.dims, v.partial, v.reduce_op = [()] * v.ndim, a_axes, "sum"
        result.dims, result.partial, result.reduce_op = [()] * result.ndim, axes, "sum"
        changed.append(op)
    return changed


def _whole_partial(producer: OpState | None, natural: Natural) -> tuple[str, ...]:
    """The axes ``producer`` leaves its result a whole-dims partial sum over, or ``()``."""
    if producer is None or producer.rule.reduce_op != "sum":
        return ()
    found = natural(producer)
    if found is None:
        return ()
    dims, partial = found
    return () if any(dims) else partial


def _is_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)
