"""Sharding propagation: give every value of a captured program a Sharding before anything runs.

The algorithm is written once, over :class:`~partita.rules.factor.FactorRule` s (Shardy-style):
for one op, every tensor that carries a factor *proposes* the mesh axes its dim gives that
factor; the op picks one assignment of mesh axes to factors; the assignment is written back to
every tensor of the op — forward into results and backward into operands alike. A worklist
repeats this to a fixpoint.

Invariants and conflict resolution (in the order they apply):

1. **User annotations are never overwritten.** The result of an annotation node is fixed to the
   user's sharding. Annotations carry a priority (0 by default; lower numbers win).
2. **Priority rounds.** Propagation runs one round per annotation priority present, lowest
   first; in round ``p`` only values derived from annotations of priority ``<= p`` propose.
   A value derived from several annotations carries the best priority among them.
3. **Pass-through ops first.** Each round first runs to a fixpoint over ops whose rule passes
   every dim through unchanged (elementwise on equal shapes, casts, transposes, annotations),
   then over all ops. So an annotation reaches its neighbours before broadcasts, matmuls and
   reshapes have to choose.
4. **Choosing one factor's axes.** Among the proposals for a factor, the best priority wins,
   then the larger tensor, then the earlier tensor (operands in order, then results).
   Need-replication and size-1 factors get no axes.
5. **Choosing between factors that want the same mesh axis.** A mesh axis shards at most one
   factor of an op. Factors claim axes in order of best priority, then *activation first*
   (a factor some computed operand proposes beats one that only *stored* values, the
   program's inputs and their views, casts and annotations, or the results propose), then
   *support* (the total size of the tensors proposing exactly the winning axes), then first
   appearance; a factor keeps the prefix of its axes up to the first axis already taken.
   Activation first is FSDP's rule, "parameters are gathered, activations stay batch-split":
   a parameter's spec says how it is stored between steps, so when a weight split over
   ``data`` meets a batch-split activation the batch keeps ``data`` and the weight is
   gathered, however large the weight (GSPMD and Shardy also keep the data-parallel axis on
   the batch; by size alone a vocabulary-sized head weight would split the logits'
   vocabulary and the loss would move them back). Support is what makes a gradient matmul
   under FSDP reduce over the batch axis and reduce-scatter into the parameter's sharding,
   and what makes T19 (program inputs only) gather the smaller operand. Two groups claim
   late: the rows of a table lookup (an embedding's vocabulary: under FSDP the lookup follows
   the batch of its indices and the table is gathered, rather than the batch being gathered
   for a masked lookup), and factors only the results have (they are computed whole).
6. **Compound dims** (reshape): axes go to the major factor while their product divides its
   size; the minor factor gets axes only once the major factor is fully split. A factor that
   appears in a compound dim anywhere keeps only the prefix of axes whose product divides its
   size. A tensor that cannot express the op's assignment keeps what it has (the partitioner
   reshards it).
7. **Only refinement.** A value's sharding only ever becomes more specific: each dim's axes may
   grow at the end, and a result may become partial over the axes of the op's sharded
   reduction factors if it was not partial before. Anything else is left as is and becomes a
   reshard for the partitioner. This also guarantees termination.
8. **Need-replication axes move, not vanish.** Mesh axes proposed for a factor that cannot be
   split (a sort dim, a concat dim) go to a free pass-through factor that every tensor of the op
   has (the first whose size they divide), so the partitioner moves the split to another dim
   with an all_to_all instead of gathering (XLA does the same for T21 and T25).
9. **Determinism.** Ops are visited in graph order, the worklist is FIFO without duplicates.

Values nobody proposes anything for end up replicated. The result is ``node.meta["sharding"]``
(a :class:`~partita.spec.Sharding`, or a tuple of them, with ``None`` for non-tensor outputs, on
multi-output nodes) and ``node.meta["factor_axes"]`` (the op's chosen ``{factor: mesh axes}``).

This module holds the worklist and the public entry point; the per-value and per-op state is
built in ``propagate_state``, one op's assignment is chosen in ``propagate_assign`` (invariants
4 to 8), and rules are looked up in ``propagate_rules``. It does not insert collectives or
decide how to reshard; that is ``partita.partition``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, cast

import torch.fx as fx

from partita.capture.gc_pause import gc_paused
from partita.errors import InternalError, PartitaError, ShardingConflictError
from partita.mesh import Mesh
from partita.propagate_assign import choose_assignment, merge_axes
from partita.propagate_rules import apply_rule, compiler_error
from partita.propagate_state import OpState, ProgramState, ValueKey, ValueState
from partita.rules.opinfo import op_info, source_of
from partita.spec import Sharding

__all__ = ["apply_rule", "compiler_error", "op_info", "propagate", "source_of"]


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
        self._write_meta(priorities[-1])

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
            op.node.meta["factor_axes"] = dict(assign)  # memoised assignments are shared
            op.node.meta["rule"] = op.rule
        for node in self.gm.graph.nodes:
            if node.op == "output":
                continue
            key = self.key(node)
            if key in self.values:
                node.meta["sharding"] = self._sharding(key)
            elif isinstance(node.meta.get("val"), (tuple, list)):
                node.meta["sharding"] = tuple(
                    self._sharding((node, i)) if (node, i) in self.values else None
                    for i in range(len(node.meta["val"]))
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
        ann = node.meta.get("annotation")
        if ann is not None:
            return ann.sharding.mesh
    return None


def propagate(
    gm: fx.GraphModule,
    mesh: Mesh | None = None,
    *,
    replicate_unsupported: bool = False,
) -> fx.GraphModule:
    """Infer a Sharding for every value of a captured program, in place.

    Args:
        gm: a captured program (``partita.capture.trace(...).graph_module``): aten ops with
            ``node.meta["val"]`` and annotation nodes with ``node.meta["annotation"]``.
        mesh: the mesh; defaults to the mesh of the program's annotations.
        replicate_unsupported: run ops without a sharding rule on whole (gathered) tensors
            instead of raising :class:`~partita.errors.UnsupportedOpError`.

    Returns ``gm`` with ``node.meta["sharding"]`` and ``node.meta["factor_axes"]`` set.

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
        _Propagator(gm, mesh, replicate_unsupported).run()
    return gm


def shardings(gm: fx.GraphModule) -> dict[str, Any]:
    """``{node name: sharding}`` for every node that has one (a convenience for tests)."""
    return {n.name: n.meta["sharding"] for n in gm.graph.nodes if "sharding" in n.meta}
