"""What an op's factor assignment may be once it is lowered, and checks on the op itself.

Propagation chooses ``node_meta.factor_axes`` for every op; :func:`representable` keeps only
the axes the partitioner can honour (a need-replication factor, a result-only factor the op
cannot produce locally, a minor factor of a compound dim whose major factor is not fully split,
or the factors of an op whose mandatory handler is missing are computed whole), and
:func:`dims_of` turns an assignment into the mesh axes of each dim of a tensor.
:func:`check_same_dtype` refuses an op that does not promote types but mixes float dtypes.

This module emits nothing (``partition.lower`` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx as fx

from partita.errors import DtypeError
from partita.partition import handlers
from partita.report.explain import op_name
from partita.rules import FactorKind, FactorRule
from partita.rules.opinfo import source_of
from partita.values.mesh import Mesh

__all__ = ["check_same_dtype", "dims_of", "memo_by_rule", "representable"]

T = TypeVar("T")


def representable(
    mesh: Mesh, target: Any, rule: FactorRule, assign: dict[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Drop factor axes that some tensor of the op cannot hold or that need a handler the
    partitioner lacks (computing those factors whole is always correct): without its
    handler an op computes its summed and windowed factors whole, and a ``WHOLE_OP``
    handler's op (random draws, softmax, batch norm, cummax) is computed entirely replicated.
    (``partita.partition`` checks at import that every handler name has a lowering; this is
    the safe fallback should one be removed.)"""
    out = {f: a for f, a in assign.items() if a}
    missing = rule.handler not in (None, *handlers.GENERIC) and not handlers.has(rule.handler)
    if missing and rule.handler in handlers.WHOLE_OP:
        return {}
    summed = set(rule.summed_factors)
    in_operands = {f for t in rule.operands for d in t or () for f in d}
    local_results = handlers.makes_local_results(target, rule)
    for f in list(out):
        if f not in in_operands and not local_results:
            del out[f]  # a result-only factor: the op computes it whole (then a local slice)
            continue
        kind = rule.kind(f)
        if kind is FactorKind.NEED_REPLICATION:
            del out[f]
        elif missing and (kind is FactorKind.WINDOWED or f in summed):
            del out[f]
    changed = True
    while changed:
        changed = False
        for t in (*rule.operands, *rule.results):
            for dim in t or ():
                for major, minor in itertools.pairwise(dim):
                    full = mesh.axes_size(out.get(major, ())) == rule.sizes[major]
                    if not full and out.get(minor):
                        del out[minor]
                        changed = True
    return out


def memo_by_rule(
    memo: dict[tuple[Any, ...], Any],
    key: tuple[Any, ...],
    rule: FactorRule,
    compute: Callable[[], T],
) -> T:
    """``compute()`` memoised in ``memo`` under ``key`` and ``rule``, for a pure function of an
    op's rule and assignment (``key`` names the function and holds the assignment's items):
    the ops of every layer repeat a few (rule, assignment) pairs. Keyed by the rule's id, the
    rule itself is kept with the answer and compared, so a hit is the very rule."""
    full = (id(rule), *key)
    found = memo.get(full)
    if found is None or found[0] is not rule:
        found = memo[full] = (rule, compute())
    return found[1]


def dims_of(
    factors: tuple[tuple[str, ...], ...], assign: dict[str, tuple[str, ...]]
) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(a for f in dim for a in assign.get(f, ())) for dim in factors)


def check_same_dtype(node: fx.Node) -> None:
    """An op that does not promote types gets one floating dtype, or the run would fail."""
    tensors = [
        a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
    ]
    floats = [(i, t) for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if len({t.dtype for _, t in floats}) > 1:
        listed = ", ".join(f"operand {i} {t.dtype} {list(t.shape)}" for i, t in floats)
        raise DtypeError(
            f"{op_name(node.target)} at node {node.name} "
            f"({source_of(node) or 'source line unknown'}) mixes dtypes ({listed}). This op "
            f"does not promote types, so its per-device program would fail when it runs. Cast "
            f"the operands to one dtype first (for example b.to(a.dtype))."
        )
