"""The ``halo`` handler itself: when it applies, and the lowering of each op (convolution,
max/avg pooling, constant_pad_nd and their backwards) on exchanged windows, with the gather
fallback for dims whose halo exceeds a tile."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx

from partita.partition.emit import Emitter, Proxy, emitting
from partita.partition.halo.exchange import exchange_halos, return_halo
from partita.partition.halo.geometry import (
    AVGPOOL,
    AVGPOOL_BWD,
    CONV,
    CONV_BWD,
    MAXPOOL,
    MAXPOOL_BWD,
    PAD,
    Assign,
    WindowedOp,
    halo_plan,
    node_arg,
    partita_ops,
    read_op,
    sharded_windowed_dims,
    window_shape,
)
from partita.partition.halo.pooling import (
    Halos,
    avg_divisor,
    avg_pool_local,
    indices_to_global,
    indices_to_local,
    pool_args,
)
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import local_shape
from partita.values.spec import Sharding

# --- the handler -----------------------------------------------------------------------------


def _cin_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    op = read_op(node)
    if sharded_windowed_dims(rule, op, assign):
        return True
    has_bias = node.target is CONV and node_arg(node, 2, "bias") is not None
    return has_bias and bool(_cin_axes(rule, assign))


@dataclass
class _Windows:
    """One op's local operands and the halo exchanges of its windowed input ``x``."""

    e: Emitter
    rule: FactorRule
    assign: Assign  # without the gathered windowed factors
    op: WindowedOp
    operands: list[Proxy]
    x_shape: list[int]  # x's local shape
    dtype: torch.dtype
    halos: Halos

    @property
    def node(self) -> fx.Node:
        return self.e.node

    @property
    def x(self) -> Proxy:
        return self.operands[self.op.x_index]

    def pads(self) -> list[int]:
        """The op's padding on each windowed dim: 0 where the window holds it already."""
        return [0 if d in self.halos else self.op.geos[d].pad for d in sorted(self.op.geos)]

    def window(self) -> tuple[Proxy, list[int], list[int]]:
        """(x's window on every exchanged dim, the window's shape, the op's padding)."""
        x, shape = self.x, list(self.x_shape)
        for _, (g, axes, h) in sorted(self.halos.items()):
            x, shape = exchange_halos(self.e, x, shape, self.dtype, g, axes, h, self.op.fill)
        return x, shape, self.pads()

    def zeros(self) -> tuple[Proxy, list[int], list[int]]:
        """A zero window (for backwards that read only x's shape), its shape, the padding."""
        shape = window_shape(self.x_shape, self.halos)
        return self.x.new_zeros(shape), shape, self.pads()

    def unwindow(self, gx: Proxy, shape: list[int]) -> Proxy:
        """A window's gradient back on this device's tile (halo rows to their owners)."""
        for _, (g, axes, h) in sorted(self.halos.items(), reverse=True):
            gx, shape = return_halo(self.e, gx, shape, self.dtype, g, axes, h)
        return gx


def _constant_pad(w: _Windows) -> Proxy:
    win, _, _ = w.window()
    pads = list(node_arg(w.node, 1, "pad"))
    for d in w.halos:  # the window has these rows already
        i = 2 * (len(w.op.x_shape) - 1 - d)
        pads[i] = pads[i + 1] = 0
    if any(pads):
        return PAD(win, pads, *w.node.args[2:], **w.node.kwargs)
    return win.clone() if win is w.x else win


def _convolution(w: _Windows) -> Proxy:
    node = w.node
    xw, _, pad = w.window()
    bias = w.operands[2] if len(w.operands) > 2 else None
    cin = _cin_axes(w.rule, w.assign)
    if bias is not None and cin:  # the result is partial over cin: add the bias once
        bias = torch.where(w.e.axis_index(bias, cin) == 0, bias, 0.0)
    return CONV(
        xw,
        w.operands[1],
        bias,
        node_arg(node, 3, "stride"),
        pad,
        node_arg(node, 5, "dilation"),
        node_arg(node, 6, "transposed"),
        node_arg(node, 7, "output_padding"),
        node_arg(node, 8, "groups"),
    )


def _max_pool(w: _Windows) -> Proxy:
    xw, wshape, pad = w.window()
    ks, stride, dil, ceil = pool_args(w.node)
    res = MAXPOOL(xw, ks, stride, pad, dil, ceil)
    values = res[0]
    return w.e.tuple(values, indices_to_global(w.e, w.op, res[1], wshape, w.halos, w.x))


def _avg_pool(w: _Windows) -> Proxy:
    xw, _, pad = w.window()
    return avg_pool_local(w.e, w.op, xw, pad, w.halos, w.x)


