"""The ``softmax_reduce`` handler: (log_)softmax and their backwards with the softmax dim
sharded - masked local max/sum, each completed by one recorded all_reduce."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from partita.partition.emit import Emitter, Proxy, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, axes_of, fake_value, operand_sharding
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import local_shape

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


def _softmax_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_softmax_axes(node, rule, assign))


@emitting
def _softmax_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``softmax(x) = exp(x - max) / sum(exp(x - max))`` with the max and the sum taken over
    every tile of the split dim (one all_reduce each); log_softmax is ``x - max - log(sum)``;
    the backwards need one all_reduce of a sum."""
    d = _softmax_dim(node)
    axes = _softmax_axes(node, rule, assign)
    x_val, out_val = fake_value(node.args[0]), node.meta["val"]
    gshape = tuple(x_val.shape)
    n, ndim = gshape[d], len(gshape)
    row_shape = list(local_shape(operand_sharding(e.low, rule, 0, assign), gshape))
    del row_shape[d]
    dt = out_val.dtype

    def over_the_dim(op: str, v: Proxy, fill: float, what: str) -> Proxy:
        """The max or sum of ``v`` along the split dim (keepdim), the padding set to ``fill``."""
        v = e.mask_padding(v, axes, n, ndim, d, fill)
        local = v.amax([d]) if op == "max" else v.sum([d])
        every = e.all_reduce(local, axes, op, shape=tuple(row_shape), dtype=dt, what=what)
        return every.unsqueeze(d)

    if node.target in _BACKWARD:
        grad, out = e.operands(rule, assign)
        grad = e.cast(grad, fake_value(node.args[0]).dtype, fake_value(node.args[1]).dtype)
        if node.target in _LOG:  # d log_softmax: grad - softmax * sum(grad)
            s = over_the_dim("sum", grad, 0, "sum of the gradient")
            res = grad - torch.exp(out) * s
        else:  # d softmax: out * (grad - sum(grad * out)), as grad*out - out * sum(grad*out)
            gy = grad * out
            s = over_the_dim("sum", gy, 0, "sum of grad * softmax")
            res = gy - out * s
        return e.cast(res, fake_value(node.args[1]).dtype, dt)

    (x,) = e.operands(rule, assign)
    x = e.mask_padding(e.cast(x, x_val.dtype, dt), axes, n, ndim, d, -math.inf)
    top = over_the_dim("max", x, -math.inf, "max for a stable softmax")
    shifted = x - top
    ex = torch.exp(shifted)
    total = over_the_dim("sum", ex, 0, "sum of exp")
    res = shifted - torch.log(total) if node.target in _LOG else ex / total
    if node.target == aten._safe_softmax.default:  # rows of only -inf give 0, not NaN
        res = torch.where(top == -math.inf, 0.0, res)
    return res


register(Handler(HandlerName.SOFTMAX_REDUCE.value, _softmax_applies, _softmax_lower))
