"""A ``cat`` whose every use reshapes it back into its pieces becomes a stack of the pieces.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (their ATen decompositions) concatenate the per-step
outputs ``[B, H]`` along dim 0 into ``[T*B, H]`` and view that as ``[T, B, H]``; autograd does
the same with the per-step gradients. The merged ``[T*B]`` dim cannot keep a split of ``B``
(a block of ``T*B`` rows holds whole steps, not a slice of every step), so a batch-split
program re-tiles every step's rows between the devices (one collective per step) and moves
them back for the reshape. The pair is a stack: ``cat([x.unsqueeze(d) for x in xs], d)`` has
the reshape's shape and values, and a ``cat`` along a new, unsplit dim keeps the other dims'
split, so the batch split passes through with no collective at all.

:func:`stack_cat_reshapes` rewrites ``reshape(cat(xs, d), shape)``, where every piece has the
same size ``m`` along ``d`` and ``shape`` is the cat's shape with dim ``d`` written as
``(len(xs), m)``, into a ``cat`` of the pieces, each reshaped to size 1 at ``d``, along ``d``.
The cat itself goes when the reshape was its only use (dead code), and stays for other uses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from partita.capture.fx_nodes import add_node

__all__ = ["stack_cat_reshapes"]

aten = torch.ops.aten


def stack_cat_reshapes(gm: fx.GraphModule) -> None:
    """Rewrite, in place, each ``reshape`` of a ``cat`` that splits the cat dim back into its
    equal pieces as a ``cat`` of the pieces along a new dim (module docstring)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.reshape.default:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "call_function":
            continue
        if src.target != aten.cat.default:
            continue
        pieces = _equal_pieces(src, node)
        if pieces is None:
            continue
        xs, dim = pieces
        with gm.graph.inserting_before(node):
            units = []
            for x in xs:
                xv = x.meta["val"]
                shape = [*xv.shape[:dim], 1, *xv.shape[dim:]]
                u = add_node(gm.graph, aten.reshape.default, (x, shape))
                u.meta = dict(src.meta)
                u.meta["val"] = xv.reshape(shape)
                units.append(u)
            new = add_node(gm.graph, aten.cat.default, (units, dim))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


def _equal_pieces(cat: fx.Node, reshape: fx.Node) -> tuple[list[fx.Node], int] | None:
    """``(pieces, dim)`` when ``reshape`` splits ``cat``'s dim into ``(len(pieces), m)`` with
    every piece of size ``m`` along it (and keeps every other dim), else ``None``."""
    args: tuple[Any, ...] = cat.args
    xs = args[0]
    if not isinstance(xs, (list, tuple)) or len(xs) < 2:
        return None
    if not all(isinstance(x, fx.Node) for x in xs):
        return None
    out = cat.meta.get("val")
    res = reshape.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(res, torch.Tensor) or out.dim() == 0:
        return None
    raw = args[1] if len(args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(raw, int):
        return None
    dim = raw % out.dim()
    vals = [x.meta.get("val") for x in xs]
    if not all(isinstance(v, torch.Tensor) and v.dim() == out.dim() for v in vals):
        return None
    m = vals[0].shape[dim]
    if m == 0 or any(v.shape[dim] != m or v.dtype != out.dtype for v in vals):
        return None
    want = (*out.shape[:dim], len(xs), m, *out.shape[dim + 1 :])
    if tuple(res.shape) != want:
        return None
    return list(xs), dim
