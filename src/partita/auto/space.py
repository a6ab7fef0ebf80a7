"""The choice space of auto-sharding: one block of candidates per op and per program input.

:func:`build_space` reads a traced (not yet propagated) program through propagation's
``ProgramState`` (every op with its FactorRule, every tensor value) and lists, per op, the factor
assignments the rule allows: one factor per mesh axis, the axes of a factor in mesh order, the
axis product dividing the factor's size, need-replication factors unsharded, windowed factors
only when the rule names a handler, compound factors only where they are the major factor of
every compound dim they are in. Every candidate fixes the sharding each operand must have and the
sharding of each result (partial over the axes of its summed factors), as the partitioner
derives them from ``factor_axes``.

A program input's candidates are its shardings (replicated, or each mesh axis on one dim that it
divides). Inputs a front end ties together (a parameter and its optimizer states) share one
block; an input the user annotated has one candidate, the annotation; an op whose result is an
annotation has one candidate, the assignment that gives it.

This module only enumerates; :mod:`partita.auto.costs` prices the candidates.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.propagate.assign import merge_axes, split_axes
from partita.propagate.state import OpState, ProgramState, ValueKey
from partita.rules import FactorKind, FactorRule
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["Block", "Follower", "Space", "Use", "build_space", "input_candidates"]

Assign = dict[str, tuple[str, ...]]

#: More candidates than this per op: keep only one axis per factor (the mesh order cuts it).
MAX_CANDIDATES = 400


@dataclass
class Block:
    """One one-hot group of binary variables: an op's assignments or an input's shardings.

    ``assigns[i]`` is candidate i's factor assignment (inputs: empty); ``results[i]`` its
    result shardings by value; ``node`` the op (or the first input) it decides."""

    node: fx.Node
    assigns: list[Assign]
    results: list[dict[ValueKey, Sharding]]
    op: OpState | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    #: ops that follow this block (``Follower``): priced on its candidates
    followers: list[Follower] = field(default_factory=list)
    #: per candidate, the bytes the op reads and writes on one device
    local_bytes: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.assigns)


@dataclass
class Follower:
    """A pass-through op with one operand that shares its producer's block (Alpa's
    ``s_follow``): under the block's candidate i it reads its operand as ``needs[i]`` (from
    ``has[i]``: a reshard priced on candidate i) with assignment ``assigns[i]``."""

    op: OpState
    value: ValueKey
    assigns: list[Assign]
    has: list[Sharding]
    needs: list[Sharding]
    local_bytes: list[float] = field(default_factory=list)


@dataclass
class Use:
    """A block that reads a value: candidate i needs it as ``needs[i]`` (None: no need)."""

    block: int
    value: ValueKey
    needs: list[Sharding | None]


@dataclass
class Space:
    """Every block, who produces each value (block, and its sharding per candidate), who uses
    it, the values' shapes and dtypes."""

    mesh: Mesh
    blocks: list[Block]
    producer: dict[ValueKey, int]
    uses: list[Use]
    shapes: dict[ValueKey, tuple[int, ...]]
    dtypes: dict[ValueKey, torch.dtype]
    input_block: dict[fx.Node, int]
    #: the program's results: a partial one is reduced before it is returned
    outputs: list[ValueKey] = field(default_factory=list)
    #: shapes of the inputs in groups (parameters): their reshards (a parameter's gather, its
    #: gradient's reduction) are bucketed by the partitioner
    stored_shapes: set[tuple[int, ...]] = field(default_factory=set)


def _val(key: ValueKey) -> Any:
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


def _follows(op: OpState, state: ProgramState) -> ValueKey | None:
    """The one operand a pass-through op follows (None: the op is not a follower)."""
    rule = op.rule
    keys = {k for k in op.operands if k is not None}
    if len(keys) != 1 or any(k is None for k in op.results):
        return None
    if any(rule.kind(f) is not FactorKind.PASS_THROUGH for f in rule.factors):
        return None
    for t in (*rule.operands, *rule.results):
        if t is not None and any(len(d) > 1 for d in t):
            return None
    if any(state.values[k].fixed for k in op.results if k is not None):
        return None
    return next(iter(keys))


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
    read = sum(_local(n, _val(k)) for n, k in zip(needs, op.operands, strict=True) if k is not None)
    return read + sum(_local(r, _val(k)) for k, r in results.items())


