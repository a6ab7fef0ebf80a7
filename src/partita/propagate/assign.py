"""Choosing one op's factor assignment from what its tensors propose (invariants 4 to 8).

Every tensor of the op that already has a sharding proposes, for each factor of each of its
dims, the mesh axes that dim carries (a compound dim's axes are split over its factors, major
first). :func:`choose_assignment` picks one proposal per factor (best priority, then larger
tensor, then earlier tensor; extended by a proposal that only adds axes the winning operand is
a partial sum over, so that it is reduce-scattered rather than all-reduced), lets factors
claim mesh axes in rank order (one factor per mesh axis; priority, then factors a computed
operand proposes before those only stored values or results propose, then support), moves
axes proposed for need-replication factors to a free factor, moves a minor factor's axes to a
whole major factor (invariant 6), and returns ``{factor: mesh axes}`` with each factor's
priority. :func:`merge_axes` turns an assignment back into the mesh axes of one dim.

This module reads the propagation state; it never changes it (``partita.propagate`` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from partita.propagate.state import OpState, ValueKey, ValueState
from partita.rules import FactorKind
from partita.values.mesh import Mesh

__all__ = ["choose_assignment", "merge_axes", "split_axes"]

# (priority, -numel, order, mesh axes, proposed by a computed operand, its partial axes)
Proposal = tuple[int, int, int, tuple[str, ...], bool, tuple[str, ...]]
# (priority, no computed operand proposes, -support, rank, factor, mesh axes)
Ranked = tuple[int, bool, int, int, str, tuple[str, ...]]


def split_axes(
    mesh: Mesh, axes: Sequence[str], dim: tuple[str, ...], sizes: Any
) -> dict[str, tuple[str, ...]]:
    """Distribute a dim's mesh axes over its factors, major first (invariant 6)."""
    if len(dim) == 1:
        return {dim[0]: tuple(axes)}
    out: dict[str, tuple[str, ...]] = {}
    i, used = 0, 1
    for a in axes:
        n = mesh.axis_size(a)
        while i < len(dim) and used == sizes[dim[i]]:
            i, used = i + 1, 1
        if i == len(dim) or sizes[dim[i]] % (used * n):
            break
        out[dim[i]] = (*out.get(dim[i], ()), a)
        used *= n
    return out


def merge_axes(
    mesh: Mesh, dim: tuple[str, ...], assign: dict[str, tuple[str, ...]], sizes: Any
) -> tuple[str, ...]:
    """The mesh axes of a dim under ``assign``: its factors' axes, major first, up to the first
    factor that is not fully split (invariant 6: ``(i j)`` with ``i`` over 2 of its 4 gives
    only ``i``'s axes)."""
    axes: list[str] = []
    for f in dim:
        fa = assign.get(f, ())
        axes.extend(fa)
        if mesh.axes_size(fa) != sizes[f]:
            break
    return tuple(axes)


def choose_assignment(
    mesh: Mesh, values: Mapping[ValueKey, ValueState], op: OpState, round_priority: int
) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """``({factor: mesh axes}, {factor: priority})`` for ``op`` from the proposals of the
    values whose priority is at most ``round_priority`` (invariants 4, 5 and 8)."""
    rule = op.rule
    proposals: dict[str, list[Proposal]] = {}
    order = 0
    n_operands = len(rule.operands)
    for factors, key in zip(
        (*rule.operands, *rule.results), (*op.operands, *op.results), strict=True
    ):
        order += 1
        if factors is None or key is None:
            continue
        v = values[key]
        if v.dims is None or v.priority > round_priority:
            continue
        for dim_axes, dim in zip(v.dims, factors, strict=True):
            if not dim_axes or not dim:
                continue
            for f, fa in split_axes(mesh, dim_axes, dim, rule.sizes).items():
                if fa:
                    proposals.setdefault(f, []).append(
                        (
                            v.priority,
                            -v.numel,
                            order,
                            fa,
                            order <= n_operands and not v.stored,
                            _sole_partial(key, v) if order <= n_operands else (),
                        )
                    )
    best: list[Ranked] = []
    for rank, f in enumerate(rule.factors):
        props = proposals.get(f)
        if not props or rule.sizes[f] <= 1 or rule.kind(f) is FactorKind.NEED_REPLICATION:
            continue
        prio, _, _, axes, _, _ = min(props)
        axes = _scatter_partial(props, prio, axes)
        backers = [p for p in props if p[3] == axes]
        support = sum(-p[1] for p in backers)
        no_activation = not any(p[4] for p in backers)
        best.append((prio, no_activation, -support, rank, f, axes))
    assign: dict[str, tuple[str, ...]] = {}
    prio_of: dict[str, int] = {}
    taken: set[str] = set()
    ranked = sorted(best)
    # Factors the operands carry claim axes first, then need-replication axes move
    # (invariant 9), then factors only the results have (they are computed whole).
    late = op.result_only | op.weak
    _claim(mesh, op, [b for b in ranked if b[4] not in late], assign, prio_of, taken)
    _move_replicated_axes(mesh, op, proposals, assign, prio_of, taken)
    _claim(mesh, op, [b for b in ranked if b[4] in op.weak], assign, prio_of, taken)
    _claim(mesh, op, [b for b in ranked if b[4] in op.result_only], assign, prio_of, taken)
    _move_minor_axes(mesh, op, assign, prio_of)
    return assign, prio_of


