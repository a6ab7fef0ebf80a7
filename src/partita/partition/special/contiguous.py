"""The ``contiguous`` handler: ops whose kernel needs a contiguous operand run on a copy.

``view_as_complex`` (and ``view(dtype)`` to a dtype of another size) reinterpret the bytes of
the last dim, so their kernels refuse an operand whose last dim does not have stride 1. Eager
autograd calls them on ``grad.contiguous()`` (the backward of ``view_as_real``); capture keeps
values, not layouts, and drops that ``clone``, and a per-device tile may be a broadcast (the
stride-0 ``expand`` of a ``sum``'s gradient) or a strided view. The lowering therefore
emits ``clone(contiguous_format)`` of each tensor operand, then the op: one local copy of the
tile, no communication.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.proxy import Proxy

from partita.partition.emit import Emitter, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName


def _always(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return True  # a replicated tile can be strided too (the stride-0 gradient of a sum)


@emitting
def _contiguous_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    tiles = iter(e.operands(rule, assign))

    def local(a: Any) -> Any:
        if isinstance(fake_value(a), torch.Tensor):
            return aten.clone.default(next(tiles), memory_format=torch.contiguous_format)
        return a

    return e.call(node.target, *[local(a) for a in node.args], **node.kwargs)


register(Handler(HandlerName.CONTIGUOUS.value, _always, _contiguous_lower))
