"""The ``sharded_scan`` handler: ``cummax`` / ``cummin`` along a sharded dim, as a local scan
plus the running extreme carried in from the tiles before.

Each device scans its tile, all-gathers the last (value, global index) of every tile along the
scanned dim (one all_gather of ``k`` entries per row), takes the extreme of the tiles before
its own (an exclusive prefix over the gathered tails) and combines it with its local scan the
way torch's kernel steps: a local element wins on ``>=`` (``<=`` for cummin), a NaN always
wins and then stays. Ceil padding is a suffix of the dim, so it only reaches padding. This
module emits the nodes; the rule (``rules/scan.py``) makes the dim pass-through on the
understanding that this handler exists.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from partita.explain import op_name
from partita.layout import ceil_div
from partita.partition.handlers import Handler, register
from partita.partition.masks import emit_tile_offset, identity_of
from partita.partition.special.common import (
    Assign,
    aten,
    fake_value,
    make_tuple,
    record_collective,
)
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


def _scan_dim(node: fx.Node) -> int:
    ndim = fake_value(node.args[0]).ndim
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    return int(dim) % max(ndim, 1)


def _scan_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    factors = rule.operands[0]
    if factors is None or not factors:
        return ()
    return tuple(a for f in factors[_scan_dim(node)] for a in assign.get(f, ()))


def _applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_scan_axes(node, rule, assign))


def _all_gather(
    low: Lowering,
    node: fx.Node,
    x: fx.Node,
    dim: int,
    axes: tuple[str, ...],
    dtype: torch.dtype,
    what: str,
) -> fx.Node:
    """``all_gather(x)`` along ``dim`` over ``axes``, recorded in the Plan."""
    k = low.mesh.axes_size(axes)
    out = low.call(torch.ops.partita.all_gather.default, x, dim, list(axes), k)
    shape = list(fake_value(node.args[0]).shape)
    shape[dim] = k
    why = f"{op_name(node.target)} (%{node.name}) scans a dim split over {', '.join(axes)}: {what}"
    record_collective(
        low, node, "all_gather", axes, tuple(shape), dtype, what, why, f"dim {dim}, {k}"
    )
    return out


def _scan_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """Local scan, then ``max(carry, local)`` with the carry of the tiles before this one."""
    (x,) = low.localize_operands(node, rule, assign)
    dim, axes = _scan_dim(node), _scan_axes(node, rule, assign)
    gx = fake_value(node.args[0])
    k = low.mesh.axes_size(axes)
    tile = ceil_div(int(gx.shape[dim]), k)
    is_max = node.target == aten.cummax.default
    wins = aten.ge.Tensor if is_max else aten.le.Tensor

    local = low.call(node.target, x, dim)
    values = low.call(operator.getitem, local, 0)
    offset = emit_tile_offset(low.graph, x, axes, tile)
    indices = low.call(aten.add.Tensor, low.call(operator.getitem, local, 1), offset)

    # Every tile's last (value, index), then the extreme of the tiles before each one.
    tail_v = low.call(aten.slice.Tensor, values, dim, tile - 1, tile)
    tail_i = low.call(aten.slice.Tensor, indices, dim, tile - 1, tile)
    tails_v = _all_gather(low, node, tail_v, dim, axes, gx.dtype, "values at every tile's end")
    tails_i = _all_gather(low, node, tail_i, dim, axes, torch.int64, "indices at every tile's end")
    run = low.call(node.target, tails_v, dim)
    run_v = low.call(operator.getitem, run, 0)
    run_i = low.call(aten.gather.default, tails_i, dim, low.call(operator.getitem, run, 1))
    me = low.call(
        aten.reshape.default, low.call(torch.ops.partita.axis_index.default, x, list(axes)), [1]
    )
    before = low.call(aten.clamp_min.default, low.call(aten.sub.Tensor, me, 1), 0)
    carry_v = low.call(aten.index_select.default, run_v, dim, before)
    carry_i = low.call(aten.index_select.default, run_i, dim, before)
    first = low.call(aten.eq.Scalar, me, 0)  # the first tile has nothing before it
    fill = identity_of("max" if is_max else "min", gx.dtype)
    later = low.call(aten.logical_not.default, first)
    carry_v = low.call(aten.where.ScalarOther, later, carry_v, fill)

    local_wins = low.call(wins, values, carry_v)
    if gx.dtype.is_floating_point:
        nan_here = low.call(aten.isnan.default, values)
        nan_before = low.call(aten.isnan.default, carry_v)
        local_wins = low.call(
            aten.logical_or.default,
            nan_here,
            low.call(
                aten.logical_and.default, low.call(aten.logical_not.default, nan_before), local_wins
            ),
        )
    out_v = low.call(aten.where.self, local_wins, values, carry_v)
    out_i = low.call(aten.where.self, local_wins, indices, carry_i)
    return low.call(make_tuple, out_v, out_i)


register(Handler(HandlerName.SHARDED_SCAN.value, _applies, _scan_lower))
