"""Pooling pieces of the halo lowering: pooling arguments, max_pool indices between window
and global flat positions, and avg_pool's global divisors."""

from __future__ import annotations

import torch
import torch.fx as fx

from partita.partition.halo.exchange import window_start
from partita.partition.halo.geometry import (
    AVGPOOL,
    AVGPOOL_BWD,
    BACKWARD_OPS,
    MAXPOOL,
    MAXPOOL_BWD,
    aten,
    int_list,
    node_arg,
    partita_ops,
)


def pool_args(node: fx.Node) -> tuple[list[int], list[int], list[int], bool]:
    """(kernel_size, stride, dilation, ceil_mode) of a pooling op or its backward."""
    t = node.target
    xi = 1 if t in BACKWARD_OPS else 0
    ks = int_list(node_arg(node, 1 + xi, "kernel_size"), 2)
    stride = int_list(node_arg(node, 2 + xi, "stride"), 2, ks)
    if t in (MAXPOOL, MAXPOOL_BWD):
        dil = int_list(node_arg(node, 4 + xi, "dilation", 1), 2)
        ceil = bool(node_arg(node, 5 + xi, "ceil_mode", False))
    else:
        dil = [1, 1]
        ceil = bool(node_arg(node, 4 + xi, "ceil_mode", False))
    return ks, stride, dil, ceil


def _spatial_offsets(low, op, halos, like):
    """Per spatial dim (last two): the window's first global row (a node, or 0)."""
    offs = []
    for d in sorted(op.geos):
        if d in halos:
            g, axes, h = halos[d]
            offs.append(window_start(low, like, axes, g, h))
        else:
            offs.append(0)
    return offs


def indices_to_global(low, op, idx, wshape, halos, like):
    if not halos:
        return idx
    _, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(low, op, halos, like)
    lw = wshape[dw]
    h = low.call(aten.div.Tensor_mode, idx, lw, rounding_mode="floor")
    w = low.call(aten.remainder.Scalar, idx, lw)
    if not isinstance(off_h, int):
        h = low.call(aten.add.Tensor, h, off_h)
    if not isinstance(off_w, int):
        w = low.call(aten.add.Tensor, w, off_w)
    return low.call(aten.add.Tensor, low.call(aten.mul.Tensor, h, op.x_shape[dw]), w)


def indices_to_local(low, op, idx, wshape, halos, like):
    if not halos:
        return idx
    dh, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(low, op, halos, like)
    n_w = op.x_shape[dw]
    h = low.call(aten.div.Tensor_mode, idx, n_w, rounding_mode="floor")
    w = low.call(aten.remainder.Scalar, idx, n_w)
    if not isinstance(off_h, int):
        h = low.call(aten.sub.Tensor, h, off_h)
    if not isinstance(off_w, int):
        w = low.call(aten.sub.Tensor, w, off_w)
    flat = low.call(aten.add.Tensor, low.call(aten.mul.Tensor, h, wshape[dw]), w)
    return low.call(aten.clamp.default, flat, 0, wshape[dh] * wshape[dw] - 1)


def avg_divisor(low, node, op, halos, like) -> fx.Node:
    """avg_pool2d's divisor of each local output (PyTorch's formula, per global position)."""
    include = bool(
        node_arg(node, 6 if node.target is AVGPOOL_BWD else 5, "count_include_pad", True)
    )
    dims = sorted(op.geos)
    facs = []
    for i, d in enumerate(dims):
        g = op.geos[d]
        if d in halos:
            _, axes, h = halos[d]
            t = low.call(partita_ops.axis_index.default, like, list(axes))
            o = low.call(
                aten.add.Tensor,
                low.call(aten.arange.default, h.c_out, dtype=torch.int64),
                low.call(aten.mul.Tensor, t, h.c_out),
            )
            size = h.c_out
        else:
            o = low.call(aten.arange.default, g.m, dtype=torch.int64)
            size = g.m
        start = low.call(aten.sub.Tensor, low.call(aten.mul.Tensor, o, g.stride), g.pad)
        end = low.call(
            aten.clamp_max.default, low.call(aten.add.Tensor, start, g.kernel), g.n + g.pad
        )
        if include:
            cnt = low.call(aten.sub.Tensor, end, start)
        else:
            cnt = low.call(
                aten.sub.Tensor,
                low.call(aten.clamp_max.default, end, g.n),
                low.call(aten.clamp_min.default, start, 0),
            )
        cnt = low.call(aten.clamp_min.default, cnt, 1)
        shape = [size] + [1] * (len(dims) - 1 - i)
        facs.append(low.call(aten.reshape.default, cnt, shape))
    div = low.call(aten.mul.Tensor, facs[0], facs[1])
    return low.call(aten._to_copy.default, div, dtype=node.args[0].meta["val"].dtype)


def avg_pool_local(low, node, op, xw, pad, halos, like) -> fx.Node:
    args = list(node.args)
    ks = int_list(args[1], 2)
    stride = int_list(node_arg(node, 2, "stride"), 2, ks)
    ceil_mode = node_arg(node, 4, "ceil_mode", False)
    include = node_arg(node, 5, "count_include_pad", True)
    over = node_arg(node, 6, "divisor_override")
    if over is not None:
        return low.call(AVGPOOL, xw, ks, stride, pad, ceil_mode, include, over)
    s = low.call(AVGPOOL, xw, ks, stride, pad, ceil_mode, include, 1)
    return low.call(aten.div.Tensor, s, avg_divisor(low, node, op, halos, like))
