"""The propagation worklist: priority rounds, pass-through ops first, to a fixpoint
(invariants 1 to 3, 7 and 9 of ``partita.propagate``), and :func:`propagate`, the entry point.

One op's assignment is chosen in ``propagate.assign``; the state it reads and writes is built in
``propagate.state``.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.capture.gc_pause import gc_paused
from partita.errors import InternalError, PartitaError, ShardingConflictError
from partita.ir import node_meta
from partita.propagate.assign import choose_assignment, merge_axes
from partita.propagate.bodies import RunBody, is_control_flow, propagate_bodies
from partita.propagate.pending import keep_partial_sums
from partita.propagate.rules import compiler_error
from partita.propagate.state import OpState, ProgramState, ValueKey, ValueState
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["propagate"]


Assignment = dict[str, tuple[str, ...]]
# (slot of the op's operands then results, dims, partial axes, priority) a visit proposes
_SlotWrite = tuple[int, tuple[tuple[str, ...], ...], tuple[str, ...], int]
_Write = tuple[ValueKey, tuple[tuple[str, ...], ...], tuple[str, ...], int]


class _Propagator(ProgramState):
    """The worklist over a program's state: visit ops to a fixpoint, then write node.meta."""

    # _assignment's memo: (rule, round, what the op's values propose) -> (assign, writes)
    _memo: dict[tuple[Any, ...], tuple[Assignment, list[_SlotWrite]]]
    _shardings: dict[tuple[Any, ...], Sharding]  # _sharding's memo

    def _snapshot(self, op: OpState, round_priority: int) -> tuple[Any, ...]:
        """What a visit of ``op`` reads that can change: its values' versions, the round."""
        values = self.values
        return (
            round_priority,
            *(values[k].version if k is not None else -1 for k in op.operands),
            *(values[k].version if k is not None else -1 for k in op.results),
        )

    def _visit(self, op: OpState, round_priority: int) -> list[ValueKey]:
        # A visit is a function of the op and its values' states: if it changed nothing last
        # time and none of them has moved since, it would change nothing again.
        snapshot = self._snapshot(op, round_priority)
        if op.settled == snapshot:
            return []
        assign, writes = self._assignment(op, round_priority)
        changed: list[ValueKey] = []
        reduce_op = op.rule.reduce_op
        for key, dims, partial, prio in writes:
            if self._refine(key, list(dims), partial, reduce_op, prio):
                self.values[key].version += 1
                changed.append(key)
        op.settled, op.settled_assign = (None, None) if changed else (snapshot, assign)
        return changed

    def _assignment(self, op: OpState, round_priority: int) -> tuple[Assignment, list[_Write]]:
        """The op's assignment and what it proposes to each of its values, memoised.

        Both are a function of the op's rule (with its factor groups, which come with it) and
        of what :func:`choose_assignment` reads of its values (sharding, priority, size,
        stored), so ops of the same rule whose values are in the same states (each layer of
        a transformer) share one computation."""
        values = self.values
        parts: list[Any] = [id(op.rule), round_priority]
        for k in (*op.operands, *op.results):
            v = values[k] if k is not None else None
            if v is None or v.dims is None or v.priority > round_priority:
                parts.append(k is None)  # proposes nothing
            else:
                parts.append((*v.dims, v.priority, v.numel, v.stored))
        memo_key = tuple(parts)
        found = self._memo.get(memo_key)
        if found is None:
            assign, prio_of = choose_assignment(self.mesh, values, op, round_priority)
            writes = self._writes(op, assign, prio_of, round_priority)
            found = self._memo[memo_key] = (assign, writes)
        assign, slots = found
        keys = (*op.operands, *op.results)
        # _writes proposes only to tensor values: keys[i] is never None there
        return assign, [
            (cast(ValueKey, keys[i]), dims, partial, prio) for i, dims, partial, prio in slots
        ]

    def _writes(
        self, op: OpState, assign: Assignment, prio_of: dict[str, int], round_priority: int
    ) -> list[_SlotWrite]:
        """``(slot, dims, partial, priority)`` that ``assign`` gives each tensor of the op
        (operands then results), whatever its current sharding (``_refine`` decides)."""
        rule = op.rule
        out = []
        slot = 0
        for is_result, factors_list, keys in (
            (False, rule.operands, op.operands),
            (True, rule.results, op.results),
        ):
            for j, (factors, key) in enumerate(zip(factors_list, keys, strict=True)):
                slot += 1
                if factors is None or key is None:
                    continue
                dims = tuple(
                    merge_axes(self.mesh, d, assign, rule.sizes) if d else () for d in factors
                )
                used = {f for d in factors for f in d if assign.get(f)}
                partial: tuple[str, ...] = ()
                if is_result:
                    summed = [f for f in rule.partial_factors(j) if assign.get(f)]
                    used.update(summed)
                    axes = {a for f in summed for a in assign[f]}
                    partial = tuple(a for a in self.mesh.axis_names if a in axes)
                prio = min((prio_of[f] for f in used), default=round_priority)
                out.append((slot - 1, dims, partial, prio))
        return out

    def _refine(
        self,
        key: ValueKey,
        dims: list[tuple[str, ...]],
        partial: tuple[str, ...],
        reduce_op: str,
        prio: int,
    ) -> bool:
        v = self.values[key]
        if v.banned or v.prefix is not None:
            dims, partial = _region_view(v, dims, partial)
        if v.fixed or (not any(dims) and not partial):
            return False
        if v.dims is None:
            v.dims, v.partial, v.reduce_op, v.priority = dims, partial, reduce_op, prio
            return True
        if any(old != new[: len(old)] for old, new in zip(v.dims, dims, strict=True)):
            return False
        new_partial = v.partial
        if partial and not v.partial and not set(partial) & {a for d in dims for a in d}:
            new_partial = partial
        if set(new_partial) & {a for d in dims for a in d}:
            return False
        if dims == v.dims and new_partial == v.partial:
            return False
        v.dims = dims
        if new_partial != v.partial:
            v.partial, v.reduce_op = new_partial, reduce_op
        v.priority = min(v.priority, prio)
        return True

    # --- driver ----------------------------------------------------------------------------

    def run(self) -> None:
        self._memo, self._shardings = {}, {}
        priorities = sorted({v.priority for v in self.values.values() if v.fixed}) or [0]
        for p in priorities:
            for only_pass_through in (True, False):
                self._fixpoint(p, only_pass_through)
        natural = functools.partial(self._natural, round_priority=priorities[-1])
        for op in keep_partial_sums(self, natural):  # its values' versions stand: its users' too
            op.settled, op.settled_assign = self._snapshot(op, priorities[-1]), {}
        self._write_meta(priorities[-1])

    def _natural(
        self, op: OpState, round_priority: int
    ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]] | None:
        """The dims and partial axes the op's assignment gives its first result."""
        _, writes = self._assignment(op, round_priority)
        first = op.results[0] if op.results else None
        for key, dims, partial, _ in writes:
            if key == first:
                return dims, partial
        return None

    def _fixpoint(self, round_priority: int, only_pass_through: bool) -> None:
        eligible = [i for i, op in enumerate(self.ops) if not only_pass_through or op.pass_through]
        allowed = set(eligible)
        queue = deque(eligible)
        queued = set(eligible)
        while queue:
            i = queue.popleft()
            queued.discard(i)
            for key in self._visit_checked(self.ops[i], round_priority):
                for j in self.users.get(key, ()):
                    if j in allowed and j not in queued:
                        queue.append(j)
                        queued.add(j)

    def _visit_checked(self, op: OpState, round_priority: int) -> list[ValueKey]:
        try:
            return self._visit(op, round_priority)
        except Exception as e:
            if isinstance(e, PartitaError) and not isinstance(e, InternalError):
                raise
            raise compiler_error(op.node, "Propagation", e) from e

    def _sharding(self, key: ValueKey) -> Sharding:
        v = self.values[key]
        dims = tuple(v.dims) if v.dims is not None else ((),) * v.ndim
        memo_key = (dims, v.partial, v.reduce_op)  # a Sharding is immutable: values share one
        found = self._shardings.get(memo_key)
        if found is None:
            found = self._shardings[memo_key] = Sharding(self.mesh, dims, v.partial, v.reduce_op)
        return found

    def _write_meta(self, last_priority: int) -> None:
        for op in self.ops:
            assign = op.settled_assign
            if assign is None or op.settled != self._snapshot(op, last_priority):
                assign, _ = choose_assignment(self.mesh, self.values, op, last_priority)
            # a copy: memoised assignments are shared
            node_meta.set_factor_axes(op.node, dict(assign))
            node_meta.set_rule(op.node, op.rule)
        for node in self.gm.graph.nodes:
            if node.op == "output":
                continue
            key = self.key(node)
            if key in self.values:
                node_meta.set_sharding(node, self._sharding(key))
            elif isinstance(node.meta.get("val"), (tuple, list)):
                node_meta.set_sharding(
                    node,
                    tuple(
                        self._sharding((node, i)) if (node, i) in self.values else None
                        for i in range(len(node.meta["val"]))
                    ),
                )


