"""Rules of reductions along dims: sum/mean/amax/amin/any/all, max/min/argmax, var/std,
median/kthvalue/mode, vector norms, softmax and log-softmax (and their backwards), cumsum,
sort and topk.

A reduced dim whose partial results combine with one collective is a *reduction* factor:
``sum`` and ``mean`` (``reduce_op="sum"``; mean carries ``handler="mean"`` because the local
op divides by the local count: the partitioner sums the local means times the local fraction,
or lowers mean as a sum and divides by the global count), ``amax``/``any`` (``"max"``),
``amin``/``all`` (``"min"``). Dims that need every element at once are need-replication:
``var``/``std``, ``prod``, the indices of ``max.dim``/``argmax``, ``cumsum``, ``sort``/``topk``,
the order statistics (``median``, ``kthvalue``, ``mode``). ``linalg_vector_norm`` is a sum for
``ord`` 0 and 1, a min for ``-inf``, need-replication otherwise.
Softmax's dim passes through with the *mandatory* ``handler="softmax_reduce"``: sharded, the
partitioner lowers it with an all_reduce(max) and an all_reduce(sum) (canonical T12); the
backwards need one all_reduce(sum). This module does not
cover norms or losses (``norm.py``, ``loss.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.rules.common import Dim, Names, aten_ops, build, norm_dim, norm_dims
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("reduction")

__all__ = ["reduce_rule", "softmax_rule"]


def _reduce(
    info: OpInfo,
    dims: Sequence[int],
    keepdim: bool,
    *,
    kind: str,
    reduce_op: str = "sum",
    handler: str | None = None,
) -> FactorRule:
    """Reduce ``dims`` of the first operand into every result (all of one shape)."""
    x = info.operands[0]
    names = Names().take(x.ndim)
    out: list[Dim] = [
        None if i in dims else f for i, f in enumerate(names) if keepdim or i not in dims
    ]
    reduced = [names[i] for i in dims]
    results = [None if r is None else out for r in info.results]
    kw = {"reduction": reduced, "reduce_op": reduce_op} if kind == "reduction" else {}
    if kind == "need_replication":
        kw = {"need_replication": reduced}
    return build(info, [names], results, handler=handler, **kw)


def _dims_keepdim(info: OpInfo) -> tuple[list[int], bool]:
    x = info.operands[0]
    if not info.has_arg("dim"):
        return list(range(x.ndim)), False  # sum.default, any.default, ...: every dim
    return norm_dims(info.arg("dim"), x.ndim), bool(info.arg("keepdim", False))


_SUM = ("sum.default", "sum.dim_IntList")
_MEAN = ("mean.default", "mean.dim")
_MAX = ("amax.default", "any.default", "any.dim", "any.dims")
_MIN = ("all.default", "all.dim", "all.dims", "amin.default")


@RULES.register(*aten_ops(sorted(_SUM + _MEAN + _MAX + _MIN)))
def reduce_rule(info: OpInfo) -> FactorRule:
    """``a b -> a; reduction=b`` for ``sum(x, 1)``; max/min for amax/any and amin/all."""
    name = info.target.name().split("::")[1]
    dims, keepdim = _dims_keepdim(info)
    if name.startswith(("sum", "mean")):
        handler = "mean" if name.startswith("mean") else None
        return _reduce(info, dims, keepdim, kind="reduction", handler=handler)
    op = "max" if name.startswith(("amax", "any")) else "min"
    return _reduce(info, dims, keepdim, kind="reduction", reduce_op=op)


#: A sum of a partial sum is a partial sum (propagate.linear).
RULES.declare(aten_ops(list(_SUM)), OpFacts(linear="first"))


_NEED_REP = aten_ops(
    [
        "argmax.default",
        "argmin.default",
        "max.dim",
        "min.dim",
        "prod.dim_int",
        "std.correction",
        "std.dim",
        "var.correction",
        "var.dim",
        "var_mean.correction",
    ]
)


@RULES.register(*_NEED_REP)
def gathered_reduce_rule(info: OpInfo) -> FactorRule:
    """``a b -> a; need-replication=b`` for ``var(x, 1)``, ``max(x, 1)`` (values, indices)."""
    x = info.operands[0]
    dim = info.arg("dim")
    dims = norm_dims(dim, x.ndim)
    keepdim = bool(info.arg("keepdim", False))
    return _reduce(info, dims, keepdim, kind="need_replication")


_SOFTMAX = aten_ops(
    [
        "_log_softmax.default",
        "_log_softmax_backward_data.default",
        "_safe_softmax.default",
        "_softmax.default",
        "_softmax_backward_data.default",
        "log_softmax.int",
        "softmax.int",
    ]
)


@RULES.register(*_SOFTMAX)
def softmax_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; handler=softmax_reduce`` for ``softmax(x, 1)``; the backward ops
    (``grad, out -> grad_in``) share the factors. The softmax dim ``b`` is a pass-through factor
    only because the partitioner's ``softmax_reduce`` handler lowers it (cross-device max and
    sum); generic (per-tile) lowering of a sharded ``b`` would be wrong."""
    x = info.operands[0]
    names = Names().take(x.ndim)
    norm_dim(info.arg("dim"), x.ndim)  # validates the dim
    dims = [names] * len(info.operands)
    return build(info, dims, [names], handler=HandlerName.SOFTMAX_REDUCE)


