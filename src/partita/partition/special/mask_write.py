"""The ``mask_write`` handler: ``x[mask] = v`` (``index_put`` with one boolean index) as a
``where``.

When the values do not depend on how many positions the mask selects (a scalar, or a tensor
that broadcasts against the dims after the mask; the rule checks it), writing through a
boolean mask is elementwise: ``where(mask, v, x)``, or ``where(mask, x + v, x)`` when
accumulating. Each device computes that on its own tiles. The op itself cannot run per device:
its kernel finds the selected positions with ``nonzero``, a data-dependent shape that the
simulated mesh's ``vmap`` refuses, so the lowering always emits the ``where``, replicated
operands included. No collective.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.proxy import Proxy

from partita.partition.emit import Emitter, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName


def _always(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return True  # vmap cannot run a boolean-mask index_put even on whole tensors


@emitting
def _lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    x, mask, values = e.operands(rule, assign)
    entries = list(node.args[1])
    j = next(d for d, i in enumerate(entries) if i is not None)
    xv, mv, vv = (fake_value(a) for a in (node.args[0], entries[j], node.args[2]))
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    for _ in range(j):  # the dims before the mask's
        mask = aten.unsqueeze.default(mask, 0)
    for _ in range(xv.ndim - j - mv.ndim):  # and after
        mask = aten.unsqueeze.default(mask, -1)
    lead = vv.ndim - (xv.ndim - j - mv.ndim)  # size-1 dims of v before the broadcast ones
    if lead > 0:
        values = aten.squeeze.dims(values, list(range(lead)))
    if vv.dtype != xv.dtype:
        values = aten._to_copy.default(values, dtype=xv.dtype)
    if accumulate:
        return aten.where.self(mask, aten.add.Tensor(x, values), x)
    return aten.where.self(mask, values, x)


register(Handler(HandlerName.MASK_WRITE.value, _always, _lower))
