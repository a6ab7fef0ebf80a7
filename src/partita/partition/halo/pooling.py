"""Pooling pieces of the halo lowering: pooling arguments, max_pool indices between window
and global flat positions, and avg_pool's global divisors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx as fx

from partita.partition.emit import Proxy
from partita.partition.halo.exchange import window_start
from partita.partition.halo.geometry import (
    AVGPOOL,
    AVGPOOL_BWD,
    BACKWARD_OPS,
    MAXPOOL,
    MAXPOOL_BWD,
    Geo,
    HaloPlan,
    WindowedOp,
    aten,
    int_list,
    node_arg,
)

if TYPE_CHECKING:
    from partita.partition.emit import Emitter

#: The windowed dims that exchange halos: dim -> (its geometry, mesh axes, exchange).
Halos = dict[int, tuple[Geo, tuple[str, ...], HaloPlan]]


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


def _spatial_offsets(e: Emitter, op: WindowedOp, halos: Halos, like: Proxy) -> list[Any]:
    """Per spatial dim (last two): the window's first global row (a proxy, or 0)."""
    offs: list[Any] = []
    for d in sorted(op.geos):
        if d in halos:
            g, axes, h = halos[d]
            offs.append(window_start(e, like, axes, g, h))
        else:
            offs.append(0)
    return offs


def _moved(v: Proxy, offset: Any, sign: int = 1) -> Proxy:
    """``v + sign * offset``; no node when the offset is the constant 0 (a dim not split)."""
    if isinstance(offset, int):
        return v
    return v + offset if sign > 0 else v - offset


def indices_to_global(
    e: Emitter, op: WindowedOp, idx: Proxy, wshape: list[int], halos: Halos, like: Proxy
) -> Proxy:
    """max_pool indices, flat positions in the window, as flat positions in the global input."""
    if not halos:
        return idx
    _, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(e, op, halos, like)
    h = torch.div(idx, wshape[dw], rounding_mode="floor")
    w = idx.remainder(wshape[dw])
    return _moved(h, off_h) * op.x_shape[dw] + _moved(w, off_w)


def indices_to_local(
    e: Emitter, op: WindowedOp, idx: Proxy, wshape: list[int], halos: Halos, like: Proxy
) -> Proxy:
    """Global flat max_pool indices as flat positions in this device's window."""
    if not halos:
        return idx
    dh, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(e, op, halos, like)
    h = torch.div(idx, op.x_shape[dw], rounding_mode="floor")
    w = idx.remainder(op.x_shape[dw])
    flat = _moved(h, off_h, -1) * wshape[dw] + _moved(w, off_w, -1)
    return flat.clamp(0, wshape[dh] * wshape[dw] - 1)


def avg_divisor(e: Emitter, op: WindowedOp, halos: Halos, like: Proxy) -> Proxy:
    """avg_pool2d's divisor of each local output (PyTorch's formula, per global position)."""
    node = e.node
    include = bool(
        node_arg(node, 6 if node.target is AVGPOOL_BWD else 5, "count_include_pad", True)
    )
    dims = sorted(op.geos)
    facs = []
    for i, d in enumerate(dims):
        g = op.geos[d]
        if d in halos:  # this device's outputs: t*c_out + [0, c_out)
            _, axes, h = halos[d]
            o = e.arange(h.c_out) + e.axis_index(like, axes) * h.c_out
            size = h.c_out
        else:
            o = e.arange(g.m)
            size = g.m
        start = o * g.stride - g.pad
        end = (start + g.kernel).clamp_max(g.n + g.pad)
        if include:
            cnt = end - start
        else:
            cnt = end.clamp_max(g.n) - start.clamp_min(0)
        cnt = cnt.clamp_min(1)
        facs.append(cnt.reshape([size] + [1] * (len(dims) - 1 - i)))
    x = cast(fx.Node, node.args[0])  # the pooled input
    return aten._to_copy.default(facs[0] * facs[1], dtype=x.meta["val"].dtype)


def avg_pool_local(
    e: Emitter, op: WindowedOp, xw: Proxy, pad: list[int], halos: Halos, like: Proxy
) -> Proxy:
    """avg_pool2d on the window: a local sum (``divisor_override=1``) over the global divisor."""
    node = e.node
    ks = int_list(node.args[1], 2)
    stride = int_list(node_arg(node, 2, "stride"), 2, ks)
    ceil_mode = node_arg(node, 4, "ceil_mode", False)
    include = node_arg(node, 5, "count_include_pad", True)
    over = node_arg(node, 6, "divisor_override")
    if over is not None:
        return AVGPOOL(xw, ks, stride, pad, ceil_mode, include, over)
    s = AVGPOOL(xw, ks, stride, pad, ceil_mode, include, 1)
    return s / avg_divisor(e, op, halos, like)
