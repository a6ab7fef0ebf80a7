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
    recurrent loop are not each reduce-scattered, only their total is. That only pays where
    such a sum reaches, through kept linear ops, an ``add`` or ``sub`` of two sums (two
    reductions become one): a dry run finds those ops, and only they take such operands.
    Through a view or a scale alone the sum would be reduced once all the same, only later
    (after the transpose on the way to the optimizer, whose reduce_scatter then no longer
    overlaps the backward, and whose gradient is alive whole until the optimizer)."""
    allowed: frozenset[fx.Node] = frozenset()
    if natural is not None:
        allowed = _justified(_keep(state, natural, None))
    return [op for op, _, _ in _keep(state, natural, allowed)]


#: One op the pass changed: the op, the candidate operands it made partial sums, and its
#: operands that are the results of earlier changed ops.
_Change = tuple[OpState, frozenset[fx.Node], frozenset[fx.Node]]


def _keep(
    state: ProgramState, natural: Natural | None, allowed: frozenset[fx.Node] | None
) -> list[_Change]:
    """One pass in program order. ``allowed is None``: a dry run, every op may take candidate
    operands and nothing is written; else only the ops in ``allowed`` may, and the values are
    written."""
    values = state.values
    dry = allowed is None
    overlay: dict[object, tuple[tuple[str, ...], str, bool]] = {}
    producers = {op.node: op for op in state.ops if len(op.results) == 1}
    candidates: dict[fx.Node, tuple[str, ...]] = {}
    use_natural = False

    def look(a: fx.Node) -> tuple[tuple[str, ...], str, bool] | None:
        key = state.key(a)
        v = values.get(key)
        if v is None or v.banned or v.prefix is not None:
            return None  # untracked, or at a partially manual region: reduce as usual
        if key in overlay:
            return overlay[key]
        split = any(v.dims or ())
        if split and use_natural and not v.fixed and not v.partial and len(a.users) == 1:
            axes = _whole_partial(producers.get(a), natural)
            if axes:
                candidates[a] = axes
                return axes, "sum", False
        return v.partial, v.reduce_op, split

    changed: list[_Change] = []
    results: set[fx.Node] = set()
    for op in state.ops:
        if not op.rule.facts.linear or len(op.results) != 1 or op.results[0] is None:
            continue
        candidates.clear()
        use_natural = natural is not None and (dry or op.node in (allowed or ()))
        axes = kept_partial(op.node, op.rule, look)
        result = values[op.results[0]]
        if not axes or result.fixed or result.banned or result.prefix is not None:
            continue
        if any(result.dims or ()) and _is_output(op.node):
            continue  # a returned gradient keeps the sharding its users gave it
        inputs = frozenset(a for a in op.node.args if isinstance(a, fx.Node) and a in results)
        changed.append((op, frozenset(candidates), inputs))
        results.add(op.node)
        if dry:
            for a, a_axes in candidates.items():
                overlay[state.key(a)] = (a_axes, "sum", False)
            overlay[op.results[0]] = (axes, "sum", False)
            continue
        for a, a_axes in candidates.items():
            v = values[state.key(a)]
            v.dims, v.partial, v.reduce_op = [()] * v.ndim, a_axes, "sum"
        result.dims, result.partial, result.reduce_op = [()] * result.ndim, axes, "sum"
    return changed


def _justified(changed: list[_Change]) -> frozenset[fx.Node]:
    """The changed ops (of a dry run) a candidate's sum reaches that lead to an ``add`` or
    ``sub`` of two sums: those, and only those, take candidate operands."""
    by_node = {op.node: (op, cands, inputs) for op, cands, inputs in changed}
    derived: set[fx.Node] = set()
    for op, cands, inputs in changed:  # program order: inputs come first
        if cands or inputs & derived:
            derived.add(op.node)
    todo = [
        op.node for op, _, _ in changed if op.node in derived and op.rule.facts.linear == "addends"
    ]
    keep: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in keep:
            continue
        keep.add(node)
        todo.extend(i for i in by_node[node][2] if i in derived)
    return frozenset(keep)


def _whole_partial(producer: OpState | None, natural: Natural | None) -> tuple[str, ...]:
    """The axes ``producer`` leaves its result a whole-dims partial sum over, or ``()``."""
    if producer is None or natural is None or producer.rule.reduce_op != "sum":
        return ()
    found = natural(producer)
    if found is None:
        return ()
    dims, partial = found
    return () if any(dims) else partial


def _is_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)
