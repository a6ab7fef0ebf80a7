"""A ``cat`` read only by a strided copy into a buffer: each piece copied into the buffer.

On the LocalMesh the q|k|v gradients of a fused projection split over ``model`` are joined
per device (a ``cat`` of the three pieces, vmapped over the devices), then re-laid out into
the global projection's layout by one strided ``copy_`` (``runtime.block_copy``). In the
fused step's flat graph (``runtime.fused_step``) that is

    joined = cat([q, k, v], dim)
    buffer.copy_(as_strided(joined, size, stride, offset))

two passes over the gradient where the unsharded step makes one. When the view reads the
joined value one piece per index of one of its dims (the ``3`` of ``[.., 3, model, ..]``),
each piece is copied straight to its slot of the buffer (``buffer.select(d, i).copy_(...)``,
an ``as_strided`` of the piece at the strides the view had in the joined value) and the
``cat`` goes. The same elements are copied to the same places: every result is unchanged,
bit for bit.

This module does not look at any other reader of a ``cat``: one whose data anything but
that copy reads (an op that takes only its dtype and device, ``new_empty``, is fine) stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx

__all__ = ["copy_cat_pieces"]

aten = torch.ops.aten

_CAT = aten.cat.default
_COPY = aten.copy_.default
_AS_STRIDED = aten.as_strided.default
#: ops that read only their first input's dtype and device, not its data
_META_ONLY = frozenset((aten.new_empty.default, aten.new_zeros.default))


def copy_cat_pieces(gm: fx.GraphModule) -> int:
    """Rewrite every ``buffer.copy_(as_strided(cat(pieces, dim), ...))`` in ``gm`` whose view
    reads one piece per index of one of its dims as one copy per piece; returns how many
    ``cat``s went."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _COPY and not node.kwargs:
            count += _rewrite(gm.graph, node)
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return count


def _rewrite(graph: fx.Graph, copy: fx.Node) -> int:
    dst, view = copy.args[0], copy.args[1]
    if not (isinstance(dst, fx.Node) and isinstance(view, fx.Node)) or len(copy.args) != 2:
        return 0
    if view.target is not _AS_STRIDED or len(view.users) != 1:
        return 0
    cat = view.args[0]
    if not isinstance(cat, fx.Node) or cat.target is not _CAT or cat.kwargs:
        return 0
    if any(u is not view and u.target not in _META_ONLY for u in cat.users):
        return 0
    pieces = cast("Sequence[fx.Node]", cat.args[0])
    plan = _piece_views(cat, pieces, view)
    if plan is None:
        return 0
    piece_dim, size, dims = plan
    dst_val = dst.meta.get("val")
    with graph.inserting_before(copy):
        for i, piece in enumerate(pieces):
            val = piece.meta["val"]
            stride = [val.stride(d) if d >= 0 else 0 for d in dims]
            src = graph.call_function(_AS_STRIDED, (piece, size, stride, val.storage_offset()))
            slot = graph.call_function(aten.select.int, (dst, piece_dim, i))
            graph.call_function(_COPY, (slot, src))
            _meta(src, val.as_strided, size, stride, val.storage_offset())
            if isinstance(dst_val, torch.Tensor):
                _meta(slot, dst_val.select, piece_dim, i)
    copy.replace_all_uses_with(dst)
    graph.erase_node(copy)
    graph.erase_node(view)
    for user in list(cat.users):  # dtype and device only: the first piece has them
        user.replace_input_with(cat, pieces[0])
    graph.erase_node(cat)
    return 1


def _piece_views(
    cat: fx.Node, pieces: Sequence[fx.Node], view: fx.Node
) -> tuple[int, list[int], list[int]] | None:
    """``(d, size, dims)``: the view's dim ``d`` steps from piece to piece, and what it
    reads of each piece is the piece's ``as_strided(size, [its stride along dims[j]])``
    (``-1``: a dim of size 1, stride 0); None if the view does not read the pieces so."""
    joined = cat.meta.get("val")
    vals = [p.meta.get("val") for p in pieces] if isinstance(pieces, (list, tuple)) else []
    if not isinstance(joined, torch.Tensor) or not vals:
        return None
    if not all(isinstance(v, torch.Tensor) and v.dim() == joined.dim() for v in vals):
        return None
    dim = cast(int, cat.args[1]) % joined.dim() if len(cat.args) > 1 else 0
    length = vals[0].shape[dim]
    if any(v.shape[dim] != length for v in vals) or not joined.is_contiguous():
        return None
    sizes, view_strides = cast("tuple[list[int], list[int]]", view.args[1:3])
    offset = view.args[3] if len(view.args) > 3 else view.kwargs.get("storage_offset")
    if offset not in (None, joined.storage_offset()):  # None: the input's own offset
        return None
    piece_dim, dims = -1, []
    for d, (n, s) in enumerate(zip(sizes, view_strides, strict=True)):
        if n == 1:
            dims.append(-1)
        elif s == joined.stride(dim) * length and n == len(pieces) and piece_dim < 0:
            piece_dim = d
        else:
            at = [i for i in range(joined.dim()) if joined.stride(i) == s and joined.shape[i] > 1]
            bound = length if at and at[0] == dim else joined.shape[at[0]] if at else 0
            if len(at) != 1 or n > bound or at[0] in dims:
                return None
            dims.append(at[0])
    if piece_dim < 0:
        return None
    size = [n for d, n in enumerate(sizes) if d != piece_dim]
    return piece_dim, size, dims


def _meta(node: fx.Node, view: Callable[..., Any], *args: Any) -> None:
    """The fake value of a new view node (``view(*args)``), for the passes after this one."""
    try:
        node.meta["val"] = view(*args)
    except Exception:  # no fake value at hand: the later passes skip a node without one
        return
