"""Rules of the control-flow ops captured with their bodies (``capture/control_flow.py``):
``torch.cond``, ``while_loop``, ``scan`` and ``map``.

Decision: a rule here only says how values flow *around* the body, so that the outer program's
propagation can see through the op; the bodies themselves are propagated as programs of their
own (``propagate/bodies.py``) and lowered once each (``partition/control_flow.py``).

- ``while_loop``: carried value ``i`` and result ``i`` share their factors (the loop carries
  the value's sharding through); the additional operands have their own.
- ``scan``: carry ``i`` and result ``i`` share their factors; the scanned dim 0 of every
  ``xs`` and stacked ``ys`` is one factor that cannot be split (each step reads one slice);
  their other dims are their own.
- ``map``: dim 0 of every ``xs`` and result is one factor that *can* be split: each device
  maps its own rows.
- ``cond``: the predicate is a 0-d tensor; operands and results have their own factors (the
  branches decide how they relate).
"""

from __future__ import annotations

from typing import Any

from torch._higher_order_ops.cond import cond_op
from torch._higher_order_ops.map import map_impl
from torch._higher_order_ops.scan import scan_op
from torch._higher_order_ops.while_loop import while_loop_op

from partita.rules.common import Names, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.ruleset import RuleSet

RULES = RuleSet("control_flow")

__all__ = ["cond_rule", "map_rule", "scan_rule", "while_loop_rule"]


def _own(operands: list[list[str]], results: list[list[str]]) -> set[str]:
    """The operands' factors no result has: declared need-replication, as an einsum rule must
    (the lowering keeps the operands' own shardings for the body: it reads no assignment)."""
    return {f for d in operands for f in d} - {f for d in results for f in d}


def _count(arg: Any) -> int:
    """How many tensors a tuple argument of the op holds."""
    return len(arg) if isinstance(arg, (tuple, list)) else 0


@RULES.register(while_loop_op)
def while_loop_rule(info: OpInfo) -> FactorRule:
    """``a, b -> a`` for ``while_loop(cond, body, (x,), (w,))``: the carry passes through."""
    n = _count(info.positional(2))
    names = Names()
    carried = [names.take(t.ndim) for t in info.operands[:n]]
    extra = [names.take(t.ndim) for t in info.operands[n:]]
    return build(info, [*carried, *extra], carried, need_replication=_own(extra, carried))


@RULES.register(scan_op)
def scan_rule(info: OpInfo) -> FactorRule:
    """``a, t b, c -> a, t d`` for ``scan(f, (h,), (xs,), (w,))``: the carry passes through,
    the scanned dim ``t`` is never split."""
    n_init, n_xs = _count(info.positional(1)), _count(info.positional(2))
    names = Names()
    t = names.new()
    init = [names.take(x.ndim) for x in info.operands[:n_init]]
    xs = [[t, *names.take(x.ndim - 1)] for x in info.operands[n_init : n_init + n_xs]]
    extra = [names.take(x.ndim) for x in info.operands[n_init + n_xs :]]
    ys = [[t, *names.take(r.ndim - 1)] for r in info.results[n_init:] if r is not None]
    ops, res = [*init, *xs, *extra], [*init, *ys]
    return build(info, ops, res, need_replication={t} | _own(ops, res))


@RULES.register(map_impl)
def map_rule(info: OpInfo) -> FactorRule:
    """``t a, b -> t c`` for ``map(f, xs, w)``: the mapped dim ``t`` may be split."""
    n_xs = _count(info.positional(1))
    names = Names()
    t = names.new()
    xs = [[t, *names.take(x.ndim - 1)] for x in info.operands[:n_xs]]
    extra = [names.take(x.ndim) for x in info.operands[n_xs:]]
    ys = [[t, *names.take(r.ndim - 1)] for r in info.results if r is not None]
    return build(info, [*xs, *extra], ys, need_replication=_own([*xs, *extra], ys))


@RULES.register(cond_op)
def cond_rule(info: OpInfo) -> FactorRule:
    """``, a -> b`` for ``cond(p, t, f, (x,))``: nothing passes through by rule."""
    names = Names()
    operands = [names.take(x.ndim) for x in info.operands]
    results = [names.take(r.ndim) for r in info.results if r is not None]
    return build(info, operands, results, need_replication=_own(operands, results))
