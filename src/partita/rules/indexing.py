"""Rules of advanced indexing and scatters: ``index.Tensor``, ``index_put``, the ``scatter``
family, ``slice_scatter``, ``flip``, ``histc`` and ``unfold``.

Decision: a dim that an op reads or writes at positions held in *data* (the indexed dims of
``x[i, :, j]``, the scattered dim of ``scatter``) or at global positions (a flipped dim, the
sliced dim of a strided ``slice_scatter``, an unfolded dim) is need-replication on the operand; a
step-1 ``slice_scatter`` (the backward of a slice) keeps its dim split, re-tiled by the
partitioner like ``cat`` (``handler="retile"``). Every
other dim passes through: the non-indexed dims of ``x[i]``, and the dims of the index tensors'
broadcast shape, which ``x[i]`` carries into its result. A scatter's index and source tensors
share a pass-through factor with the operand on a dim only where their sizes equal the
operand's (a smaller index writes a prefix of that dim: need-replication there). Index tensors
whose dims are sharded name ``handler="index_padding"``: their padding (garbage after an
elementwise op) must become a valid index before the local op reads it.

What capture rewrites never reaches a rule: ``index_put_`` and ``x[i] = v`` become
``index_put``, ``index_add`` becomes ``index_put(accumulate=True)``, ``roll`` an
``index_select``, ``select_scatter`` a ``where`` and ``take_along_dim`` a ``gather``; an upsample
index becomes ``index.Tensor``. Boolean-mask indexing (``x[x > 0]``) has a data-dependent
shape and no rule; a boolean-mask *write* ``x[x > 0] = v`` whose values do not depend on the
number of selected positions is a ``where`` and passes every dim through (handler
``mask_write``). This module does not cover ``gather``/``index_select`` (``slicing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from partita.rules.common import Dim, Names, aten_ops, broadcast_dims, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo, TensorMeta
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("indexing")

__all__ = ["index_put_rule", "index_rule", "scatter_rule", "slice_scatter_rule"]

INDEX_PADDING = HandlerName.INDEX_PADDING
RETILE = HandlerName.RETILE


def _indices(info: OpInfo) -> list[TensorMeta | None]:
    indices = list(info.arg("indices"))
    for i in indices:
        if i is not None and i.dtype is not None and not _is_integer(i.dtype):
            raise NotImplementedError(
                f"{info.target} with a {i.dtype} index of shape {i.shape}: a boolean mask gives "
                f"a data-dependent shape, which partita cannot shard; keep the shape with "
                f"torch.where(mask, x, 0), or index with integer positions"
            )
    return indices


def _is_integer(dtype: torch.dtype) -> bool:
    # torch reads bool and uint8 index tensors as masks
    return dtype in (torch.int8, torch.int16, torch.int32, torch.int64)


def _broadcast_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for k, n in enumerate(s):
            i = ndim - len(s) + k
            if n != 1:
                out[i] = n
    return tuple(out)


def _layout(
    info: OpInfo, fresh: Names
) -> tuple[list[str], list[int], list[Dim], list[list[Dim]], list[Dim]]:
    """What ``x[indices]`` does to the factors of ``x``.

    Returns the factors of ``x``, its indexed dims, the factors of the result (the broadcast
    dims replace the indexed dims where those are adjacent, otherwise they come first: torch's
    rule for ``x[i, :, j]``), the factors of each index tensor and those of the indices'
    broadcast shape.

    Example: ``x [a b c]`` indexed by ``(None, i [d])`` gives ``a d c``; by ``(i [d], None,
    j [d])`` gives ``d b``.
    """
    x = info.operands[0]
    indices = _indices(info)
    names = fresh.take(x.ndim)
    indexed = [d for d, i in enumerate(indices) if i is not None]
    shape = _broadcast_shape([i.shape for i in indices if i is not None])
    bcast: list[Dim] = [fresh.new() if n != 1 else None for n in shape]
    rest: list[Dim] = [f for d, f in enumerate(names) if d not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    if adjacent and indexed:
        out: list[Dim] = [*names[: indexed[0]], *bcast, *names[indexed[-1] + 1 :]]
    else:
        out = [*bcast, *rest]
    index_dims = [broadcast_dims(i, shape, bcast) for i in indices if i is not None]
    return names, indexed, out, index_dims, bcast


@RULES.register(*aten_ops(["index.Tensor"]))
def index_rule(info: OpInfo) -> FactorRule:
    """``a b c, d -> a d c; need-replication=b`` for ``x[:, i]``: the indexed dim is gathered,
    the index's dims pass through to the result, the other dims of ``x`` pass through."""
    names, indexed, out, index_dims, _ = _layout(info, Names())
    return build(
        info,
        [names, *index_dims],
        [out],
        need_replication=[names[d] for d in indexed],
        handler=INDEX_PADDING,
    )


