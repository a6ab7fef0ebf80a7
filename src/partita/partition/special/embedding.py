"""The ``masked_embedding`` handler: embedding and embedding_dense_backward with the
vocabulary sharded - local lookups of this shard's rows, the rest zeroed (a partial sum)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from partita.layout import ceil_div
from partita.partition.handlers import Handler, register
from partita.partition.masks import emit_tile_offset
from partita.partition.special.common import Assign, aten, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


# --- masked_embedding ---------------------------------------------------------------------------


def _vocab_factor(node: fx.Node, rule: FactorRule) -> str:
    if node.target == aten.embedding_dense_backward.default:
        res = rule.results[0]
        assert res is not None
        return res[0][0]
    table = rule.operands[0]
    assert table is not None
    return table[0][0]


def _vocab_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    v = _vocab_factor(node, rule)
    if node.target == aten.embedding_dense_backward.default:
        # v is result-only: the generic lowering computes it whole, so ``assign`` lacks it;
        # propagation's choice is in the node's meta.
        if bool(node.args[4] if len(node.args) > 4 else False):
            return ()  # scale_grad_by_freq counts ids globally: compute whole (generic)
        return tuple(node.meta.get("factor_axes", {}).get(v, ()))
    return assign.get(v, ())


def _embedding_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_vocab_axes(node, rule, assign))


def _own_rows(
    low: Lowering, ids: fx.Node, axes: tuple[str, ...], rows: int
) -> tuple[fx.Node, fx.Node, int]:
    """(ids shifted into this shard, where the shifted id is one of this shard's rows, tile)."""
    tile = ceil_div(rows, low.mesh.axes_size(axes))
    offset = emit_tile_offset(low.graph, ids, axes, tile)
    local = low.call(aten.sub.Tensor, ids, offset)
    inside = low.call(
        aten.logical_and.default,
        low.call(aten.ge.Scalar, local, 0),
        low.call(aten.lt.Scalar, local, tile),
    )
    return local, inside, tile


def _embedding_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    axes = _vocab_axes(node, rule, assign)
    if node.target == aten.embedding_dense_backward.default:
        assign[_vocab_factor(node, rule)] = axes  # this lowering makes the V tiles itself
        grad, ids = low.localize_operands(node, rule, assign)
        num_weights = int(node.args[2])
        padding_idx = int(node.args[3]) if len(node.args) > 3 else -1
        local, inside, tile = _own_rows(low, ids, axes, num_weights)
        if padding_idx >= 0:
            inside = low.call(
                aten.logical_and.default, inside, low.call(aten.ne.Scalar, ids, padding_idx)
            )
        safe = low.call(aten.where.ScalarOther, inside, local, 0)
        keep = low.call(aten.unsqueeze.default, inside, -1)
        grad = low.call(aten.where.ScalarOther, keep, grad, 0.0)
        return low.call(aten.embedding_dense_backward.default, grad, safe, tile, -1, False)
    table, ids = low.localize_operands(node, rule, assign)
    rows = int(fake_value(node.args[0]).shape[0])
    local, inside, _ = _own_rows(low, ids, axes, rows)
    safe = low.call(aten.where.ScalarOther, inside, local, 0)
    out = low.call(aten.embedding.default, table, safe)
    keep = low.call(aten.unsqueeze.default, inside, -1)
    return low.call(aten.where.ScalarOther, keep, out, 0.0)  # partial sum over the vocab axes


register(Handler(HandlerName.MASKED_EMBEDDING.value, _embedding_applies, _embedding_lower))
