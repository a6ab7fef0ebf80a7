"""Emitting a reshard plan: the per-device fx nodes for a list of :class:`ReshardStep`.

``plan_reshard`` (``partition.reshard``) decides the steps; :func:`emit_reshard` writes them
into a graph as partita mesh ops (``partita/ir/collectives.py``) and local aten ops, each node with
its ``node_meta.local_shape`` and, when the input has a fake value, a ``meta["val"]``.

This module does not choose steps or record them in the Plan (``partition.resharding`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import fx

from partita.ir import node_meta
from partita.partition import permute_pieces
from partita.partition.reshard import ReshardStep
from partita.values.mesh import Mesh

__all__ = ["emit_reshard"]


def _op_args(step: ReshardStep) -> tuple[Any, ...]:
    return tuple(list(a) if isinstance(a, tuple) else a for a in step.args)


def _pad_arg(ndim: int, dim: int, extra: int) -> list[int]:
    return [0, 0] * (ndim - dim - 1) + [0, extra]


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...]) -> fx.Node:
    node = graph.call_function(target, args)
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    if vals and all(v is not None for v in vals):
        fake_args = fx.node.map_arg(args, lambda a: a.meta["val"])
        mode = torch._guards.detect_fake_mode([v for v in vals])
        try:
            if mode is not None:
                with mode:
                    node.meta["val"] = target(*fake_args)
        except Exception:
            node.meta.pop("val", None)
    return node


def emit_reshard(graph: fx.Graph, x: fx.Node, steps: Sequence[ReshardStep], mesh: Mesh) -> fx.Node:
    """Insert ``steps`` after the graph's current insertion point; return the resharded node.

    Each node gets ``node_meta.local_shape`` (the step's ``out_local_shape``) and, when ``x`` has a
    fake ``meta["val"]``, a ``meta["val"]`` from the ops' fake implementations.
    """
    aten = torch.ops.aten
    axes = list(mesh.axis_names)
    # a piecewise permute's source tile and received pieces
    source, received = x, cast("list[fx.Node] | None", None)
    for step in steps:
        ndim = len(step.in_local_shape)
        if step.kind == "take_piece":
            source, received = (x, []) if received is None else (source, [*received, x])
            tile, piece, slots = step.args
            x = permute_pieces.emit_take(graph, _call, source, tile, piece, slots, axes)
        elif step.kind == "place_pieces":
            out = step.out_local_shape
            piece, table = step.args
            received = [*(received or ()), x]
            x = permute_pieces.emit_place(graph, _call, received, out, piece, table, axes)
            received = None
        elif step.kind == "slice":
            dim, size = step.args
            x = _call(graph, aten.slice.Tensor, (x, dim, 0, size))
        elif step.kind == "pad":
            dim, size = step.args
            pad = _pad_arg(ndim, dim, size - step.in_local_shape[dim])
            x = _call(graph, aten.constant_pad_nd.default, (x, pad, 0))
        elif step.kind == "make_partial":
            reduce_op, axes = step.args
            if reduce_op == "sum":
                index = _call(graph, torch.ops.partita.axis_index.default, (x, list(axes)))
                keep = _call(graph, aten.eq.Scalar, (index, 0))
                x = _call(graph, aten.where.ScalarOther, (keep, x, 0))
        else:
            op = getattr(torch.ops.partita, step.kind).default
            x = _call(graph, op, (x, *_op_args(step)))
        node_meta.set_local_shape(x, step.out_local_shape)
    return x