@RULES.register(*aten_ops(["index_put.default"]))
def index_put_rule(info: OpInfo) -> FactorRule:
    """``a b c, 1, a 1 c -> a b c; need-replication=b`` for ``x[:, i] = v`` (accumulate or
    not): the indexed dims and the index tensors are whole (every device must write every
    position of its tile), the other dims of ``x`` pass through with the values' dims.
    ``x[mask] = v`` with a boolean mask and values that do not depend on how many positions
    it selects is elementwise: ``a b c, a b, c -> a b c``."""
    masked = _mask_put(info)
    if masked is not None:
        return masked
    names, indexed, out, index_dims, bcast = _layout(info, Names())
    x, values = info.operands[0], info.operands[-1]
    # The values broadcast to the shape of x[indices]; its index dims stay whole.
    target: list[Dim] = [None if f in bcast else f for f in out]
    target_shape = [1 if f is None else x.shape[names.index(f)] for f in target]
    whole_indices: list[list[Dim]] = [[None] * len(d) for d in index_dims]
    return build(
        info,
        [names, *whole_indices, _values_dims(values, target_shape, target)],
        [names],
        need_replication=[names[d] for d in indexed],
    )


def _mask_put(info: OpInfo) -> FactorRule | None:
    """The rule of ``x[..., mask, ...] = v`` (``index_put`` with one boolean index) when it is
    a ``where``: the mask covers dims ``j..j+k`` of ``x`` with their sizes and ``v`` broadcasts
    against the dims after them, so each position of ``x`` is written (or, accumulating,
    added to) iff the mask holds there, and ``v``'s value there does not depend on how many
    positions the mask selects. Each device then writes its own tiles (the ``mask_write``
    handler emits the ``where``); the padding of a split mask may write into ``x``'s padding,
    which is garbage anyway. None otherwise (an integer index, several indices, values with
    one entry per selected position)."""
    entries = list(info.arg("indices"))
    given = [(d, i) for d, i in enumerate(entries) if i is not None]
    if len(given) != 1 or given[0][1].dtype != torch.bool:
        return None
    (j, mask), x, values = given[0], info.operands[0], info.operands[-1]
    end = j + mask.ndim
    if tuple(x.shape[j:end]) != tuple(mask.shape):
        return None
    trailing = x.ndim - end
    lead = values.ndim - trailing  # values' dims before those aligned with x's trailing dims
    if lead > 0 and any(n != 1 for n in values.shape[:lead]):
        return None
    names = Names().take(x.ndim)
    vals = _values_dims(values, x.shape[end:], names[end:]) if trailing else [None] * values.ndim
    return build(info, [names, names[j:end], vals], [names], handler=HandlerName.MASK_WRITE)


