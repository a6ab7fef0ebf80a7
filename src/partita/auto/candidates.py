"""The candidates of one op or input of the choice space (:mod:`partita.auto.space`), and their
memoised templates.

Per op, the factor assignments its rule allows (see :mod:`partita.auto.space`), each with the
sharding every result has (partial over the axes of its summed factors), the sharding every
operand must have, and the bytes one device reads and writes. A model's repeated layers repeat
the same ops: :class:`Templates` enumerates once per op *signature* (``space._sig``: the op's
rule object, which propagation shares between ops with equal targets, argument shapes, dtypes
and constants) and every copy reuses the template, its assignments, its Sharding objects and
its columns, so the enumeration is done once per unique op, not per layer. The same objects
let later stages (the clusters, the prices) key their own caches on them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.propagate.assign import merge_axes, split_axes
from partita.propagate.state import OpState, ProgramState, ValueKey
from partita.rules import FactorKind, FactorRule
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = [
    "MAX_CANDIDATES", "Assign", "Templates", "describe_val", "fixed_assign", "input_candidates",
    "keyed", "op_candidates", "value_of",
]  # fmt: skip

Assign = dict[str, tuple[str, ...]]

#: More candidates than this per op: keep only one axis per factor (the mesh order cuts it).
MAX_CANDIDATES = 400


def value_of(key: ValueKey) -> Any:
    node, idx = key
    val = node.meta["val"]
    return val if idx is None else val[idx]


def input_candidates(mesh: Mesh, shape: Sequence[int]) -> list[Sharding]:
    """Replicated, then every placement of mesh axes on dims that they divide (several axes on
    one dim in mesh order)."""
    axes = mesh.axis_names
    out: list[Sharding] = []
    seen: set[tuple[tuple[str, ...], ...]] = set()
    for choice in itertools.product(range(-1, len(shape)), repeat=len(axes)):
        dims: list[tuple[str, ...]] = [() for _ in shape]
        for a, d in zip(axes, choice, strict=True):
            if d >= 0:
                dims[d] = (*dims[d], a)
        if any(dims[d] and shape[d] % mesh.axes_size(dims[d]) for d in range(len(shape))):
            continue
        key = tuple(dims)
        if key not in seen:
            seen.add(key)
            out.append(Sharding(mesh, key))
    return out


def _eligible(rule: FactorRule, op: OpState) -> list[str]:
    major_only: set[str] = set()
    for t in (*rule.operands, *rule.results):
        for d in t or ():
            if len(d) > 1:
                major_only.update(d[1:])
    out = []
    for f in rule.factors:
        kind = rule.kind(f)
        if rule.sizes[f] <= 1 or kind is FactorKind.NEED_REPLICATION:
            continue
        if kind is FactorKind.WINDOWED and rule.handler is None:
            continue
        if f in op.compound and f in major_only:
            continue
        out.append(f)
    return out


def op_candidates(mesh: Mesh, op: OpState) -> list[Assign]:
    """Every assignment of the op's rule that the partitioner can lower (see the module)."""
    rule = op.rule
    factors = _eligible(rule, op)
    axes = mesh.axis_names
    out: list[Assign] = []
    for choice in itertools.product(range(-1, len(factors)), repeat=len(axes)):
        assign: Assign = {}
        for a, i in zip(axes, choice, strict=True):
            if i >= 0:
                assign[factors[i]] = (*assign.get(factors[i], ()), a)
        if any(rule.sizes[f] % mesh.axes_size(fa) for f, fa in assign.items()):
            continue
        out.append(assign)
        if len(out) > MAX_CANDIDATES:
            return [a for a in out if all(len(v) == 1 for v in a.values())]
    return out


def _dims(
    mesh: Mesh, factors: Any, assign: Assign, rule: FactorRule
) -> tuple[tuple[str, ...], ...]:
    return tuple(merge_axes(mesh, d, assign, rule.sizes) if d else () for d in factors)


def _results(mesh: Mesh, op: OpState, assign: Assign) -> dict[ValueKey, Sharding]:
    rule = op.rule
    out: dict[ValueKey, Sharding] = {}
    for j, (factors, key) in enumerate(zip(rule.results, op.results, strict=True)):
        if factors is None or key is None:
            continue
        dims = _dims(mesh, factors, assign, rule)
        summed = {a for f in rule.partial_factors(j) for a in assign.get(f, ())}
        partial = tuple(a for a in mesh.axis_names if a in summed)
        out[key] = Sharding(mesh, dims, partial, rule.reduce_op if partial else "sum")
    return out


def _needs(mesh: Mesh, op: OpState, assign: Assign) -> list[Sharding | None]:
    rule = op.rule
    return [
        Sharding(mesh, _dims(mesh, factors, assign, rule))
        if factors is not None and key is not None
        else None
        for factors, key in zip(rule.operands, op.operands, strict=True)
    ]


def _assign_from(mesh: Mesh, op: OpState, key: ValueKey, s: Sharding) -> Assign:
    """The assignment under which ``op`` reads its operand ``key`` as laid out by ``s``."""
    rule = op.rule
    assign: Assign = {}
    for factors, k in zip(rule.operands, op.operands, strict=True):
        if k != key or factors is None:
            continue
        for dim_axes, d in zip(s.dim_axes, factors, strict=True):
            if dim_axes and d:
                for f, fa in split_axes(mesh, dim_axes, d, rule.sizes).items():
                    if rule.sizes[f] % mesh.axes_size(fa) == 0 and f not in assign:
                        assign[f] = fa
        break
    return assign


