"""The ``halo`` handler itself: when it applies, and the lowering of each op (convolution,
max/avg pooling, constant_pad_nd and their backwards) on exchanged windows, with the gather
fallback for dims whose halo exceeds a tile."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from partita.layout import local_shape
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
    Geo,
    HaloPlan,
    aten,
    halo_plan,
    node_arg,
    partita_ops,
    read_op,
    sharded_windowed_dims,
    window_shape,
)
from partita.partition.halo.pooling import (
    avg_divisor,
    avg_pool_local,
    indices_to_global,
    indices_to_local,
    pool_args,
)
from partita.partition.handlers import Handler, register
from partita.partition.masks import emit_mask_padding
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.spec import Sharding

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


def _pack(*xs: Any) -> tuple[Any, ...]:
    """A tuple-valued node for multi-result ops whose results are built separately."""
    return tuple(xs)


# --- the handler -----------------------------------------------------------------------------


def _cin_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    op = read_op(node)
    if sharded_windowed_dims(rule, op, assign):
        return True
    has_bias = node.target is CONV and node_arg(node, 2, "bias") is not None
    return has_bias and bool(_cin_axes(node, rule, assign))


def _lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    op = read_op(node)
    sharded = sharded_windowed_dims(rule, op, assign)
    halos: dict[int, tuple[Geo, tuple[str, ...], HaloPlan]] = {}
    gathered: dict[str, tuple[str, ...]] = {}  # windowed factor -> its mesh axes
    for d, (f, *axes) in sorted(sharded.items()):
        g = op.geos[d]
        h = halo_plan(g, low.mesh.axes_size(axes))
        if h is None:
            gathered[f] = tuple(axes)
        else:
            halos[d] = (g, tuple(axes), h)
    assign2 = {f: a for f, a in assign.items() if f not in gathered}
    operands = low.localize_operands(node, rule, assign2)
    in_shardings = [
        Sharding(low.mesh, low.dims_of(fs, assign2)) if fs is not None else None
        for fs in rule.operands
    ]
    x_val = node.args[op.x_index].meta["val"]
    x_shape = list(local_shape(in_shardings[op.x_index], op.x_shape))
    dtype = x_val.dtype
    x = operands[op.x_index]

    def window(x: fx.Node, fill: float) -> tuple[fx.Node, list[int], list[int]]:
        shape = list(x_shape)
        for _, (g, axes, h) in sorted(halos.items()):
            x, shape = exchange_halos(low, node, x, shape, dtype, g, axes, h, fill)
        return x, shape, [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]

    def unwindow(gx: fx.Node, shape: list[int]) -> fx.Node:
        for _, (g, axes, h) in sorted(halos.items(), reverse=True):
            gx, shape = return_halo(low, node, gx, shape, dtype, g, axes, h)
        return gx

    t = node.target
    args = list(node.args)
    rest_kwargs = dict(node.kwargs)
    if t is PAD:
        win, _, _ = window(x, op.fill)
        pads = list(node_arg(node, 1, "pad"))
        for d in halos:
            i = 2 * (len(op.x_shape) - 1 - d)
            pads[i] = pads[i + 1] = 0
        out = win
        if any(pads):
            out = low.call(PAD, win, pads, *args[2:], **rest_kwargs)
        elif out is x:
            out = low.call(aten.clone.default, x)
    elif t is CONV:
        xw, _, pad = window(x, op.fill)
        w = operands[1]
        bias = operands[2] if len(operands) > 2 else None
        cin = _cin_axes(node, rule, assign2)
        if bias is not None and cin:
            first = low.call(
                aten.eq.Scalar, low.call(partita_ops.axis_index.default, bias, list(cin)), 0
            )
            bias = low.call(aten.where.ScalarOther, first, bias, 0.0)
        out = low.call(
            t,
            xw,
            w,
            bias,
            node_arg(node, 3, "stride"),
            pad,
            node_arg(node, 5, "dilation"),
            node_arg(node, 6, "transposed"),
            node_arg(node, 7, "output_padding"),
            node_arg(node, 8, "groups"),
        )
    elif t in (MAXPOOL, AVGPOOL):
        xw, wshape, pad = window(x, op.fill)
        if t is MAXPOOL:
            ks, stride, dil, ceil = pool_args(node)
            res = low.call(t, xw, ks, stride, pad, dil, ceil)
            vals = low.call(operator.getitem, res, 0)
            idx = low.call(operator.getitem, res, 1)
            idx = indices_to_global(low, op, idx, wshape, halos, x)
            out = low.call(_pack, vals, idx)
        else:
            out = avg_pool_local(low, node, op, xw, pad, halos, x)
    elif t is CONV_BWD:
        gout, _, w = operands
        mask = list(node_arg(node, 10, "output_mask"))
        if mask[1]:
            xw, wshape, pad = window(x, op.fill)
        else:
            wshape = window_shape(x_shape, halos)
            xw = low.call(aten.new_zeros.default, x, wshape)
            pad = [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]
        res = low.call(
            t,
            gout,
            xw,
            w,
            node_arg(node, 3, "bias_sizes"),
            node_arg(node, 4, "stride"),
            pad,
            node_arg(node, 6, "dilation"),
            node_arg(node, 7, "transposed"),
            node_arg(node, 8, "output_padding"),
            node_arg(node, 9, "groups"),
            mask,
        )
        gx = low.call(operator.getitem, res, 0) if mask[0] else None
        if gx is not None:
            gx = unwindow(gx, wshape)
        gw = low.call(operator.getitem, res, 1) if mask[1] else None
        gb = low.call(operator.getitem, res, 2) if mask[2] else None
        out = low.call(_pack, gx, gw, gb)
    elif t in (MAXPOOL_BWD, AVGPOOL_BWD):
        gout = operands[0]
        for d, (g, axes, _) in halos.items():
            gout = emit_mask_padding(low.graph, gout, low.mesh, axes, g.m, len(op.x_shape), d, 0)
        wshape = window_shape(x_shape, halos)
        xw = low.call(aten.new_zeros.default, x, wshape)
        pad = [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]
        ks, stride, dil, ceil = pool_args(node)
        if t is MAXPOOL_BWD:
            idx = indices_to_local(low, op, operands[2], wshape, halos, x)
            gx = low.call(t, gout, xw, ks, stride, pad, dil, ceil, idx)
        else:
            include = bool(node_arg(node, 6, "count_include_pad", True))
            over = node_arg(node, 7, "divisor_override")
            if over is None:
                gout = low.call(aten.div.Tensor, gout, avg_divisor(low, node, op, halos, x))
                over = 1
            gx = low.call(t, gout, xw, ks, stride, pad, ceil, include, over)
        out = unwindow(gx, wshape)
    else:  # pragma: no cover - read_op raised already
        raise NotImplementedError(str(t))
    return _finish_gathered(low, node, rule, assign, gathered, out)


def _finish_gathered(low, node, rule, assign, gathered, out) -> fx.Node:
    """Results of an op computed whole on gathered windowed dims: cut each such dim to the
    tile the assignment wants; results that sum over it become partial over its axes."""
    if not gathered:
        return out
    multi = isinstance(node.meta["val"], (tuple, list))
    items = []
    for j, fs in enumerate(rule.results):
        r = low.call(operator.getitem, out, j) if multi else out
        if fs is not None:
            for d, dim in enumerate(fs):
                for f in dim:
                    if f in gathered:
                        axes = list(gathered[f])
                        r = low.call(
                            partita_ops.shard_slice.default, r, d, axes, low.mesh.axes_size(axes)
                        )
            made_partial = [
                a for f in rule.result_reductions.get(j, ()) if f in gathered for a in gathered[f]
            ]
            if made_partial:
                idx = low.call(partita_ops.axis_index.default, r, made_partial)
                r = low.call(aten.where.ScalarOther, low.call(aten.eq.Scalar, idx, 0), r, 0.0)
        items.append(r)
    return low.call(_pack, *items) if multi else items[0]


register(Handler(HandlerName.HALO.value, _applies, _lower))
