"""Rules of ops that only move or relabel elements: reshape/view, squeeze, permute, transpose,
expand, diagonal, repeat, view_as_complex/real, view(dtype) (narrow_copy is a slice:
rules/slicing.py).

Reshape uses a generic shape-matching algorithm (:func:`reshape_factors`): size-1 dims carry no
factor; the remaining dims of input and output are cut into minimal groups of equal product;
within a group the prefix products of both sides are merged into one chain and, when each
divides the next, every step of the chain is a factor, so a dim is one factor or a compound of
consecutive ones: ``[8, 8, 32] -> [64, 32]`` is ``a b c -> (a b) c``, ``[12, 5] -> [3, 4, 5]`` is
``(a b) c -> a b c``, ``[2, 6] -> [4, 3]`` is ``a (b c) -> (a b) c``. A group with no such chain
(``[6, 4] -> [4, 6]``) is not expressible: its input dims are need-replication factors (the
operand is gathered on them) and its output dims fresh result-only factors (sliced locally).
Ops whose arguments are shapes (view, expand) carry ``handler="localize_shape"``: the
partitioner rewrites the shape argument to local sizes. Ops that pair or tile *global*
positions (``diagonal``'s two dims, a dim that ``repeat`` tiles) gather those dims. This module
does not cover slicing, concatenation or padding (``slicing.py``). ``as_strided`` (and its copy
and scatter) reads storage through strides, which no factor describes: its operands are
gathered and the ``as_strided`` handler replays the trace's storage order on a contiguous copy
(a gathered tile's layout is not the user's), so the result is replicated.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from partita.rules.common import Dim, Names, aten_ops, build, norm_dim
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("shape")

__all__ = ["expand_rule", "permute_rule", "reshape_factors", "reshape_rule"]


def reshape_factors(
    src: Sequence[int], dst: Sequence[int], names: Names | None = None
) -> tuple[list[Dim], list[Dim], dict[str, int], list[str]]:
    """Factors of a reshape ``src -> dst``: (input dims, output dims, sizes, need-replication).

    Example:
        >>> reshape_factors((12, 5), (3, 4, 5))[:2]
        ([('a', 'b'), 'c'], ['a', 'b', 'c'])
    """
    names = names or Names()
    in_dims: list[Dim] = [None] * len(src)
    out_dims: list[Dim] = [None] * len(dst)
    sizes: dict[str, int] = {}
    need_rep: list[str] = []
    if 0 in src or 0 in dst:  # empty tensors: nothing to shard
        return in_dims, out_dims, sizes, need_rep
    si = [k for k, n in enumerate(src) if n != 1]
    sj = [k for k, n in enumerate(dst) if n != 1]
    p = q = 0
    while p < len(si) and q < len(sj):
        gi, gj = [si[p]], [sj[q]]
        pa, pb = src[si[p]], dst[sj[q]]
        p, q = p + 1, q + 1
        while pa != pb:
            if pa < pb:
                gi.append(si[p])
                pa *= src[si[p]]
                p += 1
            else:
                gj.append(sj[q])
                pb *= dst[sj[q]]
                q += 1
        _group(src, dst, gi, gj, in_dims, out_dims, sizes, need_rep, names)
    return in_dims, out_dims, sizes, need_rep


def _prefix(shape: Sequence[int], group: list[int]) -> list[int]:
    out, acc = [], 1
    for k in group:
        acc *= shape[k]
        out.append(acc)
    return out


def _group(
    src: Sequence[int],
    dst: Sequence[int],
    gi: list[int],
    gj: list[int],
    in_dims: list[Dim],
    out_dims: list[Dim],
    sizes: dict[str, int],
    need_rep: list[str],
    names: Names,
) -> None:
    chain = sorted(set(_prefix(src, gi)) | set(_prefix(dst, gj)))
    if any(b % a for a, b in itertools.pairwise(chain)):
        for k in gi:  # not a pure split or merge: gather the operand on these dims
            f = names.new()
            in_dims[k], sizes[f] = f, src[k]
            need_rep.append(f)
        for k in gj:
            f = names.new()
            out_dims[k], sizes[f] = f, dst[k]
        return
    factors, lo = [], 1
    for b in chain:
        f = names.new()
        sizes[f] = b // lo
        factors.append((lo, b, f))
        lo = b
    for shape, group, dims in ((src, gi, in_dims), (dst, gj, out_dims)):
        start = 1
        for k in group:
            end = start * shape[k]
            fs = tuple(f for a, b, f in factors if a >= start and b <= end)
            dims[k] = fs[0] if len(fs) == 1 else fs
            start = end


_RESHAPE = aten_ops(
    [
        "_reshape_alias.default",
        "_unsafe_view.default",
        "flatten.using_ints",
        "reshape.default",
        "squeeze.default",
        "squeeze.dim",
        "squeeze.dims",
        "unflatten.int",
        "unsqueeze.default",
        "view.default",
        "view_copy.default",
    ]
)


@RULES.register(*_RESHAPE)
def reshape_rule(info: OpInfo) -> FactorRule:
    """``a b c -> (a b) c; handler=localize_shape`` for ``[8, 8, 32] -> [64, 32]``."""
    (x,), out = info.operands, info.result()
    in_dims, out_dims, sizes, need_rep = reshape_factors(x.shape, out.shape)
    return build(
        info,
        [in_dims],
        [out_dims],
        sizes=sizes,
        need_replication=need_rep,
        handler=HandlerName.LOCALIZE_SHAPE,
    )


@RULES.register(*aten_ops(["permute.default", "permute_copy.default"]))
def permute_rule(info: OpInfo) -> FactorRule:
    """``a b c -> c a b`` for ``permute(x, [2, 0, 1])``."""
    (x,) = info.operands
    dims = Names().take(x.ndim)
    order = [norm_dim(d, x.ndim) for d in info.arg("dims")]
    return build(info, [dims], [[dims[d] for d in order]])


@RULES.register(*aten_ops(["transpose.int", "transpose_copy.int"]))
def transpose_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a c b`` for ``transpose(x, 1, 2)``."""
    (x,) = info.operands
    dims = Names().take(x.ndim)
    out = list(dims)
    if x.ndim:
        d0, d1 = norm_dim(info.arg("dim0"), x.ndim), norm_dim(info.arg("dim1"), x.ndim)
        out[d0], out[d1] = dims[d1], dims[d0]
    return build(info, [dims], [out])


