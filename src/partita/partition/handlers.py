"""Special lowerings that rules name with ``FactorRule.handler``.

Most ops lower generically (``partition.lower``): reshard the operands, emit the op with local
shapes. A few need more — a bias that must be added once to a partial sum, a halo exchange for
a windowed dim, a masked lookup for a vocabulary-sharded embedding. Each such lowering is a
:class:`Handler` registered here under the name a rule uses. A handler decides with
``applies`` whether the op's factor assignment needs it (when no sharded factor needs it, the
generic lowering runs); ``lower`` emits the local nodes and returns the op's local result node
(a tuple-valued node for multi-output ops).

Handlers never decide shardings; they only emit what an assignment implies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from partita.rules import FactorRule

if TYPE_CHECKING:
    from partita.partition.lower import Lowering

__all__ = ["Handler", "get", "has", "register"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Handler:
    name: str
    applies: Callable[[Lowering, fx.Node, FactorRule, Assign], bool]
    lower: Callable[[Lowering, fx.Node, FactorRule, Assign], fx.Node]


_HANDLERS: dict[str, Handler] = {}


def register(handler: Handler) -> Handler:
    if handler.name in _HANDLERS:
        raise RuntimeError(f"partition handler {handler.name!r} registered twice")
    _HANDLERS[handler.name] = handler
    return handler


def get(name: str | None) -> Handler | None:
    return _HANDLERS.get(name) if name else None


def has(name: str | None) -> bool:
    return get(name) is not None


# --- add_bias_once: addmm(bias, a, b) with a sharded contraction ------------------------------


def _reduction_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _bias_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduction_axes(rule, assign))


def _bias_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """The result is a partial sum over the contraction's axes: add the bias on the group's
    first device only (``where(axis_index == 0, bias, 0)``) so the sum counts it once."""
    bias, mat1, mat2 = low.localize_operands(node, rule, assign)
    axes = list(_reduction_axes(rule, assign))
    idx = low.call(torch.ops.partita.axis_index.default, bias, axes)
    first = low.call(aten.eq.Scalar, idx, 0)
    bias = low.call(aten.where.ScalarOther, first, bias, 0.0)
    rest: dict[str, Any] = dict(node.kwargs)
    return low.call(node.target, bias, mat1, mat2, *node.args[3:], **rest)


register(Handler("add_bias_once", _bias_applies, _bias_lower))
