"""The ``index_padding`` handler: index tensors sharded on a pass-through dim get a valid index
in their padding before the local op reads them.

``x[i]`` and ``x.scatter(d, i, s)`` with ``i`` sharded run locally on ``i``'s tile, whose
padding holds garbage after an elementwise op (``i + 7``), or whatever an input's storage
held: an out-of-range index there would make the kernel fail. Padding positions of an integer
operand become 0, a valid index into the dims these ops keep whole; the result positions they
produce are padding too (a gather drops them; a scatter writes into the operand's padding).
This module emits the masks and the local op; it decides no sharding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.proxy import Proxy
from torch.utils import _pytree as pytree

from partita.partition.emit import Emitter, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName

_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _sharded_index_dims(
    low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign
) -> list[tuple[int, int, tuple[str, ...]]]:
    """``(operand, dim, mesh axes)`` of every sharded dim of an integer operand."""
    out = []
    for i, (operand, factors) in enumerate(
        zip(low.operand_nodes(node), rule.operands, strict=True)
    ):
        if factors is None or fake_value(operand).dtype not in _INDEX_DTYPES:
            continue
        for d, dim in enumerate(low.dims_of(factors, assign)):
            if dim:
                out.append((i, d, dim))
    return out


def _applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_sharded_index_dims(low, node, rule, assign))


@emitting
def _lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """The generic lowering with the index operands' padding set to 0 first."""
    locals_ = e.operands(rule, assign)
    operands = e.low.operand_nodes(node)
    for i, d, axes in _sharded_index_dims(e.low, node, rule, assign):
        shape = fake_value(operands[i]).shape
        locals_[i] = e.mask_padding(locals_[i], axes, int(shape[d]), len(shape), d, 0)
    it = iter(locals_)

    def swap(a: Any) -> Any:
        return next(it) if isinstance(a, fx.Node) and a in operands else a

    args, kwargs = pytree.tree_map(swap, (tuple(node.args), dict(node.kwargs)))
    return node.target(*args, **kwargs)


register(Handler(HandlerName.INDEX_PADDING.value, _applies, _lower))