def _local(s: Sharding | None, val: Any) -> float:
    if s is None or not isinstance(val, torch.Tensor):
        return 0.0
    return val.numel() * val.element_size() / s.mesh.axes_size([a for d in s.dim_axes for a in d])


def _op_bytes(
    op: OpState, needs: list[Sharding | None], results: dict[ValueKey, Sharding]
) -> float:
    """Bytes one device reads and writes for ``op`` under one candidate."""
    read = sum(
        _local(n, value_of(k)) for n, k in zip(needs, op.operands, strict=True) if k is not None
    )
    return read + sum(_local(r, value_of(k)) for k, r in results.items())


def fixed_assign(mesh: Mesh, op: OpState, state: ProgramState) -> Assign | None:
    """The assignment an annotation's value forces on its op (None: no result is fixed)."""
    rule = op.rule
    for factors, key in zip(rule.results, op.results, strict=True):
        if factors is None or key is None:
            continue
        v = state.values[key]
        if v.fixed and v.dims is not None:
            assign: Assign = {}
            for dim_axes, d in zip(v.dims, factors, strict=True):
                if dim_axes and d:
                    assign.update(split_axes(mesh, dim_axes, d, rule.sizes))
            return assign
    return None


def describe_val(val: Any) -> Any:
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals
    )


@dataclass
class _Template:
    """An op's candidates by position: per candidate its result shardings (per result index,
    None where no value), the sharding each operand needs, and its local bytes."""

    assigns: list[Assign]
    results: list[list[Sharding | None]]
    needs: list[list[Sharding | None]]
    local_bytes: list[float]
    #: the same by position: per result, its sharding under each candidate; per operand, the
    #: sharding each candidate needs. One object per template, shared by every copy of the op,
    #: so later stages key their caches on its ``id``
    result_columns: list[tuple[Sharding | None, ...]] = field(default_factory=list)
    need_columns: list[tuple[Sharding | None, ...]] = field(default_factory=list)


class Templates:
    """Memoised candidate lists: one per op signature (so identical layers enumerate once)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.ops: dict[Any, _Template] = {}
        self.follow: dict[Any, _Template] = {}
        self.inputs: dict[tuple[int, ...], tuple[Sharding, ...]] = {}
        self.partials: dict[int, bool] = {}
        #: (id of a need column, permutation) -> the column unpermuted (``space._unpermute``)
        self.unpermuted: dict[tuple[int, tuple[int, ...]], tuple[Sharding | None, ...]] = {}
        #: templates built (cache misses): the enumeration work, independent of repeats
        self.built = 0
        #: one object per distinct Sharding: equal shardings are the same object, so later
        #: stages group and key by ``id`` (cheap) with the meaning of equality
        self.canon: dict[Sharding, Sharding] = {}

    def intern(self, s: Sharding | None) -> Any:
        """The one object equal to ``s``."""
        return None if s is None else self.canon.setdefault(s, s)

    def _make(self, op: OpState, assigns: list[Assign]) -> _Template:
        self.built += 1
        mesh = self.mesh
        results, needs, local = [], [], []
        for a in assigns:
            res = _results(mesh, op, a)
            nd = [self.intern(n) for n in _needs(mesh, op, a)]
            results.append([self.intern(res.get(k)) if k is not None else None for k in op.results])
            needs.append(nd)
            local.append(_op_bytes(op, nd, res))
        t = _Template(assigns, results, needs, local)
        t.result_columns = [tuple(row[j] for row in results) for j in range(len(op.results))]
        t.need_columns = [tuple(row[j] for row in needs) for j in range(len(op.operands))]
        return t

    def op(self, op: OpState, sig: Any) -> _Template:
        found = self.ops.get(sig)
        if found is None:
            found = self.ops[sig] = self._make(op, op_candidates(self.mesh, op))
        return found

    def follower(self, op: OpState, sig: Any, j: int, has: Sequence[Sharding]) -> _Template:
        """The template of ``op`` reading its operand ``j`` laid out as ``has`` (a column)."""
        fkey = (sig, j, id(has))
        found = self.follow.get(fkey)
        if found is None:
            key = op.operands[j]
            assert key is not None
            assigns = [_assign_from(self.mesh, op, key, h) for h in has]
            found = self.follow[fkey] = self._make(op, assigns)
        return found

    def input(self, shape: tuple[int, ...]) -> tuple[Sharding, ...]:
        found = self.inputs.get(shape)
        if found is None:
            found = tuple(self.intern(c) for c in input_candidates(self.mesh, shape))
            self.inputs[shape] = found
        return found

    def partial(self, column: Sequence[Sharding | None]) -> bool:
        """Some candidate of ``column`` (a template's or an input's) is partial."""
        found = self.partials.get(id(column))
        if found is None:
            found = self.partials[id(column)] = any(s is not None and s.partial for s in column)
        return found


def keyed(op: OpState, t: _Template) -> dict[ValueKey, Sequence[Sharding | None]]:
    """Per result value of ``op``, its sharding under each candidate of ``t``."""
    return {k: c for k, c in zip(op.results, t.result_columns, strict=True) if k is not None}
