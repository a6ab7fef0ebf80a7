"""The reduction handlers ``mean`` (a masked local sum over the global count, a partial sum)
and ``weighted_mean`` (nll_loss forward/backward with the batch sharded)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.fx.proxy import Proxy

from partita.partition.emit import Emitter, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, axes_of, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

# --- mean ---------------------------------------------------------------------------------------


def _reduced_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _mean_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduced_axes(rule, assign))


@emitting
def _mean_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """A local sum of the (zero-masked) tile divided by the global count: a partial sum."""
    (x,) = e.operands(rule, assign)
    shape = tuple(fake_value(node.args[0]).shape)
    dtype = node.kwargs.get("dtype")
    if node.target == aten.mean.dim:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        dims = list(range(len(shape))) if not dims else [d % len(shape) for d in dims]
        if len(node.args) > 3:
            dtype = node.args[3]
        s = x.sum(dims, keepdim, dtype=dtype)
    else:
        dims = list(range(len(shape)))
        s = x.sum(dtype=dtype)
    return s / math.prod(shape[d] for d in dims)


register(Handler(HandlerName.MEAN.value, _mean_applies, _mean_lower))


# --- weighted_mean: nll_loss_forward --------------------------------------------------------------

_SUM, _MEAN = 2, 1


def _nll_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """Padded targets become ``ignore_index``; the op runs with ``reduction=sum``. For sum the
    results stay partial; for mean one all_reduce of ``(sum, total_weight)`` and a divide."""
    it = iter(e.operands(rule, assign))
    args = [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]
    reduction, ignore = int(args[3]), int(args[4])
    n = int(fake_value(node.args[1]).shape[0])
    args[1] = e.mask_padding(args[1], axes_of(rule, 1, 0, assign), n, 1, 0, ignore)
    args[3] = _SUM
    res = node.target(*args)
    if reduction == _SUM:
        return res
    dtype = node.meta["val"][0].dtype
    what = "loss sum and total weight"
    red = _reduced_axes(rule, assign)
    both = e.all_reduce(
        torch.stack([res[0], res[1]]), red, "sum", shape=(2,), dtype=dtype, what=what
    )
    total, weight = both.select(0, 0), both.select(0, 1)
    for f in rule.reduction_factors:  # the results are reduced already
        assign.pop(f, None)
    return e.tuple(total / weight, weight)


def _nll_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    if node.target == aten.nll_loss_backward.default:
        return fake_value(node.args[2]).ndim > 0 and bool(axes_of(rule, 2, 0, assign))
    return bool(_reduced_axes(rule, assign))


def _nll_backward_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``nll_loss_backward`` with the batch sharded: padded targets become ``ignore_index`` (the
    kernel indexes with them); the global ``total_weight`` makes the rest local."""
    it = iter(e.operands(rule, assign))
    args = [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]
    n = int(fake_value(node.args[2]).shape[0])
    args[2] = e.mask_padding(args[2], axes_of(rule, 2, 0, assign), n, 1, 0, int(args[5]))
    return node.target(*args)


#: The lowering of each op the weighted_mean rule names.
_NLL_LOWER = {
    aten.nll_loss_forward.default: _nll_lower,
    aten.nll_loss_backward.default: _nll_backward_lower,
}


@emitting
def _nll_dispatch(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    return _NLL_LOWER[node.target](e, node, rule, assign)


register(Handler(HandlerName.WEIGHTED_MEAN.value, _nll_applies, _nll_dispatch))
