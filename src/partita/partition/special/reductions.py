"""The reduction handlers ``mean`` (a masked local sum over the global count, a partial sum)
and ``weighted_mean`` (nll_loss forward/backward with the batch sharded)."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from partita.partition.handlers import Handler, register
from partita.partition.special.common import (
    Assign,
    aten,
    axes_of,
    fake_value,
    make_tuple,
    mask_padding,
    recorded_all_reduce,
)
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


# --- mean ---------------------------------------------------------------------------------------


def _reduced_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _mean_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduced_axes(rule, assign))


def _mean_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """A local sum of the (zero-masked) tile divided by the global count: a partial sum."""
    (x,) = low.localize_operands(node, rule, assign)
    shape = tuple(fake_value(node.args[0]).shape)
    dtype = node.kwargs.get("dtype")
    if node.target == aten.mean.dim:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        dims = list(range(len(shape))) if not dims else [d % len(shape) for d in dims]
        if len(node.args) > 3:
            dtype = node.args[3]
        s = low.call(aten.sum.dim_IntList, x, dims, keepdim, dtype=dtype)
    else:
        dims = list(range(len(shape)))
        s = low.call(aten.sum.default, x, dtype=dtype)
    count = math.prod(shape[d] for d in dims)
    return low.call(aten.div.Scalar, s, count)


register(Handler(HandlerName.MEAN.value, _mean_applies, _mean_lower))


# --- weighted_mean: nll_loss_forward --------------------------------------------------------------

_SUM, _MEAN = 2, 1


def _nll_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """Padded targets become ``ignore_index``; the op runs with ``reduction=sum``. For sum the
    results stay partial; for mean one all_reduce of ``(sum, total_weight)`` and a divide."""
    it = iter(low.localize_operands(node, rule, assign))
    args = [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]
    reduction, ignore = int(args[3]), int(args[4])
    n = int(fake_value(node.args[1]).shape[0])
    axes = axes_of(rule, 1, 0, assign)
    args[1] = mask_padding(low, args[1], axes, n, 1, 0, ignore)
    args[3] = _SUM
    res = low.call(node.target, *args)
    total, weight = (low.call(operator.getitem, res, i) for i in (0, 1))
    if reduction == _SUM:
        return res
    dtype = node.meta["val"][0].dtype
    both = low.call(aten.stack.default, [total, weight])
    red = _reduced_axes(rule, assign)
    both = recorded_all_reduce(
        low, node, both, "sum", red, (2,), dtype, "loss sum and total weight"
    )
    total, weight = (low.call(aten.select.int, both, 0, i) for i in (0, 1))
    for f in rule.reduction_factors:  # the results are reduced already
        assign.pop(f, None)
    return low.call(make_tuple, low.call(aten.div.Tensor, total, weight), weight)


def _nll_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    if node.target == aten.nll_loss_backward.default:
        return fake_value(node.args[2]).ndim > 0 and bool(axes_of(rule, 2, 0, assign))
    return bool(_reduced_axes(rule, assign))


def _nll_backward_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """``nll_loss_backward`` with the batch sharded: padded targets become ``ignore_index`` (the
    kernel indexes with them); the global ``total_weight`` makes the rest local."""
    it = iter(low.localize_operands(node, rule, assign))
    args = [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]
    n = int(fake_value(node.args[2]).shape[0])
    args[2] = mask_padding(low, args[2], axes_of(rule, 2, 0, assign), n, 1, 0, int(args[5]))
    return low.call(node.target, *args)


def _nll_dispatch(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    if node.target == aten.nll_loss_backward.default:
        return _nll_backward_lower(low, node, rule, assign)
    return _nll_lower(low, node, rule, assign)


register(Handler(HandlerName.WEIGHTED_MEAN.value, _nll_applies, _nll_dispatch))
