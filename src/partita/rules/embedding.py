"""Rules of embedding lookups: ``embedding`` and ``embedding_dense_backward``.

The table's vocabulary dim is a reduction factor with ``handler="masked_embedding"``: with the
table sharded by rows, each device looks up the ids that fall in its rows (the others read
row 0 and are masked to zero), so the result is a partial sum over the vocabulary's mesh axes
(canonical T24: masked local lookup, all_reduce). In the backward the vocabulary dim is a
result-only factor: a device accumulates only the gradients of its own rows (the same masking).
The ids' dims pass through to the looked-up rows and are summed away in the backward.
"""

from __future__ import annotations

from partita.rules import register_rule
from partita.rules.common import Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.handler_names import HandlerName

__all__ = ["embedding_backward_rule", "embedding_rule"]


@register_rule(*aten_ops(["embedding.default"]))
def embedding_rule(info: OpInfo) -> FactorRule:
    """``a b, c d -> c d b; reduction=a; handler=masked_embedding`` (table [V, D], ids [N, T])."""
    weight, ids = info.operands
    if weight.ndim != 2:
        raise NotImplementedError(f"{info.target} with a {weight.ndim}-d table (want [V, D])")
    fresh = Names()
    v, d = fresh.take(2)
    idx = fresh.take(ids.ndim)
    return build(
        info, [[v, d], idx], [[*idx, d]], reduction=v, handler=HandlerName.MASKED_EMBEDDING
    )


@register_rule(*aten_ops(["embedding_dense_backward.default"]))
def embedding_backward_rule(info: OpInfo) -> FactorRule:
    """``c d b, c d -> a b; reduction=c,d; handler=masked_embedding``."""
    _, ids = info.operands
    fresh = Names()
    v, d = fresh.take(2)
    idx = fresh.take(ids.ndim)
    return build(
        info, [[*idx, d], idx], [[v, d]], reduction=idx, handler=HandlerName.MASKED_EMBEDDING
    )
