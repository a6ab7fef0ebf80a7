"""Lower a linear op on partial sums without reducing them (``propagate.pending``).

When propagation left an op's result partial because ``propagate.linear`` keeps its operands' sum
pending, and the lowered operands are what it decided (partial over those axes, no split dim),
the op runs on the local addends with its global arguments and its result is partial: the
reduction happens once, when a user needs the value whole or split (``LocalValues.reshard``).
Otherwise the op is lowered as usual and its partial operands are reduced first.
"""

from __future__ import annotations

import torch.fx as fx

from partita.ir import node_meta
from partita.partition.resharding import LocalValue, LocalValues
from partita.propagate.linear import kept_partial
from partita.report.explain import op_name
from partita.rules.factor import FactorRule
from partita.values.spec import Sharding

__all__ = ["lower_partial_sum"]

_KEPT = "; kept partial through"


def lower_partial_sum(low: LocalValues, node: fx.Node, rule: FactorRule) -> bool:
    """Emit ``node`` on its partial operands' local addends if propagation kept its result
    partial; False (nothing emitted) otherwise."""
    if not rule.facts.linear:
        return False
    wanted = node_meta.sharding(node)
    if not isinstance(wanted, Sharding) or not wanted.partial or any(wanted.dim_axes):
        return False

    def look(a: fx.Node) -> tuple[tuple[str, ...], str, bool] | None:
        v = low.values.get(low.key(a))
        if v is None:
            return None
        s = v.sharding
        return s.partial, s.reduce_op, any(s.dim_axes)

    if kept_partial(node, rule, look) != wanted.partial:
        return False
    origin = None
    for a in node.args:
        if isinstance(a, fx.Node) and origin is None:
            origin = low._partial_origin.get(low.key(a))

    def local(a: fx.Node) -> fx.Node:
        key = low.key(a)
        return low.values[key].node if key in low.values else a

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), local)
    out = low.emit(node.target, tuple(args), dict(kwargs))
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(out, wanted, tuple(val.shape), val.dtype)
    if origin is not None:
        text = origin[0].split(_KEPT)[0]
        low._partial_origin[(node, None)] = (
            f"{text}{_KEPT} {op_name(node.target)} (%{node.name}) and reduced once",
            origin[1],
        )
    return True
