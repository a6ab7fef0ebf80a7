"""The ``softmax_reduce`` handler: (log_)softmax and their backwards with the softmax dim
sharded - masked local max/sum, each completed by one recorded all_reduce."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from partita.layout import local_shape
from partita.partition.handlers import Handler, register
from partita.partition.special.common import (
    Assign,
    aten,
    axes_of,
    cast_to,
    fake_value,
    mask_padding,
    operand_sharding,
    recorded_all_reduce,
)
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


# --- softmax_reduce -----------------------------------------------------------------------------

_LOG = {aten._log_softmax.default, aten.log_softmax.int, aten._log_softmax_backward_data.default}
_BACKWARD = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}


def _softmax_dim(node: fx.Node) -> int:
    ndim = fake_value(node.args[0]).ndim
    d = node.args[2] if node.target in _BACKWARD else node.args[1]
    return d % max(ndim, 1)


def _softmax_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    if not fake_value(node.args[0]).ndim:
        return ()
    return axes_of(rule, 0, _softmax_dim(node), assign)


def _softmax_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_softmax_axes(node, rule, assign))


def _softmax_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    d = _softmax_dim(node)
    axes = _softmax_axes(node, rule, assign)
    x_val, out_val = fake_value(node.args[0]), node.meta["val"]
    gshape = tuple(x_val.shape)
    n, ndim = gshape[d], len(gshape)
    red_shape = list(local_shape(operand_sharding(low, rule, 0, assign), gshape))
    del red_shape[d]
    red_shape_t = tuple(red_shape)
    dt = out_val.dtype
    is_log = node.target in _LOG

    def reduce(v: fx.Node, op: str, fill: Any, what: str) -> fx.Node:
        v = mask_padding(low, v, axes, n, ndim, d, fill)
        fn = aten.amax.default if op == "max" else aten.sum.dim_IntList
        local = low.call(fn, v, [d])
        return low.call(
            aten.unsqueeze.default,
            recorded_all_reduce(low, node, local, op, axes, red_shape_t, dt, what),
            d,
        )

    if node.target in _BACKWARD:
        grad, out = low.localize_operands(node, rule, assign)
        grad = cast_to(low, grad, fake_value(node.args[0]).dtype, fake_value(node.args[1]).dtype)
        if is_log:  # grad - exp(out) * sum(grad)
            s = reduce(grad, "sum", 0, "sum of the gradient")
            res = low.call(
                aten.sub.Tensor, grad, low.call(aten.mul.Tensor, low.call(aten.exp.default, out), s)
            )
        else:  # grad*out - out * sum(grad*out)
            gy = low.call(aten.mul.Tensor, grad, out)
            s = reduce(gy, "sum", 0, "sum of grad * softmax")
            res = low.call(aten.sub.Tensor, gy, low.call(aten.mul.Tensor, out, s))
        return cast_to(low, res, fake_value(node.args[1]).dtype, dt)

    (x,) = low.localize_operands(node, rule, assign)
    x = cast_to(low, x, x_val.dtype, dt)
    x = mask_padding(low, x, axes, n, ndim, d, -math.inf)
    gmax = reduce(x, "max", -math.inf, "max for a stable softmax")
    shifted = low.call(aten.sub.Tensor, x, gmax)
    e = low.call(aten.exp.default, shifted)
    total = reduce(e, "sum", 0, "sum of exp")
    if is_log:
        res = low.call(aten.sub.Tensor, shifted, low.call(aten.log.default, total))
    else:
        res = low.call(aten.div.Tensor, e, total)
    if node.target == aten._safe_softmax.default:  # rows of only -inf give 0, not NaN
        empty = low.call(aten.eq.Scalar, gmax, -math.inf)
        res = low.call(aten.where.ScalarSelf, empty, 0.0, res)
    return res


register(Handler(HandlerName.SOFTMAX_REDUCE.value, _softmax_applies, _softmax_lower))
