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

from typing import Any, cast

import torch
import torch.fx as fx

from partita.partition.emit import Emitter, Proxy, emitting, op_of
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.masks import identity_of
from partita.partition.special.common import Assign, aten, fake_value
from partita.report.explain import op_name
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import ceil_div


def _scan_dim(node: fx.Node) -> int:
    args: tuple[Any, ...] = node.args  # cummax(self, dim)
    ndim = fake_value(args[0]).ndim
    dim = args[1] if len(args) > 1 else node.kwargs["dim"]
    return int(cast(int, dim)) % max(ndim, 1)


def _scan_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    factors = rule.operands[0]
    if factors is None or not factors:
        return ()
    return tuple(a for f in factors[_scan_dim(node)] for a in assign.get(f, ()))


def _applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_scan_axes(node, rule, assign))


@emitting
def _scan_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """Local scan, then ``max(carry, local)`` with the carry of the tiles before this one."""
    (x,) = e.operands(rule, assign)
    dim, axes = _scan_dim(node), _scan_axes(node, rule, assign)
    gx = fake_value(node.args[0])
    k = e.mesh.axes_size(axes)
    tile = ceil_div(int(gx.shape[dim]), k)
    is_max = node.target == aten.cummax.default

    local = op_of(node)(x, dim)
    values = local[0]
    indices = local[1] + e.tile_offset(x, axes, tile)

    # Every tile's last (value, index), then the extreme of the tiles before each one.
    tails_shape = tuple(k if d == dim else s for d, s in enumerate(gx.shape))
    why = f"{op_name(node.target)} (%{node.name}) scans a dim split over {', '.join(axes)}"

    def tails(v: Proxy, dtype: torch.dtype, what: str) -> Proxy:
        last = v.slice(dim, tile - 1, tile)
        return e.all_gather(
            last, dim, axes, shape=tails_shape, dtype=dtype, what=what, why=f"{why}: {what}"
        )

    tails_v = tails(values, gx.dtype, "values at every tile's end")
    tails_i = tails(indices, torch.int64, "indices at every tile's end")
    run = op_of(node)(tails_v, dim)
    run_v, run_i = run[0], tails_i.gather(dim, run[1])
    me = e.axis_index(x, axes).reshape([1])
    before = (me - 1).clamp_min(0)
    carry_v = run_v.index_select(dim, before)
    carry_i = run_i.index_select(dim, before)
    first = me == 0  # the first tile has nothing before it
    fill = identity_of("max" if is_max else "min", gx.dtype)
    carry_v = torch.where(torch.logical_not(first), carry_v, fill)

    local_wins = values >= carry_v if is_max else values <= carry_v
    if gx.dtype.is_floating_point:  # a NaN wins, and then stays
        nan_here = torch.isnan(values)
        nan_before = torch.isnan(carry_v)
        local_wins = torch.logical_or(
            nan_here, torch.logical_and(torch.logical_not(nan_before), local_wins)
        )
    out_v = torch.where(local_wins, values, carry_v)
    out_i = torch.where(local_wins, indices, carry_i)
    return e.tuple(out_v, out_i)


register(Handler(HandlerName.SHARDED_SCAN.value, _applies, _scan_lower))
