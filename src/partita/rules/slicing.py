"""Rules of ops that take parts of tensors or put them together: slice, select, narrow,
index_select, gather, cat, stack, constant_pad_nd, tril/triu.

Decision: a contiguous part of a dim (a step-1 ``slice``, ``narrow``) and ``cat``'s dim keep
the dim's factor on operands and result, windowed with ``handler="retile"``: the result stays
split the way the operand is, and the partitioner re-tiles it by sending each device the pieces
of its new tile that others hold (collective_permutes, ``partition/retile.py``; none when the
tiles line up, T11). A dim cut at scattered *global* positions (a strided slice, ``select``'s
dim, the indexed dim of ``gather``/``index_select``) is need-replication on the operand; the
result's dim is a fresh factor, free to be sharded by a local slice afterwards.
``constant_pad_nd``'s padded dims are windowed with ``handler="halo"``: shards exchange edges
with their neighbours and the edge shards pad (T22). This module does not cover reshapes
(``shape.py``).
"""

from __future__ import annotations

from partita.rules.common import Dim, Names, aten_ops, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("slicing")

__all__ = ["cat_rule", "contiguous_part", "pad_rule", "slice_rule"]


def _cut(info: OpInfo, dim: int, *, keep_dim: bool) -> FactorRule:
    """Operand dim ``dim`` is cut at global positions: need-replication on the operand; the
    result keeps a fresh factor there (``keep_dim``) or loses the dim."""
    x, out = info.operands[0], info.results[0]
    fresh = Names()
    names = fresh.take(x.ndim)
    res: list[Dim] = list(names)
    if keep_dim and out.shape[dim] == x.shape[dim]:
        return build(info, [names, *([None] * (len(info.operands) - 1))], [res])
    res[dim] = fresh.new()
    if not keep_dim:
        del res[dim]
    rest = [None] * (len(info.operands) - 1)
    return build(info, [names, *rest], [res], need_replication=[names[dim]])


def contiguous_part(info: OpInfo, dim: int, step: int = 1) -> FactorRule | None:
    """``a b -> a b; windowed=b; handler=retile`` when the op keeps a contiguous, non-empty,
    proper part of dim ``dim`` (the partitioner re-tiles it); None otherwise."""
    x, out = info.operands[0], info.results[0]
    if step != 1 or not 0 < out.shape[dim] < x.shape[dim]:
        return None
    names = Names().take(x.ndim)
    rest = [None] * (len(info.operands) - 1)
    return build(info, [names, *rest], [names], windowed=[names[dim]], handler=HandlerName.RETILE)


@RULES.register(*aten_ops(["narrow.default", "narrow_copy.default", "slice.Tensor"]))
def slice_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; windowed=b; handler=retile`` for ``x[:, 4:36]`` or ``x.narrow(1, 4, 32)``
    (``narrow_copy`` alike); ``a c`` with ``need-replication=b`` for an empty part;
    ``a b -> a c; need-replication=b`` for ``x[:, ::2]``; ``a b -> a b`` for a full slice."""
    x = info.operands[0]
    dim = norm_dim(info.arg("dim", 0), x.ndim)
    step = info.arg("step", 1) if str(info.target).startswith("aten.slice") else 1
    part = contiguous_part(info, dim, step)
    return part if part is not None else _cut(info, dim, keep_dim=True)


@RULES.register(*aten_ops(["select.int"]))
def select_rule(info: OpInfo) -> FactorRule:
    """``a b -> a; need-replication=b`` for ``x[:, 3]``."""
    x = info.operands[0]
    return _cut(info, norm_dim(info.arg("dim"), x.ndim), keep_dim=False)


@RULES.register(
    *aten_ops(["gather.default", "index_select.default"]), facts=OpFacts(index_operands=(1,))
)
def gather_rule(info: OpInfo) -> FactorRule:
    """``a b, a c -> a c; need-replication=b`` for ``gather(x, 1, idx)``; an index smaller than
    ``x`` on another dim gives ``a b, 1 c -> d c; need-replication=a,b``; index_select's index
    is 1-d: ``a b, c -> a c``."""
    x, index = info.operands[0], info.operands[1]
    (out,) = info.results
    if x.ndim == 0:  # a 0-d tensor read at index 0: nothing to split
        return build(info, [[], [None] * index.ndim], [[None] * out.ndim])
    d = norm_dim(info.arg("dim"), x.ndim)
    fresh = Names()
    names = fresh.take(x.ndim)
    res: list[Dim] = list(names)
    res[d] = fresh.new()
    rep = [names[d]]
    if str(info.target).startswith("aten.index_select"):
        return build(info, [names, [res[d]]], [res], need_replication=rep)
    idx: list[Dim] = []
    for i, n in enumerate(index.shape):
        if i == d or n == x.shape[i]:
            idx.append(res[i])
        else:
            # A smaller index reads a prefix of the dim: row r of the index reads row r of x,
            # so the index cannot be split there while x is whole (the result is computed
            # whole on that dim, then sliced).
            idx.append(None)
            res[i] = fresh.new()
            rep.append(names[i])
    del out
    return build(info, [names, idx], [res], need_replication=rep)


@RULES.register(*aten_ops(["cat.default"]))
def cat_rule(info: OpInfo) -> FactorRule:
    """``a b, a b -> a b; windowed=b; handler=retile`` for ``cat([x, y], 1)``: the result keeps
    the operands' split of the cat dim (the partitioner re-tiles it; T21)."""
    (out,) = info.results
    d = norm_dim(info.arg("dim", 0), out.ndim)
    names = Names().take(out.ndim)
    # legacy: 1-d empty tensors are skipped by cat
    operands = [names if m.ndim == out.ndim else [None] * m.ndim for m in info.operands]
    return build(info, operands, [names], windowed=[names[d]], handler=HandlerName.RETILE)


@RULES.register(*aten_ops(["stack.default"]))
def stack_rule(info: OpInfo) -> FactorRule:
    """``a b, a b -> a c b`` for ``stack([x, y], 1)``: the new dim is result-only."""
    (out,) = info.results
    d = norm_dim(info.arg("dim", 0), out.ndim)
    fresh = Names()
    names = fresh.take(out.ndim - 1)
    res: list[Dim] = list(names)
    res.insert(d, fresh.new())
    return build(info, [names] * len(info.operands), [res])


@RULES.register(*aten_ops(["constant_pad_nd.default"]))
def pad_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; windowed=b; handler=halo`` for ``F.pad(x, (4, 4))``."""
    (x,) = info.operands
    pad = list(info.arg("pad"))
    names = Names().take(x.ndim)
    windowed = [names[x.ndim - 1 - i // 2] for i in range(0, len(pad), 2) if pad[i] or pad[i + 1]]
    return build(info, [names], [names], windowed=windowed, handler=HandlerName.HALO)


@RULES.register(*aten_ops(["tril.default", "triu.default"]))
def triangle_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a b c; need-replication=b,c``: the mask depends on global positions."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    return build(info, [names], [names], need_replication=names[-2:])