def _fixed_assign(mesh: Mesh, op: OpState, state: ProgramState) -> Assign | None:
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


def build_space(
    state: ProgramState,
    inputs: Sequence[fx.Node],
    groups: Sequence[Sequence[int]],
    fixed: dict[int, Sharding],
    ties: Sequence[tuple[ValueKey, int]],
) -> Space:
    """The choice space of a program.

    Args:
        state: the program's propagation state (built, not run).
        inputs: the program's tensor input placeholders, in order.
        groups: positions in ``inputs`` that share one block (each position in at most one).
        fixed: position -> the annotated Sharding of that input.
        ties: (value, input position): the value must end as that input's sharding (an
            updated parameter or optimizer state returned by the step).
    """
    mesh = state.mesh
    blocks: list[Block] = []
    producer: dict[ValueKey, int] = {}
    uses: list[Use] = []
    input_block: dict[fx.Node, int] = {}
    grouped = {i: g for g in groups for i in g}
    done: set[int] = set()
    for i, node in enumerate(inputs):
        if i in done:
            continue
        members = list(grouped.get(i, [i]))
        done.update(members)
        shape = tuple(node.meta["val"].shape)
        pinned = [fixed[m] for m in members if m in fixed]
        shardings = [pinned[0]] if pinned else input_candidates(mesh, shape)
        nodes = [inputs[m] for m in members]
        block = Block(node, [{} for _ in shardings], [{} for _ in shardings], inputs=nodes)
        for n in nodes:
            key: ValueKey = (n, None)
            if key not in state.values:
                continue
            for r, s in zip(block.results, shardings, strict=True):
                r[key] = s
            producer[key] = len(blocks)
        for n in nodes:
            input_block[n] = len(blocks)
        blocks.append(block)
    for op in state.ops:
        followed = _follows(op, state)
        if followed is not None and followed in producer:
            root = blocks[producer[followed]]
            if any(r[followed].partial for r in root.results):
                followed = None  # a partial value: the op chooses where its reduction goes
        if followed is not None and followed in producer:
            has = [r[followed] for r in root.results]
            assigns = [_assign_from(mesh, op, followed, h) for h in has]
            needs = [_needs(mesh, op, a) for a in assigns]
            j = [k for k in op.operands].index(followed)
            follower = Follower(op, followed, assigns, has, [cast(Sharding, n[j]) for n in needs])
            root.followers.append(follower)
            for r, a, nd in zip(root.results, assigns, needs, strict=True):
                res = _results(mesh, op, a)
                follower.local_bytes.append(_op_bytes(op, nd, res))
                r.update(res)
            for rkey in op.results:
                if rkey is not None:
                    producer[rkey] = producer[followed]
            continue
        forced = _fixed_assign(mesh, op, state)
        cands = [forced] if forced is not None else op_candidates(mesh, op)
        b = len(blocks)
        block = Block(op.node, cands, [_results(mesh, op, a) for a in cands], op=op)
        blocks.append(block)
        for rkey in op.results:
            if rkey is not None:
                producer[rkey] = b
        needs = [_needs(mesh, op, a) for a in cands]
        block.local_bytes = [
            _op_bytes(op, nd, res) for nd, res in zip(needs, block.results, strict=True)
        ]
        for j, okey in enumerate(op.operands):
            if okey is not None and needs[0][j] is not None:
                uses.append(Use(b, okey, [n[j] for n in needs]))
    for key, pos in ties:
        b = input_block[inputs[pos]]
        uses.append(Use(b, key, [r[(inputs[pos], None)] for r in blocks[b].results]))
    (out_node,) = [n for n in state.gm.graph.nodes if n.op == "output"]
    outputs = [state.key(n) for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, fx.Node)]
    outputs = [k for k in outputs if k in producer]
    keys = set(producer)
    shapes = {k: tuple(_val(k).shape) for k in keys}
    dtypes = {k: _val(k).dtype for k in keys}
    stored = {tuple(inputs[i].meta["val"].shape) for g in groups for i in g}
    return Space(mesh, blocks, producer, uses, shapes, dtypes, input_block, outputs, stored)