def _region_view(
    v: ValueState, dims: list[tuple[str, ...]], partial: tuple[str, ...]
) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """A proposal as a value at a partially manual region can take it: without the region's
    manual axes inside the body, with the spec's manual axes first on its boundary.

    Example: ``[("m", "d"), ()]`` for a body value banned from ``m`` is ``[("d",), ()]``.
    """
    drop = set(v.banned) | {a for p in v.prefix or () for a in p}
    dims = [tuple(a for a in d if a not in drop) for d in dims]
    if v.prefix is not None:
        dims = [p + d for p, d in zip(v.prefix, dims, strict=True)]
    return dims, tuple(a for a in partial if a not in drop)


def _find_mesh(gm: fx.GraphModule) -> Mesh | None:
    for node in gm.graph.nodes:
        ann = node_meta.annotation(node)
        if ann is not None:
            return ann.sharding.mesh
    return None


def propagate(
    gm: fx.GraphModule,
    mesh: Mesh | None = None,
    *,
    replicate_unsupported: bool = False,
    pinned: Sequence[Sharding | None] = (),
) -> fx.GraphModule:
    """Infer a Sharding for every value of a captured program, in place.

    Args:
        gm: a captured program (``partita.capture.trace(...).graph_module``): aten ops with
            ``node.meta["val"]`` and annotation nodes with their ``node_meta.annotation``.
        mesh: the mesh; defaults to the mesh of the program's annotations.
        replicate_unsupported: run ops without a sharding rule on whole (gathered) tensors
            instead of raising :class:`~partita.errors.UnsupportedOpError`.
        pinned: the fixed sharding of each tensor input, in order (a control-flow body's,
            ``propagate.bodies``); None or missing: propagated like any value.

    Returns ``gm`` with every node's ``node_meta.sharding`` and ``node_meta.factor_axes`` set.

    Example:
        >>> prog = partita.capture.trace(fn, (x, w), in_specs=(P("data"), P()))  # doctest: +SKIP
        >>> propagate(prog.graph_module)                                         # doctest: +SKIP
    """
    mesh = mesh or _find_mesh(gm)
    if mesh is None:
        raise ShardingConflictError(
            "The program has no sharding annotation and no mesh was given, so there is nothing "
            "to propagate. Annotate at least one input (in_specs=...) or pass mesh=."
        )
    with gc_paused():  # the state built here lives until we return: see capture.gc_pause
        _Propagator(gm, mesh, replicate_unsupported, pinned).run()
        loops = [n for n in gm.graph.nodes if is_control_flow(n)]
        for _ in range(2 if loops else 0):
            # The bodies, then the program again with the ops' results fixed to what their
            # bodies give (propagate.bodies); twice, so that a loop fed by another loop's
            # results (a scan's backward) sees them.
            propagate_bodies(gm, mesh, _body_runner(replicate_unsupported))
            fixed = {n: node_meta.body_layout(n).results for n in loops}
            _Propagator(gm, mesh, replicate_unsupported, pinned, fixed).run()
        if loops:  # the layouts of the final operand shardings
            propagate_bodies(gm, mesh, _body_runner(replicate_unsupported))
    return gm


def _body_runner(replicate_unsupported: bool) -> RunBody:
    """Propagate a body with its inputs pinned; the shardings of its outputs."""

    def run(body: fx.GraphModule, inputs: Sequence[Sharding]) -> list[Sharding]:
        mesh = inputs[0].mesh
        propagate(body, mesh, replicate_unsupported=replicate_unsupported, pinned=inputs)
        outs = pytree.tree_leaves(body.graph.output_node().args[0])
        return [node_meta.value_sharding(o) for o in outs if isinstance(o, fx.Node)]

    return run


def shardings(gm: fx.GraphModule) -> dict[str, Any]:
    """``{node name: sharding}`` for every node that has one (a convenience for tests)."""
    found = ((n.name, node_meta.sharding(n)) for n in gm.graph.nodes)
    return {name: s for name, s in found if s is not None}
