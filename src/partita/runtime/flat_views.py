"""Chains of ``permute``s in a flat graph as one ``permute``, and identity ``permute``s dropped.

vmap's batching rules move the device dims to the front and back again around each op, so a
segment's traced flat graph (``runtime.flat_trace``) has ``permute(permute(x, a), b)`` and
``permute(x, [0, 1, ..., n-1])`` by the dozen (the demo GPT's 2-D step: 34 chains and 21
identities in 110 permutes). Each is a Python call and a dispatch for a view. A permute of a
permute is the permute by the composed order, and an identity permute is its input: both are
views of the same storage either way, so no result changes and no copy appears or goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import fx

__all__ = ["collapse_view_chains", "fold_permutes", "fold_views"]

_PERMUTE = torch.ops.aten.permute.default
_VIEW = torch.ops.aten.view.default
_SAME_SHAPE = {_VIEW, torch.ops.aten.expand.default, torch.ops.aten.reshape.default}
_ALIAS = torch.ops.aten.alias.default
_AS_STRIDED = torch.ops.aten.as_strided.default
#: Ops whose result is always a view of their first input (never a copy).
_VIEW_OPS = frozenset(
    (
        _VIEW,
        _PERMUTE,
        _ALIAS,
        _AS_STRIDED,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.expand.default,
        torch.ops.aten.select.int,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.unsqueeze.default,
        torch.ops.aten.squeeze.dim,
        torch.ops.aten.squeeze.dims,
        torch.ops.aten.squeeze.default,
        torch.ops.aten.t.default,
        torch.ops.aten.transpose.int,
        torch.ops.aten.diagonal.default,
        torch.ops.aten.unfold.default,
    )
)


def fold_permutes(gm: fx.GraphModule) -> int:
    """Compose ``permute`` chains and drop identity ``permute``s in ``gm``; returns how many
    permutes went."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _PERMUTE or node.kwargs:
            continue
        src, order = node.args[0], list(cast("Sequence[int]", node.args[1]))
        if isinstance(src, fx.Node) and src.target is _PERMUTE and not src.kwargs:
            inner = list(cast("Sequence[int]", src.args[1]))
            n = len(inner)
            order = [inner[d % n] for d in order]  # x.permute(a).permute(b) = x.permute(a[b])
            node.args = (src.args[0], order)
            if not src.users:
                gm.graph.erase_node(src)
                count += 1
            src = node.args[0]
        n = len(order)
        if [d % n for d in order] == list(range(n)):
            node.replace_all_uses_with(cast(fx.Node, src))
            gm.graph.erase_node(node)
            count += 1
    return _recompiled(gm, count)


def fold_views(gm: fx.GraphModule) -> int:
    """Compose ``view`` chains, and drop ``view``/``reshape``/``expand`` to the shape their
    input already has and ``alias``; returns how many nodes went.

    Re-tracing a step (``runtime.fused_step``) spells each ``reshape`` as the ``view`` it
    is, and the batching rules' reshapes meet in chains (``view(view(x, a), b)``), many of
    them to the same shape. Whether a view exists depends only on the order and addresses of
    the elements, which a view keeps, so ``view(view(x, a), b)`` is ``view(x, b)``; a view
    to its input's own shape is its input. Needs the nodes' ``meta["val"]`` (a traced
    graph); a node without it is left alone."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node):
            continue
        if node.target is _VIEW and src.target is _VIEW and not src.kwargs:
            node.args = (src.args[0], *node.args[1:])
            if not src.users:
                gm.graph.erase_node(src)
                count += 1
            src = node.args[0]
        if node.target is _ALIAS or (node.target in _SAME_SHAPE and _same_shape(node, src)):
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            count += 1
    return _recompiled(gm, count)


def _recompiled(gm: fx.GraphModule, count: int) -> int:
    """``count``, after checking and regenerating ``gm`` if any node went."""
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _same_shape(node: fx.Node, src: fx.Node) -> bool:
    a, b = node.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def collapse_view_chains(gm: fx.GraphModule) -> int:
    """Each chain of views read by something other than a view as one ``as_strided`` of the
    chain's base, with the sizes, strides and storage offset the traced graph recorded
    (``meta["val"]``); returns how many view nodes went.

    Only for a graph whose strides are those of its real runs: ``runtime.fused_step``, which
    checks the graph against the interpreter on real values before it keeps it, so a kernel
    whose real strides differ from its fake's would be caught there, not read wrongly."""
    base: dict[fx.Node, fx.Node] = {}  # a view node -> the non-view node its chain starts at
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEW_OPS:
            src = node.args[0]
            if isinstance(src, fx.Node):
                base[node] = base.get(src, src)
    before = len(gm.graph.nodes)
    for node, root in base.items():
        src = node.args[0]
        if src is root or all(u in base for u in node.users):
            continue  # a single view, or inside a chain: nothing to save
        val, root_val = node.meta.get("val"), root.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(root_val, torch.Tensor)):
            continue
        with gm.graph.inserting_before(node):
            flat = gm.graph.call_function(
                _AS_STRIDED, (root, list(val.shape), list(val.stride()), val.storage_offset())
            )
        flat.meta["val"] = val
        node.replace_all_uses_with(flat)
    gm.graph.eliminate_dead_code()
    count = before - len(gm.graph.nodes)
    gm.graph.lint()
    gm.recompile()
    return count