@RULES.register(*aten_ops(["cumprod.default", "cumsum.default", "logcumsumexp.default"]))
def scan_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; need-replication=b`` for ``cumsum(x, 1)``."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    rep = [names[norm_dim(info.arg("dim"), x.ndim)]] if x.ndim else []
    return build(info, [names], [names], need_replication=rep)


@RULES.register(*aten_ops(["sort.default", "sort.stable", "topk.default"]))
def sort_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b, a b; need-replication=b`` for ``sort(x, 1)`` (values, indices); topk's
    result dim is a fresh factor (its size is k)."""
    (x,) = info.operands
    fresh = Names()
    names = fresh.take(x.ndim)
    name = info.target.name()
    dim = info.arg("dim", -1)
    if not x.ndim:
        return build(info, [[]], [[], []])
    d = norm_dim(dim, x.ndim)
    out = list(names)
    if name.endswith("topk"):
        out[d] = fresh.new()
    return build(info, [names], [out, out], need_replication=[names[d]])


@RULES.register(*aten_ops(["max.default", "min.default"]))
def full_extremum_rule(info: OpInfo) -> FactorRule:
    """``a b -> ; reduction=a,b; reduce_op=max`` for ``max(x)`` (every dim, a 0-d result)."""
    (x,) = info.operands
    op = "max" if info.target.name().endswith("max") else "min"
    return _reduce(info, list(range(x.ndim)), False, kind="reduction", reduce_op=op)


@RULES.register(*aten_ops(["median.default", "nanmedian.default", "prod.default"]))
def full_gathered_rule(info: OpInfo) -> FactorRule:
    """``a b -> ; need-replication=a,b`` for ``median(x)``: an order statistic or a product of
    every element needs them all on one device."""
    (x,) = info.operands
    return _reduce(info, list(range(x.ndim)), False, kind="need_replication")


_SELECT_DIM = aten_ops(["kthvalue.default", "median.dim", "mode.default", "nanmedian.dim"])


@RULES.register(*_SELECT_DIM)
def select_dim_rule(info: OpInfo) -> FactorRule:
    """``a b -> a, a; need-replication=b`` for ``kthvalue(x, 2, 1)`` (values, indices)."""
    (x,) = info.operands
    dim = info.arg("dim", -1)
    keepdim = bool(info.arg("keepdim", False))
    dims = [norm_dim(dim, x.ndim)] if x.ndim else []
    return _reduce(info, dims, keepdim, kind="need_replication")


@RULES.register(*aten_ops(["linalg_vector_norm.default"]))
def vector_norm_rule(info: OpInfo) -> FactorRule:
    """``a b -> a; reduction=b`` for ``vector_norm(x, 1, [1])`` (and ``ord=0``, a count of
    non-zeros): a sum of per-element terms whose padding (masked to 0) adds nothing;
    ``ord=-inf`` is a min of ``|x|`` (padding masked to +inf). Any other ``ord`` (2, inf, p)
    is need-replication: ``(sum |x|^p)^(1/p)`` is not a sum of the shards' norms, and a max of
    ``|x|`` would see ``|-inf|`` in masked padding."""
    (x,) = info.operands
    ord_ = float(info.arg("ord", 2))
    dims = norm_dims(info.arg("dim"), x.ndim)
    keepdim = bool(info.arg("keepdim", False))
    if ord_ in (0.0, 1.0):
        return _reduce(info, dims, keepdim, kind="reduction")
    if ord_ == float("-inf"):
        return _reduce(info, dims, keepdim, kind="reduction", reduce_op="min")
    return _reduce(info, dims, keepdim, kind="need_replication")
