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

__all__ = ["fold_permutes", "fold_views"]

_PERMUTE = torch.ops.aten.permute.default
_VIEW = torch.ops.aten.view.default
_SAME_SHAPE = {_VIEW, torch.ops.aten.expand.default, torch.ops.aten.reshape.default}
_ALIAS = torch.ops.aten.alias.default


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
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


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
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _same_shape(node: fx.Node, src: fx.Node) -> bool:
    a, b = node.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
