"""Broadcast batched matmuls in a segment's traced flat graph, without the broadcast copies.

A LocalMesh segment runs nested ``vmap``s, one per mesh axis its inputs vary along
(``runtime.segments``). When a matmul's operands vary along *different* mesh axes (activations
along ``data``, a tensor-parallel weight along ``model``), functorch's batching rule expands
both to the full ``[data, model, ...]`` batch and copies them contiguous for one ``bmm``: the
activations are copied once per ``model`` device. Traced flat, that is::

    bmm(reshape(clone(expand(a, [*B, M, K])), [b, M, K]),
        reshape(clone(expand(w, [*B, K, N])), [b, K, N]))

:func:`fold_broadcast_bmms` rewrites each such ``bmm`` to :func:`broadcast_matmul`: batch
dims only ``a`` varies along are folded into ``M``, those only ``w`` varies along into ``N``,
and one ``mm`` (or a ``bmm`` over the dims both vary along) computes the same products with
no copy of the larger operand. Every output element is the same dot product over ``K``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, fx

__all__ = ["broadcast_matmul", "fold_broadcast_bmms", "fuse_bias_adds"]

aten = torch.ops.aten

_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_CLONES = {aten.clone.default}


def broadcast_matmul(
    a: Tensor, b: Tensor, batch: Sequence[int], bias: Tensor | None = None
) -> Tensor:
    """``[*batch, M, N]``: ``a [*Ba, M, K] @ b [*Bb, K, N]`` with ``Ba``, ``Bb`` broadcast to
    ``batch`` (leading dims may be missing, any dim may be 1), without copying a broadcast
    operand; plus ``bias`` if given (a linear layer's: broadcast to ``[*batch, M, N]``, the
    same along ``M``). Where the products are one ``mm`` and ``bias`` varies only along the
    dims folded into ``N``, the bias is that ``mm``'s addend (``addmm``, as the unsharded
    linear layer computes it); otherwise it is added after.

    >>> a, w = torch.randn(2, 1, 3, 4), torch.randn(5, 4, 6)
    >>> torch.allclose(broadcast_matmul(a, w, [2, 5]), a @ w, atol=1e-6)
    True
    """
    nb = len(batch)
    a = a.reshape(*[1] * (nb + 2 - a.dim()), *a.shape)
    b = b.reshape(*[1] * (nb + 2 - b.dim()), *b.shape)
    shared = [i for i in range(nb) if a.shape[i] > 1 and b.shape[i] > 1]
    a_only = [i for i in range(nb) if a.shape[i] > 1 and b.shape[i] == 1]
    b_only = [i for i in range(nb) if b.shape[i] > 1 and a.shape[i] == 1]
    unit = [i for i in range(nb) if a.shape[i] == 1 and b.shape[i] == 1]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    # Folding a's own dims into M is free when they follow the shared ones (a reshape); else
    # it copies a, and copying b along them instead may be cheaper. Folding b's own dims into
    # N always copies b; copying a along them instead may be cheaper.
    if a_only and shared and max(shared) > min(a_only):
        if a.numel() > b.numel() * math.prod(batch[i] for i in a_only):
            shared, a_only = sorted(shared + a_only), []
    if b_only and b.numel() > a.numel() * math.prod(batch[i] for i in b_only):
        shared, b_only = sorted(shared + b_only), []
    a = a.expand(*[batch[i] if i in shared else a.shape[i] for i in range(nb)], m, k)
    b = b.expand(*[batch[i] if i in shared else b.shape[i] for i in range(nb)], k, n)
    s = math.prod(batch[i] for i in shared)
    sa = math.prod(batch[i] for i in a_only)
    sb = math.prod(batch[i] for i in b_only)
    # a: [shared, a_only, M, K] -> [S, A*M, K]; b: [shared, K, b_only, N] -> [S, K, B*N]
    a2 = a.permute(*shared, *a_only, *b_only, *unit, nb, nb + 1).reshape(s, sa * m, k)
    b2 = b.permute(*shared, *a_only, *b_only, *unit, nb, nb + 1)
    b2 = b2.reshape(s, sb, k, n).permute(0, 2, 1, 3).reshape(s, k, sb * n)
    cols = None
    if bias is not None and s == 1 and bias.dtype == a.dtype:
        cols = _bias_columns(bias, batch, b_only, n)
    if cols is not None:
        out, bias = torch.addmm(cols, a2[0], b2[0]).unsqueeze(0), None
    else:
        out = torch.bmm(a2, b2) if s > 1 else torch.mm(a2[0], b2[0]).unsqueeze(0)
    # [S, A, M, B, N] -> [*batch, M, N] in batch order
    sizes = [batch[i] for i in shared] + [batch[i] for i in a_only]
    out = out.reshape(*sizes, m, *[batch[i] for i in b_only], n)
    src = [*shared, *a_only, nb, *b_only, nb + 1]  # which batch/matrix dim each out dim is
    out = out.permute(*[src.index(d) for d in range(nb + 2) if d in src])
    out = out.reshape(*[batch[i] if i in src else 1 for i in range(nb)], m, n)
    return out if bias is None else out + bias


def _bias_columns(bias: Tensor, batch: Sequence[int], b_only: list[int], n: int) -> Tensor | None:
    """``bias`` (broadcasting to ``[*batch, M, N]``) as the ``[B * N]`` addend of the one
    ``mm`` whose columns are ``b``'s own batch dims ``b_only`` then ``N``; None if it varies
    along ``M`` or along a dim folded into the rows."""
    nb = len(batch)
    if bias.dim() > nb + 2:
        return None
    full = [1] * (nb + 2 - bias.dim()) + list(bias.shape)
    if full[-2] != 1 or full[-1] not in (1, n):
        return None
    if any(full[i] != 1 and i not in b_only for i in range(nb)):
        return None
    cols = bias.reshape(full).expand(*[batch[i] if i in b_only else 1 for i in range(nb)], 1, n)
    return cols.reshape(-1)  # a copy only if the bias broadcasts along a column dim: small


def _meta_shape(node: fx.Node) -> list[int] | None:
    val = node.meta.get("val")
    return list(val.shape) if isinstance(val, Tensor) else None


def _broadcast_base(node: fx.Node) -> tuple[fx.Node, list[int]] | None:
    """``(y, full)`` if ``node`` is ``reshape([clone](expand(y, full)), [b, R, C])``."""
    if node.target not in _VIEWS:
        return None
    x = node.args[0]
    if not isinstance(x, fx.Node):
        return None
    if x.target in _CLONES and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    if x.target is not aten.expand.default or not isinstance(x.args[0], fx.Node):
        return None
    full = list(cast("Sequence[int]", x.args[1]))  # expand(y, sizes)
    shape = _meta_shape(node)
    if shape is None or len(shape) != 3 or len(full) < 3 or full[-2:] != shape[1:]:
        return None
    if math.prod(full[:-2]) != shape[0] or any(not isinstance(d, int) for d in full):
        return None
    return _smallest(x.args[0], full), full


def _padded(shape: list[int], n: int) -> list[int]:
    return [1] * (n - len(shape)) + shape


def _smallest(y: fx.Node, full: list[int]) -> fx.Node:
    """Walk back from ``y`` through expands, clones and reshapes that only add or drop
    leading 1s (vmap's own), while the value still broadcasts to ``full``."""
    while y.target in _VIEWS or y.target in _CLONES or y.target is aten.expand.default:
        x = y.args[0]
        if not isinstance(x, fx.Node):
            break
        shape_x, shape_y = _meta_shape(x), _meta_shape(y)
        if shape_x is None or shape_y is None or len(shape_x) > len(full):
            break
        px = _padded(shape_x, len(full))
        if any(d not in (1, f) for d, f in zip(px, full, strict=True)):
            break
        if y.target in _VIEWS and px != _padded(shape_y, len(full)):
            break  # a reshape that moves elements between dims
        y = x
    return y


def fold_broadcast_bmms(gm: fx.GraphModule) -> int:
    """Rewrite the broadcast ``bmm``s of ``gm`` in place (see the module doc); returns how
    many. A ``bmm`` whose operands both vary along every batch dim is left alone."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.bmm.default:
            continue
        sides = [_broadcast_base(a) for a in node.args[:2]]
        known = [side for side in sides if side is not None]
        if not known or any(side[1][:-2] != known[0][1][:-2] for side in known):
            continue
        batch = known[0][1][:-2]
        shapes = [_meta_shape(a) for a in node.args[:2]]
        if any(shape is None for shape in shapes):
            continue
        for i, side in enumerate(sides):
            if side is None:  # an operand with every batch dim: only split its batch dim
                with gm.graph.inserting_before(node):
                    split = [*batch, *shapes[i][1:]]  # type: ignore[index]
                    base = gm.graph.call_function(aten.reshape.default, (node.args[i], split))
                base.meta["val"] = node.args[i].meta["val"].reshape(split)
                sides[i] = (base, split)
        (a, _), (b, full) = sides[0], sides[1]  # type: ignore[misc]
        sa, sb = _meta_shape(a), _meta_shape(b)
        if sa is None or sb is None:
            continue
        pad_a = [1] * (len(full) - len(sa)) + sa
        pad_b = [1] * (len(full) - len(sb)) + sb
        if all(x > 1 and y > 1 for x, y in zip(pad_a[:-2], pad_b[:-2], strict=True)):
            continue  # nothing broadcast: bmm is already right
        out_shape = _meta_shape(node)
        users = list(node.users)
        direct = (
            bool(users)
            and out_shape is not None
            and all(
                u.target in _VIEWS
                and list(cast("Sequence[int]", u.args[1])) == [*batch, *out_shape[1:]]
                for u in users
            )
        )
        with gm.graph.inserting_before(node):
            folded = gm.graph.call_function(broadcast_matmul, (a, b, batch))
            if direct:
                for u in users:
                    u.replace_all_uses_with(folded)
            else:
                flat = gm.graph.call_function(aten.reshape.default, (folded, out_shape))
                node.replace_all_uses_with(flat)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def fuse_bias_adds(gm: fx.GraphModule) -> int:
    """``add(reshape(...(mm(a, b))), bias)`` with a 1-D ``bias`` over the columns, as vmap batches
    a linear layer whose input alone varies along the mesh, becomes ``reshape(addmm(bias, a,
    b))``: one pass over the output instead of two, as the unsharded ``addmm`` does. Returns
    how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs:
            continue
        if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        for view, bias in (node.args, reversed(node.args)):
            mm = view
            while mm.target in _VIEWS and isinstance(mm.args[0], fx.Node) and len(mm.users) == 1:
                mm = mm.args[0]  # vmap's reshapes between the mm and the add
            if mm is view or len(mm.users) != 1:
                continue
            if mm.target is broadcast_matmul:
                if _fold_broadcast_bias(gm, node, view, mm, bias):
                    count += 1
                    break
                continue
            if mm.target is not aten.mm.default:
                continue
            out, b_shape = _meta_shape(mm), _meta_shape(bias)
            shape = _meta_shape(node)
            if out is None or b_shape != out[1:] or shape != _meta_shape(view):
                continue
            if bias.meta["val"].dtype != mm.meta["val"].dtype:
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(aten.addmm.default, (bias, *mm.args))
                flat = gm.graph.call_function(aten.reshape.default, (fused, shape))
            fused.meta["val"], flat.meta["val"] = mm.meta["val"], node.meta["val"]
            node.replace_all_uses_with(flat)
            count += 1
            break
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _fold_broadcast_bias(
    gm: fx.GraphModule, add: fx.Node, view: fx.Node, bmm: fx.Node, bias: fx.Node
) -> bool:
    """``add(view(broadcast_matmul(a, b, batch)), bias)`` as ``broadcast_matmul(a, b, batch,
    bias)`` (vmap's batching rule for a column-parallel linear layer: ``mm``, then its bias
    added), when the view keeps the product's ``[*batch, M, N]`` shape and the add's result
    has it too."""
    if len(bmm.args) != 3 or bmm.kwargs:
        return False
    a, b, batch = bmm.args
    sa, sb = _meta_shape(a), _meta_shape(b)  # type: ignore[arg-type]
    if sa is None or sb is None:
        return False
    shape = [*cast("Sequence[int]", batch), sa[-2], sb[-1]]
    val, bval = add.meta.get("val"), bias.meta.get("val")
    if _meta_shape(view) != shape or _meta_shape(add) != shape or not isinstance(bval, Tensor):
        return False
    if not isinstance(val, Tensor) or bval.dtype != val.dtype or bval.dim() > len(shape):
        return False
    full = [1] * (len(shape) - bval.dim()) + list(bval.shape)
    if full[-2] != 1 or any(d not in (1, s) for d, s in zip(full, shape, strict=True)):
        return False
    with gm.graph.inserting_before(add):
        fused = gm.graph.call_function(broadcast_matmul, (a, b, batch, bias))
    fused.meta["val"] = val
    add.replace_all_uses_with(fused)
    return True