@RULES.register(*aten_ops(["numpy_T.default", "t.default"]))
def t_rule(info: OpInfo) -> FactorRule:
    """``a b -> b a`` (``a -> a`` for 1-d, nothing for 0-d)."""
    (x,) = info.operands
    dims = Names().take(x.ndim)
    return build(info, [dims], [dims[::-1]])


#: Its result's new dims are produced tile by tile (the local shape argument).
RULES.declare(aten_ops(["expand.default"]), OpFacts(local_results=True))
#: Views and reshapes move a partial sum's addends as they are: it stays partial (propagate.linear).
RULES.declare(
    [*_RESHAPE, *aten_ops(["permute.default", "t.default", "transpose.int"])],
    OpFacts(linear="first"),
)


@RULES.register(*aten_ops(["expand.default", "expand_copy.default"]))
def expand_rule(info: OpInfo) -> FactorRule:
    """``1 b -> a b; handler=localize_shape`` for ``[1, 8] -> [4, 8]``: broadcast dims are
    result-only factors (each device materialises its own tile)."""
    (x,), out = info.operands, info.result()
    dims = Names().take(out.ndim)
    offset = out.ndim - x.ndim
    operand: list[Dim] = [
        dims[offset + i] if n == out.shape[offset + i] else None for i, n in enumerate(x.shape)
    ]
    return build(info, [operand], [dims], handler=HandlerName.LOCALIZE_SHAPE)


