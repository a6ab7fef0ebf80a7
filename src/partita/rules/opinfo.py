"""How an fx node of a captured program is presented to a sharding rule.

``op_info(node)`` turns a call_function node into an :class:`~partita.rules.factor.OpInfo`:
its arguments with every tensor replaced by a ``TensorMeta`` (shape, dtype), its tensor
operands in pytree-flattened order (the order of ``FactorRule.operands``) and its results.
``replicate_rule`` is the opt-in rule for an op without one. This module reads graphs; it does
not propagate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partita.ir import node_meta
from partita.rules.factor import FactorRule, OpInfo, TensorMeta

__all__ = ["is_tensor", "op_info", "replicate_rule", "source_of"]


def source_of(node: fx.Node) -> str | None:
    """The user's source line recorded by capture, if any."""
    src = node_meta.source(node)
    return src if isinstance(src, str) else None


def is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _meta(v: Any) -> TensorMeta:
    return TensorMeta(tuple(v.shape), v.dtype)


def op_info(
    node: fx.Node, cache: dict[fx.Node, TensorMeta] | None = None
) -> tuple[OpInfo, list[fx.Node], list[int | None]]:
    """The OpInfo of a call_function node, its tensor operand nodes (flattened order) and the
    output index of each flattened result (``None`` for a single tensor output). ``cache``
    keeps one TensorMeta per operand node across calls."""
    operand_nodes: list[fx.Node] = []
    metas: list[TensorMeta] = []

    def to_meta(a: Any) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if not is_tensor(val):
                return val
            meta = cache.get(a) if cache is not None else None
            if meta is None:
                meta = _meta(val)
                if cache is not None:
                    cache[a] = meta
            operand_nodes.append(a)
            metas.append(meta)
            return meta
        if isinstance(a, (list, tuple)):
            return type(a)(to_meta(x) for x in a)
        if isinstance(a, dict):
            return {k: to_meta(v) for k, v in a.items()}
        return a

    args = tuple(to_meta(a) for a in node.args)
    kwargs = {k: to_meta(v) for k, v in node.kwargs.items()}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        results = tuple(_meta(v) if is_tensor(v) else None for v in val)
        indices: list[int | None] = list(range(len(val)))
    else:
        results = (_meta(val) if is_tensor(val) else None,)
        indices = [None]
    info = OpInfo(node.target, args, kwargs, tuple(metas), results)
    return info, operand_nodes, indices


def replicate_rule(info: OpInfo) -> FactorRule:
    """The opt-in rule for an op without one: every operand gathered, results replicated."""
    return FactorRule(
        operands=tuple(None for _ in info.operands),
        results=tuple(None if r is None else tuple(() for _ in r.shape) for r in info.results),
        sizes={},
    )
