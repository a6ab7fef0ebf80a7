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

The candidates themselves come from :mod:`partita.auto.candidates`, enumerated once per
distinct op (a repeated layer's ops reuse them). This module only assembles the space;
:mod:`partita.auto.costs` prices the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.auto.candidates import (
    Assign,
    Templates,
    describe_val,
    fixed_assign,
    input_candidates,
    keyed,
)
from partita.cost.flops import value_bytes
from partita.propagate.state import OpState, ProgramState, ValueKey
from partita.rules import FactorKind
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

_PERMUTE = torch.ops.aten.permute.default

__all__ = [
    "Assign", "Block", "Column", "Follower", "Space", "Use", "build_space", "input_candidates",
]  # fmt: skip


#: per candidate of a block, a value's sharding (None: the candidate does not give it)
Column = Sequence[Sharding | None]


@dataclass(slots=True)
class Block:
    """One one-hot group of binary variables: an op's assignments or an input's shardings.

    ``assigns[i]`` is candidate i's factor assignment (inputs: empty); ``columns[v]`` the
    sharding of value ``v`` under each candidate (the op's results and its followers'; an
    input's members); ``node`` the op (or the first input) it decides. A column is one object
    per op template (``auto.candidates``), shared by every copy of a layer, so the build keys
    its caches on its ``id``; ``result(i)`` and ``results`` give the same by candidate."""

    node: fx.Node
    assigns: list[Assign]
    columns: dict[ValueKey, Column]
    op: OpState | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    #: ops that follow this block (``Follower``): priced on its candidates
    followers: list[Follower] = field(default_factory=list)
    #: per candidate, the bytes the op reads and writes on one device
    local_bytes: list[float] = field(default_factory=list)
    #: what the candidate list and its prices follow from (the op's rule, target and shapes;
    #: an input's shapes): two blocks with one ``sig`` have the same candidates, in the same
    #: order, the same shardings (the same objects) and the same prices
    sig: Any = None

    def __len__(self) -> int:
        return len(self.assigns)

    def result(self, i: int) -> dict[ValueKey, Sharding]:
        """Candidate ``i``'s sharding of every value the block gives."""
        return {k: c[i] for k, c in self.columns.items() if c[i] is not None}  # type: ignore[misc]

    @property
    def results(self) -> list[dict[ValueKey, Sharding]]:
        return [self.result(i) for i in range(len(self))]


@dataclass(slots=True)
class Follower:
    """A pass-through op with one operand that shares its producer's block (Alpa's
    ``s_follow``): under the block's candidate i it reads its operand as ``needs[i]`` (from
    ``has[i]``: a reshard priced on candidate i) with assignment ``assigns[i]``."""

    op: OpState
    value: ValueKey
    assigns: list[Assign]
    has: Column
    needs: Column
    local_bytes: list[float] = field(default_factory=list)
    #: as ``Block.sig``, with the shardings the root gives it
    sig: Any = None


@dataclass(slots=True)
class Use:
    """A block that reads a value: candidate i needs it as ``needs[i]`` (None: no need)."""

    block: int
    value: ValueKey
    needs: Column
    #: read through a follower permute (see ``_unpermute``): the partitioner reshards the
    #: source where the permute's reader runs, not in the parameters' buckets
    through: bool = False


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
    #: shapes of the inputs in groups (parameters), and of every value with the same shape up
    #: to size-1 dims (a bias gradient summed with ``keepdim``): their reshards (a parameter's
    #: gather, its gradient's reduction) are bucketed by the partitioner
    stored_shapes: set[tuple[int, ...]] = field(default_factory=set)
    #: full bytes of one member of each group (the parameters' bytes): what the bucketed
    #: collectives of one kind move at most when each parameter moves once
    stored_bytes: float = 0.0
    #: candidate lists enumerated (one per distinct op signature, not per op)
    templates_built: int = 0
    #: the traced program's graph, whose node order the memory walk follows (``auto.memory``)
    graph: fx.Graph | None = None


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _passes_dims(rule: Any) -> bool:
    """Every factor of ``rule`` passes through and no dim is compound: what a follower's rule
    must be (``_follows``), a property of the rule alone."""
    if any(rule.kind(f) is not FactorKind.PASS_THROUGH for f in rule.factors):
        return False
    return not any(
        t is not None and any(len(d) > 1 for d in t) for t in (*rule.operands, *rule.results)
    )


def _follows(
    op: OpState, values: dict[ValueKey, Any], passes: dict[int, bool], fixed: set[ValueKey]
) -> ValueKey | None:
    """The one operand a pass-through op follows (None: the op is not a follower);
    ``passes`` memoises ``_passes_dims`` per rule object (the copies of a layer share one), so
    most ops are answered by one look-up (run once per op of a deep program); ``fixed``: the
    values an annotation fixes (``ValueState.fixed``)."""
    rule = op.rule
    found = passes.get(id(rule))
    if found is None:
        found = passes[id(rule)] = _passes_dims(rule)
    if not found:
        return None
    key = None
    for k in op.operands:
        if k is not None:
            if key is not None and k != key:
                return None
            key = k
    if key is None:
        return None
    for k in op.results:
        if k is None or k in fixed:
            return None
    return key


def _reads(t: Any) -> list[tuple[int, Column]]:
    """The operand positions of template ``t`` whose candidates need a sharding, with the
    column of needs: a block's uses (its operands there), the same for every op of ``t``."""
    return [(j, c) for j, c in enumerate(t.need_columns) if c and c[0] is not None]


def _sig(op: OpState) -> Any:
    """What the op's candidates and prices follow from: propagation gives ops with equal
    arguments (target, shapes, dtypes, constants) one rule object (``ProgramState._op_shape``),
    so that object names them cheaply; a rule of its own (not memoised) names one op."""
    return ("rule", id(op.rule))


def _unpermute(
    templates: Templates, found: tuple[ValueKey, list[int]], column: Column
) -> tuple[ValueKey, Column]:
    """A need on ``permute(u, perm)`` as the need on ``u``: the partitioner reshards a follower
    permute's value by resharding its (non-partial) source and permuting the copy
    (``LocalValues._reshard_through_permute``), so a weight read transposed in the forward and
    as is in the backward is gathered once."""
    key, perm = found
    memo = (id(column), tuple(perm))
    out = templates.unpermuted.get(memo)
    if out is None:
        rows: list[Sharding | None] = []
        for need in column:
            if need is None:
                rows.append(None)
                continue
            dims: list[tuple[str, ...]] = [()] * len(perm)
            for i, p in enumerate(perm):
                dims[p] = need.dim_axes[i]
            rows.append(templates.intern(Sharding(need.mesh, tuple(dims))))
        out = templates.unpermuted[memo] = tuple(rows)
    return key, out


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
    templates = Templates(mesh)
    blocks: list[Block] = []
    producer: dict[ValueKey, int] = {}
    uses: list[Use] = []
    input_block: dict[fx.Node, int] = {}
    grouped = {i: g for g in groups for i in g}
    done: set[int] = set()
    # a follower permute's result -> (the value it permutes, through chains of permutes; the
    # permutation): a reshard of it is the partitioner's reshard of that value
    through: dict[ValueKey, tuple[ValueKey, list[int]]] = {}
    for i, node in enumerate(inputs):
        if i in done:
            continue
        members = list(grouped.get(i, [i]))
        done.update(members)
        shape = tuple(node.meta["val"].shape)
        pinned = [fixed[m] for m in members if m in fixed]
        shardings = (templates.intern(pinned[0]),) if pinned else templates.input(shape)
        nodes = [inputs[m] for m in members]
        block = Block(node, [{} for _ in shardings], {}, inputs=nodes)
        block.sig = (
            "input",
            tuple(describe_val(n.meta.get("val")) for n in nodes),
            str(pinned[0]) if pinned else None,
        )
        for n in nodes:
            key: ValueKey = (n, None)
            if key not in state.values:
                continue
            block.columns[key] = shardings
            producer[key] = len(blocks)
        for n in nodes:
            input_block[n] = len(blocks)
        blocks.append(block)
    passes: dict[int, bool] = {}  # id(rule) -> _passes_dims(rule)
    values = state.values
    # the values an annotation fixes: an op with none among its results is not forced
    fixed_keys = state.fixed
    # an op's signature -> (its template, _reads(template)): one look-up per op
    made: dict[Any, tuple[Any, list[tuple[int, Column]]]] = {}
    for op in state.ops:
        rule = op.rule
        followed = _follows(op, values, passes, fixed_keys)
        if followed is not None:
            at = producer.get(followed, -1)
            if at < 0:
                followed = None
            else:
                root = blocks[at]
                has = root.columns[followed]
                if templates.partial(has):
                    followed = None  # a partial value: the op chooses where its reduction goes
        if followed is not None:
            sig = _sig(op)
            j = op.operands.index(followed)
            t = templates.follower(op, sig, j, has)  # type: ignore[arg-type]
            follower = Follower(
                op, followed, t.assigns, has, t.need_columns[j], t.local_bytes,
                sig=(sig, j, id(has)),
            )  # fmt: skip
            root.followers.append(follower)
            columns = root.columns
            for rkey, c in zip(op.results, t.result_columns, strict=True):
                if rkey is not None:
                    columns[rkey] = c
                    producer[rkey] = at
            if op.node.target == _PERMUTE and op.results[0] is not None:
                root_key, perm = through.get(followed, (followed, None))
                dims = cast(Sequence[int], op.node.args[1])
                mine = [int(p) % len(rule.results[0] or ()) for p in dims]
                composed = mine if perm is None else [perm[p] for p in mine]
                through[op.results[0]] = (root_key, composed)
            continue
        sig = _sig(op)
        got = None
        if not (fixed_keys and not fixed_keys.isdisjoint(op.results)):
            got = made.get(sig)
            if got is None:
                t = templates.op(op, sig)
                got = made[sig] = (t, _reads(t))
        else:
            forced = fixed_assign(mesh, op, state)
            if forced is None:
                t = templates.op(op, sig)
            else:
                t = templates._make(op, [forced])
                sig = (sig, tuple(sorted(forced.items())))
            got = (t, _reads(t))
        t, read = got
        b = len(blocks)
        blocks.append(
            Block(op.node, t.assigns, keyed(op, t), op=op, local_bytes=t.local_bytes, sig=sig)
        )
        for rkey in op.results:
            if rkey is not None:
                producer[rkey] = b
        operands = op.operands
        for j, column in read:
            okey = operands[j]
            if okey is None:
                continue
            if through and okey in through:  # read through a permute: reshard its source
                okey, column = _unpermute(templates, through[okey], column)
                uses.append(Use(b, okey, column, True))
            else:
                uses.append(Use(b, okey, column, False))
    for key, pos in ties:
        b = input_block[inputs[pos]]
        column = blocks[b].columns[(inputs[pos], None)]
        permuted = key in through
        if permuted:
            key, column = _unpermute(templates, through[key], column)
        uses.append(Use(b, key, column, permuted))
    (out_node,) = [n for n in state.gm.graph.nodes if n.op == "output"]
    outputs = [state.key(n) for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, fx.Node)]
    outputs = [k for k in outputs if k in producer]
    shapes: dict[ValueKey, tuple[int, ...]] = {}
    dtypes: dict[ValueKey, torch.dtype] = {}
    described: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # by id of the value
    for k in producer:
        val = k[0].meta["val"]  # value_of(k), inlined (one per value of a deep program)
        if k[1] is not None:
            val = val[k[1]]
        found = described.get(id(val))
        if found is None:  # the copies of a layer share their value objects
            found = described[id(val)] = (tuple(val.shape), val.dtype)
        shapes[k], dtypes[k] = found
    stored = {tuple(inputs[i].meta["val"].shape) for g in groups for i in g}
    squeezed = {_squeeze(s) for s in stored}
    stored |= {s for s in set(shapes.values()) if _squeeze(s) in squeezed}
    stored_bytes = float(sum(value_bytes(inputs[g[0]].meta["val"]) for g in groups if g))
    space = Space(
        mesh, blocks, producer, uses, shapes, dtypes, input_block, outputs, stored, stored_bytes
    )
    space.templates_built = templates.built
    space.graph = state.gm.graph
    return space