def _sole_partial(key: ValueKey, v: ValueState) -> tuple[str, ...]:
    """The axes ``v`` is a partial sum over, if this op is its only reader (else ``()``)."""
    node, index = key
    return v.partial if index is None and len(node.users) == 1 else ()


def _scatter_partial(props: list[Proposal], prio: int, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes a factor takes: the winning proposal's, or a same-priority proposal that
    extends them by axes only, all of which the winning operand is a partial sum over (and
    this op its only reader). That operand is then reduce-scattered onto the longer split
    where it would have been all-reduced whole and then cut by a later reader: the
    propagation's form of XLA's reduce-scatter creator (an all-reduce whose result is only
    sliced becomes a reduce-scatter). A row-parallel matmul whose result an annotation wants
    split over the batch and the model axis (sequence parallelism's layout) is the case."""
    partial = {a for p in props if p[3] == axes for a in p[5]}
    if not partial:
        return axes
    for p in sorted(props):
        extra = p[3][len(axes) :]
        if p[0] == prio and p[3][: len(axes)] == axes and extra and set(extra) <= partial:
            return p[3]
    return axes


def _claim(
    mesh: Mesh,
    op: OpState,
    ranked: list[Ranked],
    assign: dict[str, tuple[str, ...]],
    prio_of: dict[str, int],
    taken: set[str],
) -> None:
    """Invariant 5: factors take their axes in rank order, up to the first taken axis."""
    rule = op.rule
    for prio, _, _, _, f, axes in ranked:
        keep: list[str] = []
        for a in axes:
            if a in taken:
                break
            keep.append(a)
        if f in op.compound:
            while keep and rule.sizes[f] % mesh.axes_size(keep):
                keep.pop()
        if keep:
            assign[f] = tuple(keep)
            prio_of[f] = prio
            taken.update(keep)


def _move_replicated_axes(
    mesh: Mesh,
    op: OpState,
    proposals: dict[str, list[Proposal]],
    assign: dict[str, tuple[str, ...]],
    prio_of: dict[str, int],
    taken: set[str],
) -> None:
    """Invariant 9: axes proposed for a need-replication factor move to a free factor."""
    rule = op.rule
    for f in rule.factors:
        props = proposals.get(f)
        if not props or rule.kind(f) is not FactorKind.NEED_REPLICATION:
            continue
        prio, _, _, axes, _, _ = min(props)
        keep: list[str] = []
        for a in axes:
            if a in taken:
                break
            keep.append(a)
        if not keep:
            continue
        n = mesh.axes_size(keep)
        for g in op.free:
            if g not in assign and rule.sizes[g] % n == 0:
                assign[g] = tuple(keep)
                prio_of[g] = prio
                taken.update(keep)
                break


def _move_minor_axes(
    mesh: Mesh, op: OpState, assign: dict[str, tuple[str, ...]], prio_of: dict[str, int]
) -> None:
    """Invariant 6: the axes of a compound dim's minor factor whose major factor has none
    move to the major factor, when its size allows, if the op's result is computed on.

    ``[T, B, E] -> [T*B, E]`` with ``B`` split: a block of ``T*B`` rows cannot hold a slice of
    every ``T``, so the minor split is lost and the merged value, and every op computing on
    it, would be whole on every device. Splitting ``T`` instead costs one all_to_all of the
    operand and keeps the work split. A reshape whose result is only the program's output
    keeps the whole value (XLA's free-output choice, canonical case T20)."""
    if not op.compound or not any(u.op == "call_function" for u in op.node.users):
        return
    rule = op.rule
    for t in (*rule.operands, *rule.results):
        for dim in t or ():
            for major, minor in itertools.pairwise(dim):
                axes = assign.get(minor)
                if not axes or assign.get(major) or rule.kind(major) is FactorKind.NEED_REPLICATION:
                    continue
                if rule.sizes[major] % mesh.axes_size(axes):
                    continue
                assign[major] = assign.pop(minor)
                prio_of[major] = prio_of.pop(minor)