@RULES.register(*aten_ops(["diagonal.default", "diagonal_copy.default"]))
def diagonal_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a 1; need-replication=b,c`` for ``diagonal(x, 0, 1, 2)``: the diagonal pairs
    global row and column positions, so both dims are gathered; the others pass through."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    d1, d2 = norm_dim(info.arg("dim1", 0), x.ndim), norm_dim(info.arg("dim2", 1), x.ndim)
    out: list[Dim] = [f for i, f in enumerate(names) if i not in (d1, d2)] + [None]
    return build(info, [names], [out], need_replication=[names[d1], names[d2]])


@RULES.register(*aten_ops(["diagonal_scatter.default"]))
def diagonal_scatter_rule(info: OpInfo) -> FactorRule:
    """``a b c, a d -> a b c; need-replication=b,c,d`` for ``diagonal_scatter(x, src, 0, 1, 2)``."""
    x = info.operands[0]
    fresh = Names()
    names = fresh.take(x.ndim)
    d1, d2 = norm_dim(info.arg("dim1", 0), x.ndim), norm_dim(info.arg("dim2", 1), x.ndim)
    diag = fresh.new()
    src_dims: list[Dim] = [*(f for i, f in enumerate(names) if i not in (d1, d2)), diag]
    rep = [names[d1], names[d2], diag]
    return build(info, [names, src_dims], [names], need_replication=rep)


@RULES.register(*aten_ops(["repeat.default"]))
def repeat_rule(info: OpInfo) -> FactorRule:
    """``a b -> 1 a 1; need-replication=b`` for ``repeat(x, [3, 1, 2])`` on ``[5, 6]``: a dim
    repeated once passes through; a tiled dim is gathered (its tiles interleave copies) and
    the result keeps it replicated, like the new leading dims."""
    (x,), out = info.operands, info.result()
    repeats = list(info.arg("repeats"))
    names = Names().take(x.ndim)
    offset = len(repeats) - x.ndim
    res: list[Dim] = [None] * out.ndim
    rep = []
    for i, f in enumerate(names):
        if repeats[offset + i] == 1:
            res[offset + i] = f
        else:
            rep.append(f)
    return build(info, [names], [res], need_replication=rep)


@RULES.register(*aten_ops(["view_as_complex.default"]))
def view_as_complex_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a b; need-replication=c`` (``c`` is the (real, imag) pair of size 2)."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    return build(
        info,
        [names],
        [names[:-1]],
        need_replication=names[-1:],
        handler=HandlerName.CONTIGUOUS,  # the kernel wants a last dim of stride 1
    )


@RULES.register(*aten_ops(["view.dtype"]))
def view_dtype_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b`` when the element sizes match (``x.view(torch.int32)`` of a float32);
    else ``a b -> a 1; need-replication=b``: the last dim is regrouped into elements of the
    new size (``x.view(torch.complex64)`` halves it), so it is gathered first."""
    (x,), out = info.operands, info.result()
    names = Names().take(x.ndim)
    if x.ndim == 0 or out.shape == x.shape:
        return build(info, [names], [names])
    return build(
        info,
        [names],
        [[*names[:-1], None]],
        need_replication=names[-1:],
        handler=HandlerName.CONTIGUOUS,
    )


@RULES.register(*aten_ops(["view_as_real.default"]))
def view_as_real_rule(info: OpInfo) -> FactorRule:
    """``a b -> a b 1`` (the new last dim is the (real, imag) pair, never sharded)."""
    (x,) = info.operands
    names = Names().take(x.ndim)
    return build(info, [names], [[*names, None]])


@RULES.register(
    *aten_ops(["as_strided.default", "as_strided_copy.default", "as_strided_scatter.default"])
)
def as_strided_rule(info: OpInfo) -> FactorRule:
    """``a b -> 1 1; need-replication=a b`` (the scatter: ``a b, c d -> 1 1``): a strided
    window over storage (``torch.stft``'s frames, a hand-written sliding window) pairs global
    positions in ways no factor says, so every operand is gathered and the result replicated;
    the handler reads the storage in the order the trace had it."""
    names = Names()
    operands = [names.take(t.ndim) for t in info.operands]
    (out,) = info.results
    assert out is not None
    return build(
        info,
        operands,
        [[None] * out.ndim],
        need_replication=[f for dims in operands for f in dims],
        handler=HandlerName.AS_STRIDED,
    )
