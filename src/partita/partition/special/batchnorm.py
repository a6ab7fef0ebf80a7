"""The ``batch_stats`` handler: batch norm in training mode (SyncBatchNorm) with reduced dims
sharded - one all_reduce of per-channel sums forward and one backward."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from partita.partition.emit import Emitter, Proxy, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import (
    Assign,
    acc_dtype,
    aten,
    axes_of,
    fake_value,
    operand_sharding,
)
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import local_shape

# --- batch_stats: batch norm in training mode (SyncBatchNorm) ------------------------------------


def _bn_reduced(
    node: fx.Node, rule: FactorRule, assign: Assign, x_index: int
) -> tuple[list[int], tuple[str, ...]]:
    """The reduced dims (all but channels) and the mesh axes they are sharded over."""
    ndim = fake_value(node.args[x_index]).ndim
    dims = [d for d in range(ndim) if d != 1]
    axes: list[str] = []
    for d in dims:
        axes += [a for a in axes_of(rule, x_index, d, assign) if a not in axes]
    return dims, tuple(axes)


def _bn_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    x_index = 1 if node.target == aten.native_batch_norm_backward.default else 0
    return bool(_bn_reduced(node, rule, assign, x_index)[1])


def _localized_args(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> list[Any]:
    it = iter(e.operands(rule, assign))
    return [next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args]


def _channel_sums(
    e: Emitter,
    rule: FactorRule,
    assign: Assign,
    x_index: int,
    terms: list[Proxy],
    acc: torch.dtype,
    what: str,
) -> list[Proxy]:
    """Per-channel sums of ``terms`` (local tiles like the input, padding masked to 0) over the
    reduced dims, all-reduced in one collective."""
    node = e.node
    gshape = tuple(fake_value(node.args[x_index]).shape)
    dims, axes = _bn_reduced(node, rule, assign, x_index)
    sums = []
    for t in terms:
        for d in dims:
            t = e.mask_padding(t, axes_of(rule, x_index, d, assign), gshape[d], len(gshape), d, 0)
        sums.append(t.sum(dims))
    c_local = local_shape(operand_sharding(e.low, rule, x_index, assign), gshape)[1]
    shape = (len(terms), c_local)
    every = e.all_reduce(torch.stack(sums), axes, "sum", shape=shape, dtype=acc, what=what)
    return [every.select(0, i) for i in range(len(terms))]


@emitting
def _bn_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``y = (x - mean) * rstd * w + b`` with the global per-channel ``mean`` and ``var``
    from one all_reduce of ``(sum x, sum x*x)``; the running stats take the unbiased var."""
    if node.target == aten.native_batch_norm_backward.default:
        return _bn_backward(e, node, rule, assign)
    args = _localized_args(e, node, rule, assign)
    x, w, b = args[0], args[1], args[2]
    no_stats = node.target == aten._native_batch_norm_legit.no_stats
    rm, rv = (None, None) if no_stats else (args[3], args[4])
    momentum, eps = (args[4], args[5]) if no_stats else (args[6], args[7])
    x_val = fake_value(node.args[0])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = acc_dtype(x_val.dtype)
    bshape = [1, -1] + [1] * (len(gshape) - 2)
    xa = e.cast(x, x_val.dtype, acc)
    # var = E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std (post-ReLU6
    # activations): the sums are float64, as eager's CPU kernel accumulates, so one all_reduce
    # still gives eager's statistics to float32 rounding.
    stat = torch.float64
    xs = e.cast(x, x_val.dtype, stat)
    s1, s2 = _channel_sums(
        e,
        rule,
        assign,
        0,
        [xs, xs * xs],
        stat,
        "per-channel sum and sum of squares (SyncBatchNorm)",
    )
    mean64 = s1 / count
    var64 = (s2 / count - mean64 * mean64).clamp_min(0.0)
    mean, var = e.cast(mean64, stat, acc), e.cast(var64, stat, acc)
    rstd = e.cast(torch.rsqrt(var64 + eps), stat, acc)
    out = (xa - mean.reshape(bshape)) * rstd.reshape(bshape)
    if w is not None:
        out = out * w.reshape(bshape)
    if b is not None:
        out = out + b.reshape(bshape)
    vals = node.meta["val"]
    results = [
        e.cast(v, acc, val.dtype) for v, val in zip((out, mean, rstd), vals[:3], strict=True)
    ]
    if node.target == aten._native_batch_norm_legit_functional.default:
        unbiased = var * (count / max(count - 1, 1))
        for running, stat in ((rm, mean), (rv, unbiased)):
            results.append(stat * momentum + running * (1 - momentum))
    return e.tuple(*results)


def _bn_backward(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``native_batch_norm_backward(dy, x, w, rm, rv, save_mean, save_invstd, train, eps,
    mask)`` in training: one all_reduce of ``(sum dy, sum dy * (x - mean))`` per channel."""
    args = _localized_args(e, node, rule, assign)
    dy, x, w, save_mean, invstd = args[0], args[1], args[2], args[5], args[6]
    out_mask = list(cast("Sequence[bool]", node.args[9]))
    x_val = fake_value(node.args[1])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = acc_dtype(x_val.dtype)
    bshape = [1, -1] + [1] * (len(gshape) - 2)
    dy = e.cast(dy, fake_value(node.args[0]).dtype, acc)
    centered = e.cast(x, x_val.dtype, acc) - save_mean.reshape(bshape)
    sum_dy, dot = _channel_sums(
        e,
        rule,
        assign,
        1,
        [dy, dy * centered],
        acc,
        "per-channel sums of dy and dy * (x - mean) (SyncBatchNorm backward)",
    )
    vals = node.meta["val"]
    results: list[Any] = [None, None, None]
    if out_mask[0]:  # dx = (dy - centered * dot/count * invstd^2 - sum_dy/count) * invstd * w
        grad_mean = sum_dy / count
        proj_scale = dot / count * (invstd * invstd)
        scale = invstd if w is None else invstd * w
        proj = centered * proj_scale.reshape(bshape)
        dx = (dy - proj - grad_mean.reshape(bshape)) * scale.reshape(bshape)
        results[0] = e.cast(dx, acc, vals[0].dtype)
    if out_mask[1]:  # dw = sum(dy * (x - mean)) * invstd
        results[1] = e.cast(dot * invstd, acc, vals[1].dtype)
    if out_mask[2]:  # db = sum(dy)
        results[2] = e.cast(sum_dy, acc, vals[2].dtype)
    return e.tuple(*results)


register(Handler(HandlerName.BATCH_STATS.value, _bn_applies, _bn_lower))
