"""Rules of embedding lookups: ``embedding``, ``embedding_dense_backward`` and ``nn.EmbeddingBag``'s
``_embedding_bag`` with its backwards.

The table's vocabulary dim is a reduction factor with ``handler="masked_embedding"``: with the
table sharded by rows, each device looks up the ids that fall in its rows (the others read
row 0 and are masked to zero), so the result is a partial sum over the vocabulary's mesh axes
(canonical T24: masked local lookup, all_reduce). In the backward the vocabulary dim is a
result-only factor: a device accumulates only the gradients of its own rows (the same masking).
The ids' dims pass through to the looked-up rows and are summed away in the backward.

``_embedding_bag`` reduces (sum, mean, max) the rows of each bag, the bags given by *global*
positions in ``offsets``; only the embedding dim passes through (each column is reduced on its
own, so a table split by columns needs no communication). The vocabulary, the ids, the offsets
and the bags are gathered, and the bag dim of the result is replicated.
"""

from __future__ import annotations

from partita.rules.common import Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("embedding")

__all__ = [
    "embedding_backward_rule",
    "embedding_bag_backward_rule",
    "embedding_bag_rule",
    "embedding_bag_weights_backward_rule",
    "embedding_rule",
]


@RULES.register(*aten_ops(["embedding.default"]))
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


@RULES.register(*aten_ops(["embedding_dense_backward.default"]))
def embedding_backward_rule(info: OpInfo) -> FactorRule:
    """``c d b, c d -> a b; reduction=c,d; handler=masked_embedding``.

    With ``scale_grad_by_freq`` each row's gradient is divided by how often its id occurs in
    the *whole* batch: the ids and the gradient are gathered and the table's rows kept whole
    (a split batch would count its own ids, and the masked lookup would count every foreign id
    as row 0); only the embedding dim ``b`` passes through.
    """
    _, ids = info.operands
    fresh = Names()
    v, d = fresh.take(2)
    idx = fresh.take(ids.ndim)
    if info.arg("scale_grad_by_freq", False):
        return build(info, [[*idx, d], idx], [[v, d]], need_replication=[*idx, v])
    return build(
        info, [[*idx, d], idx], [[v, d]], reduction=idx, handler=HandlerName.MASKED_EMBEDDING
    )


def _bag_operands(info: OpInfo, d: str, fresh: Names, with_d: dict[int, int]) -> list[list[str]]:
    """Every operand's dims as fresh (gathered) factors, except ``with_d`` (operand -> dim),
    which carry the embedding dim ``d`` when the tensor is 2-d (``maximum_indices`` of a max
    bag is ``[bags, D]``, else ``[bags]``)."""
    out = []
    for i, m in enumerate(info.operands):
        names = fresh.take(m.ndim)
        if i in with_d and m.ndim == 2:
            names[with_d[i]] = d
        out.append(names)
    return out


def _gathered(operands: list[list[str]], d: str) -> list[str]:
    return [n for names in operands for n in names if n != d]


@RULES.register(*aten_ops(["_embedding_bag.default"]))
def embedding_bag_rule(info: OpInfo) -> FactorRule:
    """``a b, c, e, f -> 1 b, 1, 1, 1 b; need-replication=a,c,e,f`` (table [V, D], ids, offsets,
    per-sample weights): the embedding dim ``b`` passes through to the bags (and to the
    ``[bags, D]`` argmax of a max bag)."""
    fresh = Names()
    d = fresh.new()
    ops = _bag_operands(info, d, fresh, {0: 1})
    res: list[list[str | None] | None] = []
    for r in info.results:  # offset2bag, bag sizes and a [bags] argmax: replicated
        res.append(None if r is None else [None, d] if r.ndim == 2 else [None] * r.ndim)
    return build(info, ops, res, need_replication=_gathered(ops, d))


@RULES.register(
    *aten_ops(["_embedding_bag_backward.default", "_embedding_bag_dense_backward.default"])
)
def embedding_bag_backward_rule(info: OpInfo) -> FactorRule:
    """``a b, c, e, f, g, h b -> 1 b; need-replication=a,c,e,f,g,h``: the gradient of the table
    ``[V, D]`` from the bags' gradient ``[bags, D]`` (and the argmax ``[bags, D]`` of a max
    bag); the embedding dim passes through."""
    fresh = Names()
    d = fresh.new()
    with_d = {i: 1 for i, m in enumerate(info.operands) if i == 0 or m.ndim == 2}
    ops = _bag_operands(info, d, fresh, with_d)
    return build(info, ops, [[None, d]], need_replication=_gathered(ops, d))


@RULES.register(*aten_ops(["_embedding_bag_per_sample_weights_backward.default"]))
def embedding_bag_weights_backward_rule(info: OpInfo) -> FactorRule:
    """``a b, c b, e, f, g -> 1; reduction=b; need-replication=a,c,e,f,g``: the gradient of
    each id's weight is the dot product of its row and its bag's gradient over the embedding
    dim, a partial sum when that dim is split."""
    fresh = Names()
    d = fresh.new()
    ops = _bag_operands(info, d, fresh, {0: 1, 1: 1})
    return build(info, ops, [[None]], reduction=d, need_replication=_gathered(ops, d))
