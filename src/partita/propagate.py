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
   factor of an op. Factors claim axes in order of best priority, then *support* (the total
   size of the tensors proposing exactly the winning axes), then first appearance; a factor
   keeps the prefix of its axes up to the first axis already taken. (This is what makes a
   gradient matmul under FSDP reduce over the batch axis and reduce-scatter into the
   parameter's sharding, and what makes T19 gather the smaller operand.) Two groups claim
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

This module does not insert collectives or decide how to reshard; that is ``partita.partition``.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from partita.errors import (
    CompilerError,
    PartitaError,
    ReplicatedOpWarning,
    ShardingConflictError,
    UnsupportedOpError,
)
from partita.layout import check_strided
from partita.mesh import Mesh
from partita.rules import FactorKind, FactorRule, OpInfo, TensorMeta, get_rule
from partita.rules.opinfo import _is_tensor, op_info, replicate_rule, source_of
from partita.spec import Sharding

__all__ = ["apply_rule", "compiler_error", "op_info", "propagate", "source_of"]

ValueKey = tuple[fx.Node, int | None]  # (producer, output index or None for one output)

#: Handlers of table lookups whose reduction factor (the table's rows) is *weak*: it keeps a
#: mesh axis only when the lookup's index dims do not want it (invariant 5).
_LOOKUP_HANDLERS = ("masked_embedding",)


@dataclass(slots=True)
class _Value:
    """The mutable propagation state of one tensor value."""

    ndim: int
    numel: int
    dims: list[tuple[str, ...]] | None = None  # None: nothing known yet
    partial: tuple[str, ...] = ()
    reduce_op: str = "sum"
    priority: int = 1 << 30
    fixed: bool = False


@dataclass(slots=True)
class _Op:
    node: fx.Node
    rule: FactorRule
    operands: list[ValueKey | None]  # aligned with rule.operands
    results: list[ValueKey | None]  # aligned with rule.results
    compound: frozenset[str] = field(default_factory=frozenset)
    free: tuple[str, ...] = ()  # pass-through factors on every tensor: targets of invariant 9
    result_only: frozenset[str] = field(default_factory=frozenset)  # in no operand
    weak: frozenset[str] = field(default_factory=frozenset)  # claim axes after the others


def _is_annotation(node: fx.Node) -> bool:
    return "annotation" in node.meta


def compiler_error(node: fx.Node, stage: str, e: BaseException) -> CompilerError:
    """The CompilerError for an unexpected exception ``e`` while ``stage`` handled ``node``:
    what failed (op, node, source line), the operand shapes, and what to do."""
    shapes = [
        f"{a.name}: {tuple(a.meta['val'].shape)} {a.meta['val'].dtype}"
        for a in node.all_input_nodes
        if _is_tensor(a.meta.get("val"))
    ]
    first = (str(e).strip().splitlines() or [""])[0]
    return CompilerError(
        f"{stage} failed on {node.target} at node {node.name} "
        f"({source_of(node) or 'source line unknown'}), operands [{', '.join(shapes)}]: "
        f"{type(e).__name__}: {first}. This is a bug in partita, not in your program; please "
        f"report it. To get past it now, annotate around the op (mark its inputs and output "
        f"replicated with partita.mark_sharding(t, mesh, P())) or pass "
        f"replicate_unsupported=True."
    )


def apply_rule(node: fx.Node, info: OpInfo, *, replicate_unsupported: bool) -> FactorRule:
    """The FactorRule of ``node`` (whose arguments ``info`` describes) from the registry.

    Every failure is a partita error: an op without a rule, or a rule that raises on these
    arguments (whatever it raises), is an :class:`UnsupportedOpError` that names the op, the
    node and the source line; under ``replicate_unsupported=True`` both get the replicate rule
    instead (a rule that raised also warns with :class:`ReplicatedOpWarning`), and
    ``node.meta["replicated_reason"]`` says why, for the Plan.
    """
    fn = get_rule(node.target)
    where = f"node {node.name} ({source_of(node) or 'source line unknown'})"
    if fn is None:
        if replicate_unsupported:
            return _replicated(node, info, "it has no sharding rule")
        raise UnsupportedOpError(
            f"No sharding rule for {node.target} at {where}. partita does not know how "
            f"this op behaves when its inputs are split across devices. Two ways forward: "
            f"(1) annotate around it — mark its inputs and output replicated with "
            f"partita.mark_sharding(t, mesh, P()) so the op runs on whole tensors; "
            f"(2) opt in to replicating every op without a rule with "
            f"replicate_unsupported=True (correct, but it gathers the inputs)."
        )
    try:
        return fn(info)
    except PartitaError as e:
        if not isinstance(e, UnsupportedOpError):
            raise
        cause: Exception = e
    except Exception as e:  # a rule that cannot handle these arguments, whatever it raises
        cause = e
    why = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    if replicate_unsupported:
        warnings.warn(
            ReplicatedOpWarning(
                f"{node.target} at {where} runs on gathered (replicated) inputs: its "
                f"sharding rule cannot handle this call ({why}). The Plan records the "
                f"gathers with this reason."
            ),
            stacklevel=2,
        )
        return _replicated(node, info, f"its sharding rule raised {why}")
    raise UnsupportedOpError(
        f"The sharding rule of {node.target} cannot handle the call at {where} "
        f"(operands {[m.shape for m in info.operands]}): {why}. Two ways forward: annotate "
        f"around it (mark its inputs and output replicated with "
        f"partita.mark_sharding(t, mesh, P())), or pass replicate_unsupported=True; if the "
        f"call is valid PyTorch, please report it."
    ) from cause


def _replicated(node: fx.Node, info: OpInfo, reason: str) -> FactorRule:
    """The replicate rule, with the reason the partitioner records for its gathers."""
    node.meta["replicated_reason"] = reason
    return replicate_rule(info)


class _Propagator:
    def __init__(self, gm: fx.GraphModule, mesh: Mesh, replicate_unsupported: bool) -> None:
        self.gm = gm
        self.mesh = mesh
        self.values: dict[ValueKey, _Value] = {}
        self.ops: list[_Op] = []
        self.users: dict[ValueKey, list[int]] = {}  # value -> indices of ops touching it
        self.alias: dict[fx.Node, ValueKey] = {}
        self.replicate_unsupported = replicate_unsupported
        self._metas: dict[fx.Node, TensorMeta] = {}
        self._build()

    # --- set-up ----------------------------------------------------------------------------

    def key(self, node: fx.Node) -> ValueKey:
        return self.alias.get(node, (node, None))

    def _add_value(self, key: ValueKey, val: Any) -> None:
        self.values[key] = _Value(val.ndim, max(int(val.numel()), 1))

    def _build(self) -> None:
        import operator

        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                if _is_tensor(val):
                    n_in = sum(1 for k in self.values if k[0].op == "placeholder")
                    check_strided(val, f"Input tensor {n_in} ({node.name}) of the program")
                    self._add_value((node, None), val)
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), (tuple, list)):
                    self.alias[node] = (src, int(idx))
            elif node.op == "call_function":
                try:
                    self._add_op(node)
                except PartitaError:
                    raise
                except Exception as e:
                    raise compiler_error(node, "Propagation", e) from e
        for i, op in enumerate(self.ops):
            for k in (*op.operands, *op.results):
                if k is not None:
                    self.users.setdefault(k, []).append(i)

    def _add_op(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if not any(_is_tensor(v) for v in vals):
            return
        info, operand_nodes, indices = op_info(node, self._metas)
        rule = self._rule(node, info)
        results: list[ValueKey | None] = []
        for idx, v in zip(indices, vals, strict=True):
            if _is_tensor(v):
                self._add_value((node, idx), v)
                results.append((node, idx))
            else:
                results.append(None)
        operands: list[ValueKey | None] = [self.key(n) for n in operand_nodes]
        if len(rule.operands) != len(operands) or len(rule.results) != len(results):
            raise UnsupportedOpError(
                f"The sharding rule of {node.target} describes {len(rule.operands)} operands and "
                f"{len(rule.results)} results, but node {node.name} has {len(operands)} and "
                f"{len(results)}. This is a bug in the rule; please report it."
            )
        compound = frozenset(
            f for t in (*rule.operands, *rule.results) for d in t or () if len(d) > 1 for f in d
        )
        tensors = [t for t in (*rule.operands, *rule.results) if t is not None]
        free = tuple(
            f
            for f in rule.factors
            if rule.kind(f) is FactorKind.PASS_THROUGH
            and f not in compound
            and rule.sizes[f] > 1
            and tensors
            and all(any(f in d for d in t) for t in tensors)
        )
        in_operands = {f for t in rule.operands for d in t or () for f in d}
        result_only = frozenset(f for f in rule.factors if f not in in_operands and rule.operands)
        weak = (
            frozenset(rule.reduction_factors) if rule.handler in _LOOKUP_HANDLERS else frozenset()
        )
        self.ops.append(_Op(node, rule, operands, results, compound, free, result_only, weak))
        if _is_annotation(node):
            ann = node.meta["annotation"]
            if ann.sharding.mesh != self.mesh:
                raise ShardingConflictError(
                    f"Annotation {node.name} ({source_of(node) or 'unknown source'}) uses "
                    f"{ann.sharding.mesh!r}, but the program is sharded over {self.mesh!r}. "
                    f"All annotations of one program must use the same mesh."
                )
            v = self.values[(node, None)]
            v.dims = list(ann.sharding.dim_axes)
            v.priority = int(ann.priority)
            v.fixed = True

    def _rule(self, node: fx.Node, info: OpInfo) -> FactorRule:
        return apply_rule(node, info, replicate_unsupported=self.replicate_unsupported)

    # --- one op ----------------------------------------------------------------------------

    def _split(
        self, axes: Sequence[str], dim: tuple[str, ...], sizes: Any
    ) -> dict[str, tuple[str, ...]]:
        """Distribute a dim's mesh axes over its factors, major first (invariant 6)."""
        if len(dim) == 1:
            return {dim[0]: tuple(axes)}
        out: dict[str, tuple[str, ...]] = {}
        i, used = 0, 1
        for a in axes:
            n = self.mesh.axis_size(a)
            while i < len(dim) and used == sizes[dim[i]]:
                i, used = i + 1, 1
            if i == len(dim) or sizes[dim[i]] % (used * n):
                break
            out[dim[i]] = (*out.get(dim[i], ()), a)
            used *= n
        return out

    def _merge(
        self, dim: tuple[str, ...], assign: dict[str, tuple[str, ...]], sizes: Any
    ) -> tuple[str, ...]:
        axes: list[str] = []
        for f in dim:
            fa = assign.get(f, ())
            axes.extend(fa)
            if self.mesh.axes_size(fa) != sizes[f]:
                break
        return tuple(axes)

    def _assign(
        self, op: _Op, round_priority: int
    ) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
        rule = op.rule
        proposals: dict[str, list[tuple[int, int, int, tuple[str, ...]]]] = {}
        order = 0
        for factors, key in zip(
            (*rule.operands, *rule.results), (*op.operands, *op.results), strict=True
        ):
            order += 1
            if factors is None or key is None:
                continue
            v = self.values[key]
            if v.dims is None or v.priority > round_priority:
                continue
            for dim_axes, dim in zip(v.dims, factors, strict=True):
                if not dim_axes or not dim:
                    continue
                for f, fa in self._split(dim_axes, dim, rule.sizes).items():
                    if fa:
                        proposals.setdefault(f, []).append((v.priority, -v.numel, order, fa))
        best: list[tuple[int, int, int, str, tuple[str, ...]]] = []
        for rank, f in enumerate(rule.factors):
            props = proposals.get(f)
            if not props or rule.sizes[f] <= 1 or rule.kind(f) is FactorKind.NEED_REPLICATION:
                continue
            prio, _, _, axes = min(props)
            support = sum(-p[1] for p in props if p[3] == axes)
            best.append((prio, -support, rank, f, axes))
        assign: dict[str, tuple[str, ...]] = {}
        prio_of: dict[str, int] = {}
        taken: set[str] = set()
        ranked = sorted(best)
        # Factors the operands carry claim axes first, then need-replication axes move
        # (invariant 9), then factors only the results have (they are computed whole).
        late = op.result_only | op.weak
        self._claim(op, [b for b in ranked if b[3] not in late], assign, prio_of, taken)
        self._move_replicated_axes(op, proposals, assign, prio_of, taken)
        self._claim(op, [b for b in ranked if b[3] in op.weak], assign, prio_of, taken)
        self._claim(op, [b for b in ranked if b[3] in op.result_only], assign, prio_of, taken)
        return assign, prio_of

    def _claim(
        self,
        op: _Op,
        ranked: list[tuple[int, int, int, str, tuple[str, ...]]],
        assign: dict[str, tuple[str, ...]],
        prio_of: dict[str, int],
        taken: set[str],
    ) -> None:
        """Invariant 5: factors take their axes in rank order, up to the first taken axis."""
        rule = op.rule
        for prio, _, _, f, axes in ranked:
            keep: list[str] = []
            for a in axes:
                if a in taken:
                    break
                keep.append(a)
            if f in op.compound:
                while keep and rule.sizes[f] % self.mesh.axes_size(keep):
                    keep.pop()
            if keep:
                assign[f] = tuple(keep)
                prio_of[f] = prio
                taken.update(keep)

    def _move_replicated_axes(
        self,
        op: _Op,
        proposals: dict[str, list[tuple[int, int, int, tuple[str, ...]]]],
        assign: dict[str, tuple[str, ...]],
        prio_of: dict[str, int],
        taken: set[str],
    ) -> None:
        """Invariant 9: axes proposed for a need-replication factor move to a free factor."""
        rule = op.rule
        for f in rule.factors:
            props = proposals.get(f)
            if not props or rule.kind(f) is not FactorKind.NEED_REPLICATION:
                continue
            prio, _, _, axes = min(props)
            keep: list[str] = []
            for a in axes:
                if a in taken:
                    break
                keep.append(a)
            if not keep:
                continue
            n = self.mesh.axes_size(keep)
            for g in op.free:
                if g not in assign and rule.sizes[g] % n == 0:
                    assign[g] = tuple(keep)
                    prio_of[g] = prio
                    taken.update(keep)
                    break

    def _visit(self, op: _Op, round_priority: int) -> list[ValueKey]:
        assign, prio_of = self._assign(op, round_priority)
        rule = op.rule
        changed: list[ValueKey] = []
        for is_result, factors_list, keys in (
            (False, rule.operands, op.operands),
            (True, rule.results, op.results),
        ):
            for j, (factors, key) in enumerate(zip(factors_list, keys, strict=True)):
                if factors is None or key is None:
                    continue
                dims = [self._merge(d, assign, rule.sizes) if d else () for d in factors]
                used = {f for d in factors for f in d if assign.get(f)}
                partial: tuple[str, ...] = ()
                if is_result:
                    summed = [f for f in rule.partial_factors(j) if assign.get(f)]
                    used.update(summed)
                    axes = {a for f in summed for a in assign[f]}
                    partial = tuple(a for a in self.mesh.axis_names if a in axes)
                prio = min((prio_of[f] for f in used), default=round_priority)
                if self._refine(key, dims, partial, rule.reduce_op, prio):
                    changed.append(key)
        return changed

    def _refine(
        self,
        key: ValueKey,
        dims: list[tuple[str, ...]],
        partial: tuple[str, ...],
        reduce_op: str,
        prio: int,
    ) -> bool:
        v = self.values[key]
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
        priorities = sorted({v.priority for v in self.values.values() if v.fixed}) or [0]
        for p in priorities:
            for only_pass_through in (True, False):
                self._fixpoint(p, only_pass_through)
        self._write_meta(priorities[-1])

    def _fixpoint(self, round_priority: int, only_pass_through: bool) -> None:
        eligible = [
            i for i, op in enumerate(self.ops) if not only_pass_through or op.rule.is_pass_through
        ]
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

    def _visit_checked(self, op: _Op, round_priority: int) -> list[ValueKey]:
        try:
            return self._visit(op, round_priority)
        except PartitaError:
            raise
        except Exception as e:
            raise compiler_error(op.node, "Propagation", e) from e

    def _sharding(self, key: ValueKey) -> Sharding:
        v = self.values[key]
        dims = v.dims if v.dims is not None else [()] * v.ndim
        return Sharding(self.mesh, tuple(dims), v.partial, v.reduce_op)

    def _write_meta(self, last_priority: int) -> None:
        for op in self.ops:
            assign, _ = self._assign(op, last_priority)
            op.node.meta["factor_axes"] = assign
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
    _Propagator(gm, mesh, replicate_unsupported).run()
    return gm


def shardings(gm: fx.GraphModule) -> dict[str, Any]:
    """``{node name: sharding}`` for every node that has one (a convenience for tests)."""
    return {n.name: n.meta["sharding"] for n in gm.graph.nodes if "sharding" in n.meta}
