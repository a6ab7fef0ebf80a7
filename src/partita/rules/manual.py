"""Factor rules for the ops of partially manual (``shard_map(..., axes=)``) regions.

Inside a region that is manual over some mesh axes only, the other (*auto*) axes still
propagate through the body: its values are local blocks along the manual axes, and propagation
may split them further along the auto axes. Two kinds of op there have no registry rule:

- the boundaries (``partita::manual_enter`` / ``manual_exit``): an identity on every dim; the
  factor sizes are the *local* block's (the smaller side), so an auto axis is only chosen when it
  divides the block;
- the mesh ops a body calls (``partita.psum`` lowers to ``all_reduce`` and so on): pass-through
  on every dim except the ones they gather, scatter or exchange, which must stay whole over the
  auto axes (need-replication), since the op concatenates or splits them across devices.

These rules are not in the registry (it holds the rules of ops any program may contain; these
only appear inside regions), so :func:`manual_rule` is asked first, by ``propagate.state``.
"""

from __future__ import annotations

import string
from typing import Any

import torch

from partita.capture.manual import ENTER_OP, EXIT_OP
from partita.rules.factor import FactorKind, FactorRule, OpInfo
from partita.rules.facts import NO_FACTS, OpFacts

__all__ = ["manual_rule"]

_p = torch.ops.partita
#: For each mesh op: the names of its int arguments naming dims that must stay whole.
_WHOLE_DIMS: dict[Any, tuple[str, ...]] = {
    _p.all_reduce.default: (),
    _p.collective_permute.default: (),
    _p.all_gather.default: ("dim",),
    _p.reduce_scatter.default: ("dim",),
    _p.all_to_all.default: ("split_dim", "concat_dim"),
}
#: reduce_scatter moves its operand (the Plan records the block it reduces); the others move
#: what they return.
_MOVES_OPERAND = OpFacts(moves="operand")


def _letters(n: int, offset: int = 0) -> tuple[str, ...]:
    return tuple(string.ascii_lowercase[offset : offset + n])


def manual_rule(info: OpInfo) -> FactorRule | None:
    """The rule of a region op, or None when ``info.target`` is not one."""
    target = info.target
    if target in (ENTER_OP, EXIT_OP):
        (x,) = info.operands
        (out,) = info.results
        assert out is not None  # both ops return a tensor
        dims = tuple((f,) for f in _letters(len(x.shape)))
        sizes = {f: min(a, b) for (f,), a, b in zip(dims, x.shape, out.shape, strict=True)}
        return FactorRule(operands=(dims,), results=(dims,), sizes=sizes)
    if target is _p.axis_index.default:
        return FactorRule(operands=(None,), results=((),), sizes={})
    if target not in _WHOLE_DIMS:
        return None
    x = info.operands[0]
    out = info.results[0]
    assert out is not None
    whole = {int(info.arg(n)) % max(len(x.shape), 1) for n in _WHOLE_DIMS[target]}
    ins = list(_letters(len(x.shape)))
    outs = list(ins)
    kinds = {}
    for d in whole:  # the op changes these dims' sizes: separate factors, each kept whole
        ins[d], outs[d] = f"{ins[d]}0", f"{ins[d]}1"
        kinds[ins[d]] = kinds[outs[d]] = FactorKind.NEED_REPLICATION
    sizes = {f: n for f, n in zip(ins, x.shape, strict=True)}
    sizes.update({f: n for f, n in zip(outs, out.shape, strict=True)})
    return FactorRule(
        operands=(tuple((f,) for f in ins),),
        results=(tuple((f,) for f in outs),),
        sizes=sizes,
        kinds=kinds,
        facts=_MOVES_OPERAND if target is _p.reduce_scatter.default else NO_FACTS,
    )