def _convolution_backward(w: _Windows) -> Proxy:
    node = w.node
    gout, _, weight = w.operands
    mask = list(node_arg(node, 10, "output_mask"))
    xw, wshape, pad = w.window() if mask[1] else w.zeros()  # only grad_weight reads x
    res = CONV_BWD(
        gout,
        xw,
        weight,
        node_arg(node, 3, "bias_sizes"),
        node_arg(node, 4, "stride"),
        pad,
        node_arg(node, 6, "dilation"),
        node_arg(node, 7, "transposed"),
        node_arg(node, 8, "output_padding"),
        node_arg(node, 9, "groups"),
        mask,
    )
    gx = w.unwindow(res[0], wshape) if mask[0] else None
    return w.e.tuple(gx, res[1] if mask[1] else None, res[2] if mask[2] else None)


def _pool_grad(w: _Windows) -> Proxy:
    """The output gradient with its padding rows zeroed (they are not the op's outputs)."""
    gout = w.operands[0]
    for d, (g, axes, _) in w.halos.items():
        gout = w.e.mask_padding(gout, axes, g.m, len(w.op.x_shape), d, 0)
    return gout


def _max_pool_backward(w: _Windows) -> Proxy:
    gout = _pool_grad(w)
    xw, wshape, pad = w.zeros()
    ks, stride, dil, ceil = pool_args(w.node)
    idx = indices_to_local(w.e, w.op, w.operands[2], wshape, w.halos, w.x)
    return w.unwindow(MAXPOOL_BWD(gout, xw, ks, stride, pad, dil, ceil, idx), wshape)


def _avg_pool_backward(w: _Windows) -> Proxy:
    gout = _pool_grad(w)
    xw, wshape, pad = w.zeros()
    ks, stride, _, ceil = pool_args(w.node)
    include = bool(node_arg(w.node, 6, "count_include_pad", True))
    over = node_arg(w.node, 7, "divisor_override")
    if over is None:  # the global divisor of each output, not the window's
        gout = gout / avg_divisor(w.e, w.op, w.halos, w.x)
        over = 1
    return w.unwindow(AVGPOOL_BWD(gout, xw, ks, stride, pad, ceil, include, over), wshape)


#: The lowering of each op the halo handler covers (``geometry.read_op`` reads the same ops).
_LOWER: dict[Any, Callable[[_Windows], Proxy]] = {
    PAD: _constant_pad,
    CONV: _convolution,
    MAXPOOL: _max_pool,
    AVGPOOL: _avg_pool,
    CONV_BWD: _convolution_backward,
    MAXPOOL_BWD: _max_pool_backward,
    AVGPOOL_BWD: _avg_pool_backward,
}


@emitting
def _lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    op = read_op(node)
    halos: Halos = {}
    gathered: dict[str, tuple[str, ...]] = {}  # windowed factor -> its mesh axes
    for d, (f, *axes) in sorted(sharded_windowed_dims(rule, op, assign).items()):
        g = op.geos[d]
        h = halo_plan(g, e.mesh.axes_size(axes))
        if h is None:  # a halo larger than a tile: compute this dim whole
            gathered[f] = tuple(axes)
        else:
            halos[d] = (g, tuple(axes), h)
    kept = {f: a for f, a in assign.items() if f not in gathered}
    x_factors = rule.operands[op.x_index]
    assert x_factors is not None  # the windowed input always has factors
    x_sharding = Sharding(e.mesh, e.low.dims_of(x_factors, kept))
    dtype = cast(fx.Node, node.args[op.x_index]).meta["val"].dtype  # the windowed input
    x_shape = list(local_shape(x_sharding, op.x_shape))
    w = _Windows(e, rule, kept, op, e.operands(rule, kept), x_shape, dtype, halos)
    return _finish_gathered(e, rule, gathered, _LOWER[node.target](w))


def _finish_gathered(
    e: Emitter, rule: FactorRule, gathered: dict[str, tuple[str, ...]], out: Proxy
) -> Proxy:
    """Results of an op computed whole on gathered windowed dims: cut each such dim to the
    tile the assignment wants; results that sum over it become partial over its axes."""
    if not gathered:
        return out
    multi = isinstance(e.node.meta["val"], (tuple, list))
    items = []
    for j, fs in enumerate(rule.results):
        r = out[j] if multi else out
        if fs is not None:
            for d, dim in enumerate(fs):
                for f in dim:
                    if f in gathered:
                        axes = list(gathered[f])
                        r = partita_ops.shard_slice.default(r, d, axes, e.mesh.axes_size(axes))
            made_partial = tuple(
                a for f in rule.result_reductions.get(j, ()) if f in gathered for a in gathered[f]
            )
            if made_partial:  # keep the sum on one member of each group
                r = torch.where(e.axis_index(r, made_partial) == 0, r, 0.0)
        items.append(r)
    return e.tuple(*items) if multi else items[0]


register(Handler(HandlerName.HALO.value, _applies, _lower))