def _values_dims(values: TensorMeta, shape: Sequence[int], dims: Sequence[Dim]) -> list[Dim]:
    """Factors of the values of ``index_put``, aligned from the right with ``x[indices]``: a
    dim whose size equals ``x``'s keeps its factor, anything else (a broadcast 1, an index dim)
    has none."""
    offset = len(shape) - values.ndim
    out: list[Dim] = []
    for k, n in enumerate(values.shape):
        i = offset + k
        f = dims[i] if 0 <= i < len(dims) else None
        out.append(f if f is not None and n == shape[i] else None)
    return out


_SCATTER = aten_ops(
    [
        "scatter.reduce",
        "scatter.src",
        "scatter.value",
        "scatter.value_reduce",
        "scatter_add.default",
        "scatter_reduce.two",
    ]
)


@RULES.register(*_SCATTER)
def scatter_rule(info: OpInfo) -> FactorRule:
    """``a b, 1 b, 1 b -> a b; need-replication=a`` for ``x.scatter(0, i, s)``: the scattered
    dim is gathered; another dim passes through where the index (and source) have the
    operand's size, and is gathered where they are smaller."""
    x = info.operands[0]
    dim = norm_dim(info.arg("dim"), x.ndim)
    names = Names().take(x.ndim)
    others = info.operands[1:]
    rep = [names[dim]] if x.ndim else []
    per_operand: list[list[Dim]] = [[] for _ in others]
    for d in range(x.ndim):
        same = d != dim and all(t.shape[d] == x.shape[d] for t in others)
        if d != dim and not same:
            rep.append(names[d])
        for dims in per_operand:
            dims.append(names[d] if same else None)
    return build(info, [names, *per_operand], [names], need_replication=rep, handler=INDEX_PADDING)


@RULES.register(*aten_ops(["slice_scatter.default"]))
def slice_scatter_rule(info: OpInfo) -> FactorRule:
    """``a b, a b -> a b; windowed=b; handler=retile`` for ``slice_scatter(x, s, 1, 2, 4)`` (the
    result is ``x``'s tiles with ``s``'s pieces put in place, like a cat); a strided one is
    ``a b, a 1 -> a b; need-replication=b``; a slice of the whole dim passes through."""
    x, src = info.operands
    dim = norm_dim(info.arg("dim", 0), x.ndim)
    names = Names().take(x.ndim)
    if src.shape[dim] == x.shape[dim]:
        return build(info, [names, names], [names])
    if info.arg("step", 1) == 1 and src.shape[dim] > 0:
        return build(info, [names, names], [names], windowed=[names[dim]], handler=RETILE)
    src_dims: list[Dim] = list(names)
    src_dims[dim] = None
    return build(info, [names, src_dims], [names], need_replication=[names[dim]])


@RULES.register(*aten_ops(["flip.default"]))
def flip_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b; need-replication=b`` for ``x.flip(1)``: a tile of a flipped dim is another
    device's tile reversed."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    dims = sorted({norm_dim(d, x.ndim) for d in info.arg("dims")}) if x.ndim else []
    return build(info, [names], [names], need_replication=[names[d] for d in dims])


@RULES.register(*aten_ops(["histc.default"]))
def histc_rule(info: OpInfo) -> FactorRule:
    """``a b -> c; need-replication=a,b`` for ``histc(x, bins)``: counting padding would add
    to a bin, and ``min == max`` reads the global range."""
    (x,) = info.operands
    fresh = Names()
    names = fresh.take(x.ndim)
    return build(info, [names], [[fresh.new()]], need_replication=names)


@RULES.register(*aten_ops(["unfold.default"]))
def unfold_rule(info: OpInfo) -> FactorRule:
    """``a b -> a c d; need-replication=b`` for ``x.unfold(1, size, step)``: windows cross tile
    edges."""
    (x,) = info.operands
    fresh = Names()
    names = fresh.take(x.ndim)
    if not x.ndim:
        return build(info, [[]], [[fresh.new()]])
    dim = norm_dim(info.arg("dimension"), x.ndim)
    res: list[Dim] = list(names)
    res[dim] = fresh.new()
    res.append(fresh.new())
    return build(info, [names], [res], need_replication=[names[dim]])
