"""Special lowerings that rules name with ``FactorRule.handler``.

Most ops lower generically (``partition.lower``): reshard the operands, emit the op with local
shapes. A few need more — a bias that must be added once to a partial sum, a halo exchange for
a windowed dim, a masked lookup for a vocabulary-sharded embedding. Each such lowering is a
:class:`Handler` registered here under the name a rule uses. A handler decides with
``applies`` whether the op's factor assignment needs it (when no sharded factor needs it, the
generic lowering runs); ``lower`` emits the local nodes and returns the op's local result node
(a tuple-valued node for multi-output ops). Lowerings are written as torch code on proxies of
the per-device values (``partition.emit``, as the two below are).

Names come from one enumeration, :class:`~partita.rules.handler_names.HandlerName`: a handler
registered under any other name fails at import, and ``partita.partition`` checks at import
(:func:`check_registry`) that every name has a lowering here or is in :data:`GENERIC`.

Handlers never decide shardings; they only emit what an assignment implies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx

from partita.errors import CompilerError
from partita.partition.emit import Emitter, Proxy, emitting
from partita.partition.lowering_api import LoweringAPI
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import ceil_div

__all__ = ["GENERIC", "WHOLE_OP", "Handler", "check_registry", "get", "has", "register"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Handler:
    name: str
    applies: Callable[[LoweringAPI, fx.Node, FactorRule, Assign], bool]
    lower: Callable[[LoweringAPI, fx.Node, FactorRule, Assign], fx.Node]


_HANDLERS: dict[str, Handler] = {}

#: Handler names the generic lowering covers by itself (it localises shape arguments; only
#: arange also has a registered lowering, for its per-device offsets).
GENERIC: tuple[str, ...] = (HandlerName.LOCALIZE_SHAPE.value,)
#: Handlers without which the op must run on whole (replicated) tensors: a random draw on
#: local shapes would differ from the unsharded program's (docs/rules.md, random numbers), and
#: the rules of softmax and training batch norm make their reduced dims pass-through only on the
#: understanding that their handler reduces across devices, and so does the rule of cummax /
#: cummin for its scanned dim, and nll_loss_backward's for its class dim (its handler shifts
#: the targets into each device's tile) (mandatory handlers).
WHOLE_OP: tuple[str, ...] = tuple(
    h.value
    for h in (
        HandlerName.BATCH_STATS,
        HandlerName.GLOBAL_RANDOM,
        HandlerName.SHARDED_SCAN,
        HandlerName.SOFTMAX_REDUCE,
        HandlerName.WEIGHTED_MEAN,
    )
)


def makes_local_results(target: Any, rule: FactorRule) -> bool:
    """Whether the op can produce a tile of a result dim that no operand has: every tile of its
    result is the same function of the local shape (constants, broadcasts), made by localising
    shape arguments (``OpFacts.local_results``; arange through its handler)."""
    return rule.handler == HandlerName.LOCALIZE_SHAPE.value and rule.facts.local_results


def register(handler: Handler) -> Handler:
    """Register ``handler`` under its name, which must be a :class:`HandlerName` value."""
    valid = [h.value for h in HandlerName]
    if handler.name not in valid:
        raise CompilerError(
            f"A partition handler is registered as {handler.name!r}, a name no rule can use "
            f"(the names are {valid}). Its lowering would never run, so this is refused. Use "
            f"one of those names, or add the new one to HandlerName "
            f"(partita/rules/handler_names.py) first."
        )
    if handler.name in _HANDLERS:
        raise CompilerError(
            f"The partition handler {handler.name!r} is registered twice (lowerings "
            f"{_HANDLERS[handler.name].lower.__module__} and {handler.lower.__module__}): the "
            f"second would silently replace the first. Keep one registration per name."
        )
    _HANDLERS[handler.name] = handler
    return handler


def check_registry() -> None:
    """Fail if some :class:`HandlerName` has no lowering (and is not in :data:`GENERIC`):
    without one, every op whose rule names it would quietly run on gathered tensors."""
    missing = [h.value for h in HandlerName if h.value not in _HANDLERS and h.value not in GENERIC]
    if missing:
        raise CompilerError(
            f"The partition handlers {missing} are named by HandlerName but have no registered "
            f"lowering (registered: {sorted(_HANDLERS)}; generic: {list(GENERIC)}). Ops whose "
            f"rules name them could only run on gathered tensors. Register a Handler under each "
            f"name (partition/special/ or partition/halo/, imported by partita.partition) or, if "
            f"the generic lowering covers it, add it to handlers.GENERIC."
        )


def get(name: str | None) -> Handler | None:
    return _HANDLERS.get(name) if name else None


def has(name: str | None) -> bool:
    return get(name) is not None


# --- add_bias_once: addmm(bias, a, b) with a sharded contraction ------------------------------


def _reduction_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _bias_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduction_axes(rule, assign))


@emitting
def _bias_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """The result is a partial sum over the contraction's axes: add the bias on the group's
    first device only (``where(axis_index == 0, bias, 0)``) so the sum counts it once."""
    bias, mat1, mat2 = e.operands(rule, assign)
    bias = torch.where(e.axis_index(bias, _reduction_axes(rule, assign)) == 0, bias, 0.0)
    op = cast(Callable[..., Any], node.target)  # addmm / addmv / baddbmm / addbmm
    return op(bias, mat1, mat2, *node.args[3:], **node.kwargs)


register(Handler(HandlerName.ADD_BIAS_ONCE.value, _bias_applies, _bias_lower))


# --- localize_shape for arange: each device's tile starts at its own offset -------------------


def _arange_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return rule.facts.values_from_index and any(assign.values())


@emitting
def _arange_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``arange(start, end, step)`` sharded over its only dim: a local ``arange(tile)`` scaled
    by ``step`` and shifted by ``start + tile_offset * step`` (the padding tail holds values past
    ``end``, which is garbage like any padding)."""
    val = node.meta["val"]
    (sharding,) = e.low.result_shardings(rule, assign)
    assert sharding is not None
    axes = sharding.dim_axes[0]
    tile = ceil_div(int(val.shape[0]), e.mesh.axes_size(axes))
    args: list[Any] = list(node.args)  # the schema's (start, end, step)
    if node.target == aten.arange.default:
        start, step = 0, 1
    elif node.target == aten.arange.start:
        start, step = args[0], 1
    else:
        step_kw = cast(int, node.kwargs.get("step", 1))
        start, step = args[0], args[2] if len(args) > 2 else step_kw
    base = e.arange(tile, dtype=val.dtype)
    offset = e.axis_index(base, axes) * (tile * step) + start
    scaled = base * step if step != 1 else base
    return aten._to_copy.default(scaled + offset, dtype=val.dtype)


register(Handler(HandlerName.LOCALIZE_SHAPE.value, _arange_applies, _arange_lower))
