"""Rules of distance and lookup ops: ``cdist``, ``pdist``, ``dist``, ``bucketize``,
``searchsorted``, ``_trilinear``.

Decisions: a distance sums a *p*-th power over the feature dim and takes a root, which is not a
sum of per-shard distances, so the feature dim is need-replication; the points of ``cdist``
pass through (each output entry pairs one point of each side). ``bucketize`` looks every
element up in the whole boundary vector: the elements pass through like an elementwise op, the
boundaries are gathered. ``pdist`` (pairs of rows, flattened) and ``_trilinear`` (a fused
bilinear form with index lists) are gathered whole and computed replicated.
"""

from __future__ import annotations

from partita.rules import register_rule
from partita.rules.batched import batched_rule
from partita.rules.common import Dim, Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo

__all__ = ["bucketize_rule", "cdist_rule", "gathered_rule"]


@register_rule(*aten_ops(["_cdist_forward.default"]))
def cdist_rule(info: OpInfo) -> FactorRule:
    """``a p m, a r n -> a p r; need-replication=m,n`` for ``cdist(x1, x2)`` (batch ``a``)."""
    x1, x2 = info.operands
    if x1.ndim != x2.ndim or tuple(x1.shape[:-2]) != tuple(x2.shape[:-2]):
        return batched_rule(info, [2, 2], [2])
    fresh = Names()
    batch = fresh.take(x1.ndim - 2)
    p, m, r, n = fresh.take(4)
    return build(
        info,
        [[*batch, p, m], [*batch, r, n]],
        [[*batch, p, r]],
        need_replication=[m, n],
    )


@register_rule(*aten_ops(["_pdist_forward.default", "_trilinear.default", "dist.default"]))
def gathered_rule(info: OpInfo) -> FactorRule:
    """``*, * -> 1``: every operand gathered, the result computed whole and kept replicated."""
    results = [None if r is None else [None] * r.ndim for r in info.results]
    return build(info, [None] * len(info.operands), results)


@register_rule(*aten_ops(["bucketize.Tensor"]))
def bucketize_rule(info: OpInfo) -> FactorRule:
    """``a b, c -> a b; need-replication=c`` for ``bucketize(x, boundaries)``."""
    x, boundaries = info.operands
    fresh = Names()
    names = fresh.take(x.ndim)
    b = fresh.take(boundaries.ndim)
    return build(info, [names, b], [names], need_replication=b)


@register_rule(*aten_ops(["searchsorted.Tensor"]))
def searchsorted_rule(info: OpInfo) -> FactorRule:
    """``c, a b -> a b; need-replication=c`` for a 1-d sorted sequence; with a batch of
    sequences (``a c, a b -> a b``) the leading dims pass through and the last ones are
    gathered."""
    seq, x = info.operands[0], info.operands[1]
    fresh = Names()
    if seq.ndim == 1:
        names = fresh.take(x.ndim)
        c = fresh.new()
        rest: list[list[Dim] | None] = [None] * (len(info.operands) - 2)
        return build(info, [[c], names, *rest], [names], need_replication=[c])
    return batched_rule(info, [1] * len(info.operands), [1])
