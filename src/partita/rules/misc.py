"""Rules of distance, lookup and whole-tensor ops: ``cdist`` (and its backward), ``pdist``,
``dist``, ``bucketize``, ``searchsorted``, ``index_reduce``, and the ops that are gathered whole
(``embedding_bag``, histograms, ``put``, ``resize`` to another shape, ``masked_scatter`` and
its backward, ``nonzero_static``, ``segment_reduce``, ``hash_tensor``, ``_trilinear``, the
backwards of the multi-class margin losses, whose forwards decompose; ``tril_indices`` and
``triu_indices``, which have no operands, are computed whole too).

Decisions: a distance sums a *p*-th power over the feature dim and takes a root, which is not a
sum of per-shard distances, so the feature dim is need-replication; the points of ``cdist``
pass through (each output entry pairs one point of each side), and its backward sums over the
other side's points (a reduction). ``bucketize`` looks every element up in the whole boundary
vector: the elements pass through like an elementwise op, the boundaries are gathered.
``index_reduce`` combines rows picked by a global index: the indexed dim and the index are
gathered, the other dims pass through. Ops whose every output element may depend on any input
element through global positions or counts (the bags of ``embedding_bag``, ``pdist``'s
flattened pairs, a histogram and its bin edges, ``put``'s flat indices, ``masked_scatter``'s
running count of ``True``s, ``nonzero_static``, segment reductions, a hash) are gathered whole
and computed replicated; the Plan records the gathers with the op as the reason.
"""

from __future__ import annotations

from partita.rules.batched import batched_rule
from partita.rules.common import Dim, Names, aten_ops, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("misc")

__all__ = [
    "bucketize_rule",
    "cdist_backward_rule",
    "cdist_rule",
    "gathered_rule",
    "index_reduce_rule",
    "resize_rule",
]


@RULES.register(*aten_ops(["_cdist_forward.default"]))
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


_GATHERED = aten_ops(
    [
        "_embedding_bag_forward_only.default",
        "_histogramdd_bin_edges.default",
        "_histogramdd_from_bin_cts.default",
        "_histogramdd_from_bin_tensors.default",
        "_pdist_forward.default",
        "_trilinear.default",
        "dist.default",
        "hash_tensor.default",
        "histogram.bin_ct",
        "histogram.bins_tensor",
        "masked_scatter.default",
        "masked_scatter_backward.default",
        "multi_margin_loss_backward.default",
        "multilabel_margin_loss_backward.default",
        "nonzero_static.default",
        "put.default",
        "segment_reduce.default",
        "tril_indices.default",
        "triu_indices.default",
    ]
)


@RULES.register(*_GATHERED)
def gathered_rule(info: OpInfo) -> FactorRule:
    """``*, * -> 1``: every operand gathered, the result computed whole and kept replicated."""
    results = [None if r is None else [None] * r.ndim for r in info.results]
    return build(info, [None] * len(info.operands), results)


@RULES.register(*aten_ops(["resize.default"]))
def resize_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; handler=localize_shape`` for ``resize(x, x.shape)`` (what
    ``x.resize_as_(y)`` traces to when the shapes agree: each tile keeps its local shape); to
    another shape the elements are re-read in storage order, so the operand
    is gathered whole and the result computed replicated (``*, -> 1``)."""
    (x,) = info.operands
    (out,) = info.results
    if tuple(out.shape) != tuple(x.shape):
        return gathered_rule(info)
    names = Names().take(x.ndim)
    return build(info, [names], [names], handler=HandlerName.LOCALIZE_SHAPE)


@RULES.register(*aten_ops(["bucketize.Tensor"]))
def bucketize_rule(info: OpInfo) -> FactorRule:
    """``a b, c -> a b; need-replication=c`` for ``bucketize(x, boundaries)``."""
    x, boundaries = info.operands
    fresh = Names()
    names = fresh.take(x.ndim)
    b = fresh.take(boundaries.ndim)
    return build(info, [names, b], [names], need_replication=b)


@RULES.register(*aten_ops(["searchsorted.Tensor"]))
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


@RULES.register(*aten_ops(["index_reduce.default"]))
def index_reduce_rule(info: OpInfo) -> FactorRule:
    """``a b, c, d b -> a b; need-replication=a,c,d`` for ``index_reduce(x, 0, idx, src, "amax")``:
    the indexed dim of ``x`` and ``src`` and the index are gathered; other dims pass through."""
    x = info.operands[0]
    d = norm_dim(info.arg("dim"), x.ndim)
    fresh = Names()
    names = fresh.take(x.ndim)
    k, src_k = fresh.new(), fresh.new()
    src: list[Dim] = list(names)
    if x.ndim:
        src[d] = src_k
    rep = [names[d], k, src_k] if x.ndim else [k]
    return build(info, [names, [k], src], [names], need_replication=rep)


@RULES.register(*aten_ops(["_cdist_backward.default"]))
def cdist_backward_rule(info: OpInfo) -> FactorRule:
    """``a p r, a p m, a r m, a p r -> a p m; reduction=r; need-replication=m``
    (grad, x1, x2, cdist -> grad_x1): the gradient of a point sums over the other side's."""
    x1, x2 = info.operands[1], info.operands[2]
    if x1.ndim != x2.ndim or tuple(x1.shape[:-2]) != tuple(x2.shape[:-2]):
        return batched_rule(info, [2, 2, 2, 2], [2])
    fresh = Names()
    batch = fresh.take(x1.ndim - 2)
    p, r, m = fresh.take(3)
    pr = [*batch, p, r]
    return build(
        info,
        [pr, [*batch, p, m], [*batch, r, m], pr],
        [[*batch, p, m]],
        reduction=[r],
        need_replication=[m],
    )
