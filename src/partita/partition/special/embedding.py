"""The ``masked_embedding`` handler: embedding and embedding_dense_backward with the
vocabulary sharded - local lookups of this shard's rows, the rest zeroed (a partial sum)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partita.ir import node_meta
from partita.partition.emit import Emitter, Proxy, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import ceil_div

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
        return tuple(node_meta.factor_axes(node).get(v, ()))
    return assign.get(v, ())


def _embedding_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_vocab_axes(node, rule, assign))


def _own_rows(e: Emitter, ids: Proxy, axes: tuple[str, ...], rows: int) -> tuple[Proxy, Proxy, int]:
    """(ids shifted into this shard, where the shifted id is one of this shard's rows, tile)."""
    tile = ceil_div(rows, e.mesh.axes_size(axes))
    local = ids - e.tile_offset(ids, axes, tile)
    return local, torch.logical_and(local >= 0, local < tile), tile


@emitting
def _embedding_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    axes = _vocab_axes(node, rule, assign)
    if node.target == aten.embedding_dense_backward.default:
        assign[_vocab_factor(node, rule)] = axes  # this lowering makes the V tiles itself
        grad, ids = e.operands(rule, assign)
        args: tuple[Any, ...] = node.args  # (grad, ids, num_weights, padding_idx, ...)
        num_weights = int(args[2])
        padding_idx = int(args[3]) if len(args) > 3 else -1
        local, inside, tile = _own_rows(e, ids, axes, num_weights)
        if padding_idx >= 0:
            inside = torch.logical_and(inside, ids != padding_idx)
        safe = torch.where(inside, local, 0)
        grad = torch.where(inside.unsqueeze(-1), grad, 0.0)
        return aten.embedding_dense_backward.default(grad, safe, tile, -1, False)
    table, ids = e.operands(rule, assign)
    rows = int(fake_value(node.args[0]).shape[0])
    local, inside, _ = _own_rows(e, ids, axes, rows)
    out = aten.embedding.default(table, torch.where(inside, local, 0))
    return torch.where(inside.unsqueeze(-1), out, 0.0)  # partial sum over the vocab axes


register(Handler(HandlerName.MASKED_EMBEDDING.value, _embedding_applies, _embedding_lower))
