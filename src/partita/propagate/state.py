"""The propagation state of one program: a mutable record per tensor value and per op.

:class:`ProgramState` reads a captured GraphModule once: every tensor value (a placeholder or
an op result; ``getitem`` nodes are aliases of a multi-output op's results) gets a
:class:`ValueState`, every op an :class:`OpState` with its FactorRule (``apply_rule``) and the
factor groups the assignment treats specially (compound, free, result-only, weak). User
annotations fix their value's sharding and priority here (invariant 1 of
``partita.propagate``).

This module does not choose shardings (``propagate.assign``) or iterate (``propagate``).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx

from partita.capture.manual import ENTER_OP, EXIT_OP, boundary, is_fully_manual, local_nodes
from partita.errors import InternalError, PartitaError, ShardingConflictError, UnsupportedOpError
from partita.ir import node_meta
from partita.propagate.call_key import call_key, info_key
from partita.propagate.copies import Copies
from partita.propagate.rules import apply_rule, compiler_error
from partita.rules import FactorKind, FactorRule, OpInfo, TensorMeta
from partita.rules.handler_names import HandlerName
from partita.rules.manual import manual_rule
from partita.rules.opinfo import is_tensor, op_info, source_of
from partita.values.layout import check_strided
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["OpState", "ProgramState", "ValueKey", "ValueState", "call_key", "info_key"]

ValueKey = tuple[fx.Node, int | None]  # (producer, output index or None for one output)

#: Handlers of table lookups whose reduction factor (the table's rows) is *weak*: it keeps a
#: mesh axis only when the lookup's index dims do not want it (invariant 5).
_LOOKUP_HANDLERS = (HandlerName.MASKED_EMBEDDING.value,)


@dataclass(slots=True)
class ValueState:
    """The mutable propagation state of one tensor value."""

    ndim: int
    numel: int
    dims: list[tuple[str, ...]] | None = None  # None: nothing known yet
    partial: tuple[str, ...] = ()
    reduce_op: str = "sum"
    priority: int = 1 << 30
    fixed: bool = False
    stored: bool = False  # a program input, or a view or cast of one (_mark_stored)
    # Partially manual regions: a body value never takes its region's manual axes (banned); a
    # value crossing the region's boundary keeps its spec's manual axes first on each dim.
    banned: frozenset[str] = frozenset()
    prefix: list[tuple[str, ...]] | None = None
    version: int = 0  # bumped by every refinement (an op's visit is skipped if none of its moved)


@dataclass(slots=True)
class OpState:
    node: fx.Node
    rule: FactorRule
    operands: list[ValueKey | None]  # aligned with rule.operands
    results: list[ValueKey | None]  # aligned with rule.results
    compound: frozenset[str] = field(default_factory=frozenset)
    free: tuple[str, ...] = ()  # pass-through factors on every tensor: targets of invariant 9
    result_only: frozenset[str] = field(default_factory=frozenset)  # in no operand
    weak: frozenset[str] = field(default_factory=frozenset)  # claim axes after the others
    pass_through: bool = False  # rule.is_pass_through, computed once per rule
    # (round priority, versions of its values) of its last visit that changed nothing, and the
    # assignment that visit chose: the same state gives the same (no-op) visit again.
    settled: tuple[Any, ...] | None = None
    settled_assign: dict[str, tuple[str, ...]] | None = None


def _is_annotation(node: fx.Node) -> bool:
    return node_meta.annotation(node) is not None


def _keeps_the_data(op: OpState) -> bool:
    """An annotation, a view (transpose, detach...) or a copy/cast (``OpFacts.keeps_data``):
    its result is its operand's data, so a program input stays *stored* through it
    (``ProgramState._mark_stored``)."""
    node = op.node
    return (
        _is_annotation(node)
        or op.rule.facts.keeps_data
        or bool(getattr(node.target, "is_view", False))
    )


class ProgramState:
    """Every value's and op's propagation state for one program (built once, then refined)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: Mesh,
        replicate_unsupported: bool,
        pinned: Sequence[Sharding | None] = (),
        fixed_results: dict[fx.Node, tuple[Sharding, ...]] | None = None,
        mark_stored: bool = True,
    ) -> None:
        self.gm = gm
        self.pinned = list(pinned)  # a body's inputs: fixed to the loop's operands' shardings
        self.fixed_results = fixed_results or {}  # control-flow ops': what their bodies give
        self.mesh = mesh
        self.values: dict[ValueKey, ValueState] = {}
        self.ops: list[OpState] = []
        self._users: dict[ValueKey, list[int]] | None = None  # built on first use (users)
        self.alias: dict[fx.Node, ValueKey] = {}
        #: the values fixed as the state was built (annotations, pins, control-flow results,
        #: a fully manual region's exits): those with ``ValueState.fixed`` set by ``_build``
        self.fixed: set[ValueKey] = set()
        self.replicate_unsupported = replicate_unsupported
        self._metas: dict[fx.Node, TensorMeta] = {}
        self._shapes: dict[Hashable, _OpShape] = {}  # _op_shape's memo
        self._seen: dict[Any, Any] = {}  # call_key's memo (per node argument and value)
        #: (ndim, numel) per value object (``id``): the copies of a layer share theirs
        self._sizes: dict[int, tuple[int, int]] = {}
        self.copies = Copies()  # a layer copy's rule from its template copy's (by part node)
        self._build(mark_stored)

    def key(self, node: fx.Node) -> ValueKey:
        return self.alias.get(node, (node, None))

    def _add_value(self, key: ValueKey, val: Any) -> None:
        sizes = self._sizes.get(id(val))
        if sizes is None:
            sizes = self._sizes[id(val)] = (val.ndim, max(int(val.numel()), 1))
        self.values[key] = ValueState(*sizes)

    def _build(self, mark_stored: bool) -> None:
        local = local_nodes(self.gm)
        # Fully manual shard_map bodies are per-device code: not propagated, copied verbatim.
        verbatim = {n for n, a in local.items() if is_fully_manual(a, self.mesh.axis_names)}
        self._local = local
        n_in = 0  # tensor inputs so far (for messages)
        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            if verbatim and node in verbatim:
                continue
            if node.op == "call_function" and node.target is EXIT_OP and node.args[0] in verbatim:
                self._add_value((node, None), val)
                v = self.values[(node, None)]
                v.dims, v.priority, v.fixed = (
                    list(boundary(node.args[1]).sharding.dim_axes),
                    0,
                    True,
                )
                self.fixed.add((node, None))
            elif node.op == "placeholder":
                if is_tensor(val):
                    check_strided(val, f"Input tensor {n_in} ({node.name}) of the program")
                    n_in += 1
                    self._add_value((node, None), val)
                    self.values[(node, None)].stored = True
                    pin = self.pinned[n_in - 1] if n_in <= len(self.pinned) else None
                    if pin is not None:
                        v = self.values[(node, None)]
                        v.dims, v.priority, v.fixed = list(pin.dim_axes), 0, True
                        self.fixed.add((node, None))
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), (tuple, list)):
                    self.alias[node] = (src, int(idx))
            elif node.op == "call_function":
                try:
                    self._add_op(node)
                except Exception as e:
                    if isinstance(e, PartitaError) and not isinstance(e, InternalError):
                        raise
                    raise compiler_error(node, "Propagation", e) from e
        # keyed by ids of the values: valid while this walk holds them, not after
        self._seen.clear()
        self._sizes.clear()
        self.copies.clear()
        if mark_stored:  # the auto build reads no ``stored`` flag: it skips this walk
            self._mark_stored()

    @property
    def users(self) -> dict[ValueKey, list[int]]:
        """Value -> indices of the ops touching it (propagation's, not the auto build's: made
        on first use)."""
        if self._users is None:
            users: dict[ValueKey, list[int]] = {}
            for i, op in enumerate(self.ops):
                for k in (*op.operands, *op.results):
                    if k is not None:
                        users.setdefault(k, []).append(i)
            self._users = users
        return self._users

    def _mark_stored(self) -> None:
        """Mark the program's inputs, and their views, casts and annotations, as *stored*
        (``ValueState.stored``).

        A stored value's sharding says how it is kept between steps (an FSDP parameter split
        over ``data``), not how the work on it is split; invariant 5 of ``partita.propagate``
        lets a computed operand's factor claim a mesh axis before it. Ops are in graph order,
        so one pass sees every operand before its users."""
        values = self.values
        for op in self.ops:
            if not op.pass_through:  # tested first: the cheapest
                continue
            keys = [k for k in op.operands if k is not None]
            # then the operands (most of an update's ops read a gradient), then the op
            if not keys or not all(values[k].stored for k in keys) or not _keeps_the_data(op):
                continue
            for k in op.results:
                if k is not None:
                    values[k].stored = True

    def _add_op(self, node: fx.Node) -> None:
        # one call per op of a deep program: tests inlined (isinstance, dict look-ups)
        val: Any = node.meta.get("val")
        single = not isinstance(val, (tuple, list))
        if single and not isinstance(val, torch.Tensor):
            return
        if not single and not any(isinstance(v, torch.Tensor) for v in val):
            return
        shape, operand_nodes = self._op_shape(node)
        rule, compound, free, result_only, weak, pass_through = shape
        results: list[ValueKey | None] = []
        if single:
            self._add_value((node, None), val)
            results.append((node, None))
        else:
            for idx, v in enumerate(val):
                if isinstance(v, torch.Tensor):
                    self._add_value((node, idx), v)
                    results.append((node, idx))
                else:
                    results.append(None)
        if self.fixed_results:
            for rkey, s in zip(results, self.fixed_results.get(node, ()), strict=False):
                if rkey is not None:
                    v = self.values[rkey]
                    v.dims, v.priority, v.fixed = list(s.dim_axes), 0, True
                    self.fixed.add(rkey)
        alias = self.alias
        operands: list[ValueKey | None] = [alias.get(n, (n, None)) for n in operand_nodes]
        if len(rule.operands) != len(operands) or len(rule.results) != len(results):
            raise UnsupportedOpError(
                f"The sharding rule of {node.target} describes {len(rule.operands)} operands and "
                f"{len(rule.results)} results, but node {node.name} has {len(operands)} and "
                f"{len(results)}. This is a bug in the rule; please report it."
            )
        self.ops.append(
            OpState(node, rule, operands, results, compound, free, result_only, weak, pass_through)
        )
        if (self._local and node in self._local) or node.target is EXIT_OP:
            self._mark_region_values(node)
        ann = node_meta.annotation(node)
        if ann is not None:
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
            self.fixed.add((node, None))

    def _op_shape(self, node: fx.Node) -> tuple[_OpShape, list[fx.Node]]:
        """The op's rule and its factor groups, computed once per distinct call, and its
        tensor operand nodes (flattened order).

        A rule function sees only its OpInfo, so calls with equal OpInfos (every layer of a
        transformer repeats the same ops on the same shapes) get the same rule. Memoised per
        program, and only when the registry's rule answered (a replicated fallback records a
        reason on its node and warns, which every node must do for itself). The memo's key
        (``call_key``, equal to ``info_key`` of the OpInfo) is read off the node in one walk,
        so a repeated call builds no OpInfo: a deeper model adds look-ups, not rule inputs."""
        key = None
        if not (self._local and node in self._local) and node.target is not EXIT_OP:
            mapped = self.copies.find(node)  # a layer copy: its template's (propagate.copies)
            if mapped is not None:
                return mapped
            operand_nodes: list[fx.Node] = []
            key = call_key(node, self._metas, operand_nodes, self._seen)
            found = self._shapes.get(key) if key is not None else None
            if found is not None:
                self.copies.add(node, found, operand_nodes)
                return found, operand_nodes
        info, operand_nodes, _ = op_info(node, self._metas)
        rule = self._rule(node, info)
        shape = _op_groups(rule)
        if key is not None and node_meta.replicated_reason(node) is None:
            self._shapes[key] = shape
            self.copies.add(node, shape, operand_nodes)
        return shape, operand_nodes

    def _rule(self, node: fx.Node, info: OpInfo) -> FactorRule:
        if node in self._local or node.target is EXIT_OP:
            rule = manual_rule(info)
            if rule is not None:
                return rule
            # A body op without a rule runs whole over the auto axes: the region promised it
            # to the user as per-device code, so it must not fail for lack of a rule.
            return apply_rule(node, info, replicate_unsupported=True)
        return apply_rule(node, info, replicate_unsupported=self.replicate_unsupported)

    def _mark_region_values(self, node: fx.Node) -> None:
        """Ban a partially manual body's values from its manual axes; give the global side of
        each boundary its spec's manual axes as a fixed prefix."""
        if node in self._local:
            banned = frozenset(self._local[node])
            for key, v in self.values.items():
                if key[0] is node:
                    v.banned = banned
        if node.target in (ENTER_OP, EXIT_OP):
            b = boundary(cast(int, node.args[1]))  # enter/exit(x, boundary key)
            key = self.key(cast(fx.Node, node.args[0])) if node.target is ENTER_OP else (node, None)
            crossing = self.values.get(key)
            if crossing is not None:
                crossing.prefix = [
                    tuple(a for a in d if a in b.manual_axes) for d in b.sharding.dim_axes
                ]
                crossing.dims = list(crossing.prefix)


#: An op's rule and the factor groups propagation treats specially (see OpState).
_OpShape = tuple[FactorRule, frozenset[str], tuple[str, ...], frozenset[str], frozenset[str], bool]


def _op_groups(rule: FactorRule) -> _OpShape:
    """``rule`` with its compound, free, result-only and weak factors, and whether it passes
    every dim through (see OpState)."""
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
    weak = _weak_factors(rule)
    return rule, compound, free, result_only, weak, rule.is_pass_through


def _weak_factors(rule: FactorRule) -> frozenset[str]:
    """A table lookup's factors that claim mesh axes late (invariant 5): the rows it reduces
    and, when one operand alone carries those rows (the table of ``embedding``, not the
    gradient of its backward), every dim of that table. The lookup follows its indices: an
    FSDP table split over ``data`` along its columns is gathered, the batch keeps ``data``."""
    if rule.handler not in _LOOKUP_HANDLERS:
        return frozenset()
    rows = frozenset(rule.reduction_factors)
    holders = [t for t in rule.operands if t is not None and rows & {f for d in t for f in d}]
    if len(holders) != 1:
        return rows
    return rows | {f for d in holders[0] for f in d}
