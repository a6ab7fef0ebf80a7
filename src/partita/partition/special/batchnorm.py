"""The ``batch_stats`` handler: batch norm in training mode (SyncBatchNorm) with reduced dims
sharded - one all_reduce of per-channel sums forward and one backward."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from partita.layout import local_shape
from partita.partition.handlers import Handler, register
from partita.partition.special.common import (
    Assign,
    acc_dtype,
    aten,
    axes_of,
    cast_to,
    fake_value,
    make_tuple,
    mask_padding,
    operand_sharding,
    recorded_all_reduce,
)
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


# --- batch_stats: batch norm in training mode (SyncBatchNorm) ------------------------------------


def _bn_reduced(
    low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign, x_index: int
) -> tuple[list[int], tuple[str, ...]]:
    """The reduced dims (all but channels) and the mesh axes they are sharded over."""
    ndim = fake_value(node.args[x_index]).ndim
    dims = [d for d in range(ndim) if d != 1]
    axes: list[str] = []
    for d in dims:
        axes += [a for a in axes_of(rule, x_index, d, assign) if a not in axes]
    return dims, tuple(axes)


def _bn_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    x_index = 1 if node.target == aten.native_batch_norm_backward.default else 0
    return bool(_bn_reduced(low, node, rule, assign, x_index)[1])


def _localized_args(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> list[Any]:
    it = iter(low.localize_operands(node, rule, assign))
    return [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]


def _channel_sums(
    low: Lowering,
    node: fx.Node,
    rule: FactorRule,
    assign: Assign,
    x_index: int,
    terms: list[fx.Node],
    acc: torch.dtype,
    what: str,
) -> list[fx.Node]:
    """Per-channel sums of ``terms`` (local tiles like the input, padding masked to 0) over the
    reduced dims, all-reduced in one collective."""
    gshape = tuple(fake_value(node.args[x_index]).shape)
    dims, axes = _bn_reduced(low, node, rule, assign, x_index)
    sums = []
    for t in terms:
        for d in dims:
            t = mask_padding(
                low, t, axes_of(rule, x_index, d, assign), gshape[d], len(gshape), d, 0
            )
        sums.append(low.call(aten.sum.dim_IntList, t, dims))
    stacked = low.call(aten.stack.default, sums)
    c_local = local_shape(operand_sharding(low, rule, x_index, assign), gshape)[1]
    out = recorded_all_reduce(low, node, stacked, "sum", axes, (len(terms), c_local), acc, what)
    return [low.call(aten.select.int, out, 0, i) for i in range(len(terms))]


def _bn_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    if node.target == aten.native_batch_norm_backward.default:
        return _bn_backward(low, node, rule, assign)
    args = _localized_args(low, node, rule, assign)
    x, w, b = args[0], args[1], args[2]
    no_stats = node.target == aten._native_batch_norm_legit.no_stats
    rm, rv = (None, None) if no_stats else (args[3], args[4])
    momentum, eps = (args[4], args[5]) if no_stats else (args[6], args[7])
    x_val = fake_value(node.args[0])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = acc_dtype(x_val.dtype)
    xa = cast_to(low, x, x_val.dtype, acc)
    s1, s2 = _channel_sums(
        low,
        node,
        rule,
        assign,
        0,
        [xa, low.call(aten.mul.Tensor, xa, xa)],
        acc,
        "per-channel sum and sum of squares (SyncBatchNorm)",
    )
    mean = low.call(aten.div.Scalar, s1, count)
    var = low.call(
        aten.sub.Tensor, low.call(aten.div.Scalar, s2, count), low.call(aten.mul.Tensor, mean, mean)
    )
    var = low.call(aten.clamp_min.default, var, 0.0)
    rstd = low.call(aten.rsqrt.default, low.call(aten.add.Scalar, var, eps))
    bshape = [1, -1] + [1] * (len(gshape) - 2)

    def per_channel(v: fx.Node) -> fx.Node:
        return low.call(aten.reshape.default, v, bshape)

    out = low.call(
        aten.mul.Tensor, low.call(aten.sub.Tensor, xa, per_channel(mean)), per_channel(rstd)
    )
    if w is not None:
        out = low.call(aten.mul.Tensor, out, per_channel(w))
    if b is not None:
        out = low.call(aten.add.Tensor, out, per_channel(b))
    vals = node.meta["val"]
    results: list[Any] = [
        cast_to(low, out, acc, vals[0].dtype),
        cast_to(low, mean, acc, vals[1].dtype),
        cast_to(low, rstd, acc, vals[2].dtype),
    ]
    if node.target == aten._native_batch_norm_legit_functional.default:
        unbiased = low.call(aten.mul.Tensor, var, count / max(count - 1, 1))
        for running, stat in ((rm, mean), (rv, unbiased)):
            results.append(
                low.call(
                    aten.add.Tensor,
                    low.call(aten.mul.Tensor, stat, momentum),
                    low.call(aten.mul.Tensor, running, 1 - momentum),
                )
            )
    return low.call(make_tuple, *results)


def _bn_backward(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """``native_batch_norm_backward(dy, x, w, rm, rv, save_mean, save_invstd, train, eps,
    mask)`` in training: one all_reduce of ``(sum dy, sum dy * (x - mean))`` per channel."""
    args = _localized_args(low, node, rule, assign)
    dy, x, w, save_mean, invstd = args[0], args[1], args[2], args[5], args[6]
    out_mask = list(node.args[9])
    x_val = fake_value(node.args[1])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = acc_dtype(x_val.dtype)
    bshape = [1, -1] + [1] * (len(gshape) - 2)

    def per_channel(v: fx.Node) -> fx.Node:
        return low.call(aten.reshape.default, v, bshape)

    dy_a = cast_to(low, dy, fake_value(node.args[0]).dtype, acc)
    centered = low.call(aten.sub.Tensor, cast_to(low, x, x_val.dtype, acc), per_channel(save_mean))
    sum_dy, dot = _channel_sums(
        low,
        node,
        rule,
        assign,
        1,
        [dy_a, low.call(aten.mul.Tensor, dy_a, centered)],
        acc,
        "per-channel sums of dy and dy * (x - mean) (SyncBatchNorm backward)",
    )
    vals = node.meta["val"]
    results: list[Any] = [None, None, None]
    if out_mask[0]:
        grad_mean = low.call(aten.div.Scalar, sum_dy, count)
        proj_scale = low.call(
            aten.mul.Tensor,
            low.call(aten.div.Scalar, dot, count),
            low.call(aten.mul.Tensor, invstd, invstd),
        )
        scale = invstd if w is None else low.call(aten.mul.Tensor, invstd, w)
        proj = low.call(aten.mul.Tensor, centered, per_channel(proj_scale))
        gi = low.call(
            aten.sub.Tensor, low.call(aten.sub.Tensor, dy_a, proj), per_channel(grad_mean)
        )
        gi = low.call(aten.mul.Tensor, gi, per_channel(scale))
        results[0] = cast_to(low, gi, acc, vals[0].dtype)
    if out_mask[1]:
        results[1] = cast_to(low, low.call(aten.mul.Tensor, dot, invstd), acc, vals[1].dtype)
    if out_mask[2]:
        results[2] = cast_to(low, sum_dy, acc, vals[2].dtype)
    return low.call(make_tuple, *results)


register(Handler(HandlerName.BATCH_STATS.value, _bn_applies, _bn_lower))
