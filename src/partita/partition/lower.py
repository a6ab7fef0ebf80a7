"""Lower a propagated program into one per-device program plus its Plan.

For each op, in program order (DESIGN.md, Partitioning):

1. The op's factor assignment (``node_meta.factor_axes(node)``, chosen by propagation) fixes the
   sharding each operand must have. It is first made *representable*: a minor factor of a
   compound dim keeps its axes only when the major factor is fully split, and factors whose
   lowering needs a handler this module does not have lose theirs (computed whole).
2. The reshard planner (``partition.reshard``) moves each operand there, inserting collectives.
3. Padding is masked with the reduction's identity on every operand dim that is reduced or
   contracted while sharded unevenly (``partition.masks``).
4. The op is emitted with local shapes (shape arguments localised); its result carries the
   pass-through axes as dims and the sharded reduction factors' axes as *partial*.
5. The result is resharded to the sharding propagation chose for the value (for example a
   partial result wanted sharded becomes a reduce_scatter), so that every value in the per-device
   program has exactly ``node_meta.sharding(node)``.

Special lowerings named by rules (``FactorRule.handler``) live in ``partition.handlers``, that
of a linear op on partial sums (kept partial, step 1 skipped) in ``partition.pending``; which
factor axes an op keeps (step 1) is ``partition.assignment``; resharding a value and recording
its collectives in the Plan (step 2) is ``partition.resharding``. This module is the per-op
driver and does not run anything.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, TypeGuard, cast

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from partita.capture.manual import ENTER_OP, EXIT_OP, is_fully_manual, local_nodes
from partita.errors import InternalError, PartitaError, UnsupportedOpError
from partita.ir import node_meta
from partita.partition import explicit, handlers, pending
from partita.partition import halo as _halo  # noqa: F401 - registers its handler
from partita.partition import manual as _manual
from partita.partition import special as _special  # noqa: F401 - registers its handlers
from partita.partition.assignment import check_same_dtype, dims_of, memo_by_rule, representable
from partita.partition.control_flow import lower_control_flow, output_to
from partita.partition.emit import Emitter, node_of
from partita.partition.local_args import localize_shape_args
from partita.partition.masks import identity_of
from partita.partition.origin import stamp_origin as _stamp_origin
from partita.partition.plan import Plan
from partita.partition.reasons import needs_why, partial_reason
from partita.partition.resharding import LocalValue, LocalValues, ValueKey
from partita.propagate.bodies import is_control_flow
from partita.propagate.rules import compiler_error
from partita.report.explain import op_name
from partita.rules import FactorRule
from partita.values.layout import local_shape
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["LocalValue", "Lowering"]


def _tensor_val(v: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(v, torch.Tensor)


class Lowering(LocalValues):
    """Builds the per-device graph for one propagated GraphModule (use :meth:`run` once)."""

    def __init__(
        self, gm: fx.GraphModule, mesh: Mesh, *, strict: bool = False, collectives: str = "auto"
    ) -> None:
        super().__init__(mesh, strict=strict)
        self.src = gm
        self.collectives = collectives  # partition.explicit's mode
        regions = local_nodes(gm)  # shard_map bodies
        self.local_nodes = {  # the fully manual ones, copied verbatim
            n for n, axes in regions.items() if is_fully_manual(axes, mesh.axis_names)
        }
        self.region_nodes = set(regions)
        self.manual: dict[fx.Node, fx.Node] = {}  # their local nodes
        self.moves: dict[int, explicit.Move] = {}  # collective index -> the reshard behind it
        self._shardings: dict[tuple[Any, ...], Sharding] = {}  # see sharding()
        self._memo: dict[tuple[Any, ...], Any] = {}  # see assignment.memo_by_rule
        self.bodies: dict[str, fx.GraphModule] = {}  # control-flow bodies, partitioned
        self.output_targets: tuple[Sharding, ...] | None = None  # a body's: control_flow

    # --- the driver ------------------------------------------------------------------------

    def run(self) -> tuple[fx.GraphModule, Plan]:
        for node in self.src.graph.nodes:
            last = next(reversed(self.graph.nodes), None)  # the last local node before this op's
            try:
                self._node(node)
                _stamp_origin(node, last.next if last is not None else None, self.graph)
            except Exception as e:  # anything but a user-facing error is partita's bug: say where
                if isinstance(e, PartitaError) and not isinstance(e, InternalError):
                    raise
                raise compiler_error(node, "Partitioning", e) from e
        for n in self.src.graph.nodes:
            if node_meta.sharding(n) is not None:
                self.plan.shardings[n.name] = node_meta.sharding(n)
        explicit.check(self.plan, self.moves, self.collectives)  # "explicit" / "warn"
        # Lazy: its Python code is generated only if it is run or printed (regathering and
        # bucketing edit the graph after this; the runtimes build their own GraphModules).
        root = torch.nn.Module()
        for name, body in self.bodies.items():
            root.add_module(name, body)
        return _LazyGraphModule(root, self.graph, class_name="PerDeviceProgram"), self.plan

    def reshard(self, key: ValueKey, dst: Sharding, why: str, at: fx.Node) -> fx.Node:
        """``LocalValues.reshard``, remembering which move made each new collective."""
        before = len(self.plan.collectives)
        src = self.values[key].sharding
        local = super().reshard(key, dst, why, at)
        name = key[0].name if key[1] is None else f"{key[0].name}[{key[1]}]"
        for i in range(before, len(self.plan.collectives)):
            self.moves[i] = explicit.Move(name, src, dst)
        return local

    def _node(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self._placeholder(node)
        elif node.op == "output":
            self._output(node)
        elif node in self.local_nodes:
            _manual.lower_local(self, node)
        elif node.op == "call_function" and node.target is EXIT_OP:
            if node.args[0] in self.local_nodes:
                _manual.lower_exit(self, node)
            else:
                _manual.lower_partial_exit(self, node)
        elif node.op == "call_function" and node.target is ENTER_OP:
            _manual.lower_partial_enter(self, node)
        elif node.op == "call_function" and node.target is operator.getitem:
            self._getitem(node)
        elif node.op == "call_function" and node_meta.annotation(node) is not None:
            self._annotation(node)
        elif is_control_flow(node):
            lower_control_flow(self, node, type(self))
        elif node.op == "call_function":
            self._op(node)
        elif node.op == "get_attr" and not isinstance(  # not a loop's body
            getattr(self.src, cast(str, node.target)), fx.GraphModule
        ):
            raise UnsupportedOpError(
                f"Constant {node.target} (node {node.name}) is not supported by the "
                f"partitioner: pass tensors as inputs instead of closing over them."
            )

    def _placeholder(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        local = self.graph.placeholder(node.name)
        if not _tensor_val(val):
            return
        sharding = node_meta.value_sharding(node)
        self.values[(node, None)] = LocalValue(local, sharding, tuple(val.shape), val.dtype)
        self.plan.input_shardings.append(sharding)

    def _getitem(self, node: fx.Node) -> None:
        src, idx = cast("tuple[fx.Node, int]", node.args)  # getitem(result, i)
        if (src, int(idx)) in self.values:
            self.alias[node] = (src, int(idx))

    def _annotation(self, node: fx.Node) -> None:
        ann = node_meta.annotation_of(node)
        operand = cast(fx.Node, node.args[0])  # annotate(x, ...)
        why = f"annotation {ann.source or node.name} asks for {ann.sharding}"
        local = self.reshard(self.key(operand), ann.sharding, why, node)
        v = self.value(operand)
        if local is v.node:  # nothing moved: the annotation is the same value (and copies)
            self.alias[node] = self.key(operand)
            return
        self.values[(node, None)] = LocalValue(local, ann.sharding, v.shape, v.dtype)

    def _output(self, node: fx.Node) -> None:
        if self.output_targets is not None:  # a control-flow body
            self.graph.output(output_to(self, node, self.output_targets))
            return
        outs = []
        for leaf in pytree.tree_leaves(node.args[0]):
            if not isinstance(leaf, fx.Node) or self.key(leaf) not in self.values:
                outs.append(leaf)
                continue
            key = self.key(leaf)
            v = self.values[key]
            if v.sharding.partial:  # outputs are never partial: reduce them here
                dst = v.sharding.with_partial(())
                local = self.reshard(key, dst, "a program output is reduced", node)
                v = LocalValue(local, dst, v.shape, v.dtype)
                self.values[key] = v
            outs.append(v.node)
            self.plan.output_shardings.append(v.sharding)
        self.graph.output(tuple(outs))

    # --- one op ----------------------------------------------------------------------------

    def representable(
        self, target: Any, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> dict[str, tuple[str, ...]]:
        """The axes of ``assign`` the op can be lowered with (``assignment.representable``)."""
        key = ("representable", target, *assign.items())
        compute = lambda: representable(self.mesh, target, rule, assign)  # noqa: E731
        return dict(memo_by_rule(self._memo, key, rule, compute))

    def dims_of(
        self, factors: tuple[tuple[str, ...], ...], assign: dict[str, tuple[str, ...]]
    ) -> tuple[tuple[str, ...], ...]:
        return dims_of(factors, assign)

    def _op(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if not any(_tensor_val(v) for v in vals):
            raise UnsupportedOpError(
                f"Node {node.name} ({op_name(node.target)}) produces no tensor; the partitioner "
                f"only handles tensor programs."
            )
        rule = node_meta.rule(node)
        assert rule is not None  # propagation gives every op its rule
        if pending.lower_partial_sum(self, node, rule):  # a sum of partial sums: reduced later
            return
        if rule.facts.same_dtype:
            check_same_dtype(node)
        assign = self.representable(node.target, rule, node_meta.factor_axes(node))
        handler = handlers.get(rule.handler)
        if handler is not None and handler.applies(self, node, rule, assign):
            results = handler.lower(self, node, rule, assign)
        else:
            results = self._generic(node, rule, assign)
        if node in self.region_nodes:  # a collective the user wrote: into the Plan, in order
            moved = rule.operands[0] if rule.facts.moves == "operand" else rule.results[0]
            split = Sharding(self.mesh, self.dims_of(moved or (), assign)) if moved else None
            _manual.record_user_collective(self, node, split)
        self._store_results(node, rule, assign, results)

    def operand_nodes(self, node: fx.Node) -> list[fx.Node]:
        """The op's tensor operands in argument order, repeats kept (``mul(x, x)``: twice)."""
        out: list[fx.Node] = []

        def visit(a: fx.Node) -> fx.Node:
            if _tensor_val(a.meta.get("val")):
                out.append(a)
            return a

        # fx's own walk (in C): the leaves of pytree.tree_leaves, in its order, far cheaper
        fx.node.map_arg((node.args, node.kwargs), visit)
        return out

    def sharding(
        self, dims: tuple[tuple[str, ...], ...], partial: tuple[str, ...] = (), op: str = "sum"
    ) -> Sharding:
        """``Sharding(self.mesh, dims, partial, op)``, validated once, not thousands of times."""
        key = (dims, partial, op)
        s = self._shardings.get(key)
        if s is None:
            s = self._shardings[key] = Sharding(self.mesh, dims, partial, op)
        return s

    def localize_operands(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> list[fx.Node]:
        """Reshard every tensor operand to what the op needs and mask reduced padding."""
        out = []
        reduced = {f for f in rule.summed_factors if assign.get(f)}
        for i, (operand, factors) in enumerate(
            zip(self.operand_nodes(node), rule.operands, strict=True)
        ):
            v = self.value(operand)
            if factors is None:
                dst = self.sharding(((),) * len(v.shape))
            else:
                dst = self.sharding(self.dims_of(factors, assign))
            if rule.facts.shape_only and v.sharding.with_partial(()) == dst:
                out.append(v.node)  # only its shape is read: a partial value will do
                continue
            if v.sharding == dst:  # nothing moves (what reshard would say, without the words)
                local = v.node
            else:
                local = self.reshard(self.key(operand), dst, needs_why(node, i, dst), node)
            is_index = i in rule.facts.index_operands
            for d, dim in enumerate(factors or ()):
                if dst.dim_axes[d] and (is_index or any(f in reduced for f in dim)):
                    # Padding of a reduced dim gets the reduction's identity; padding of an
                    # index tensor (garbage after elementwise ops) gets a valid index, 0.
                    fill = 0 if is_index else identity_of(rule.reduce_op, v.dtype)
                    emit = Emitter(self, node)
                    local = node_of(
                        emit.mask_padding(local, dst.dim_axes[d], v.shape[d], len(v.shape), d, fill)
                    )
            out.append(local)
        return out

    def result_shardings(
        self, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> list[Sharding | None]:
        """The sharding of each result of an op lowered with ``assign`` (None: not a tensor)."""
        key = ("results", *assign.items())
        return list(memo_by_rule(self._memo, key, rule, lambda: self._results(rule, assign)))

    def _results(self, rule: FactorRule, assign: dict[str, tuple[str, ...]]) -> list[Any]:
        out: list[Sharding | None] = []
        for j, factors in enumerate(rule.results):
            if factors is None:
                out.append(None)
                continue
            partial = tuple(a for f in rule.partial_factors(j) for a in assign.get(f, ()))
            out.append(self.sharding(self.dims_of(factors, assign), partial, rule.reduce_op))
        return out

    def _generic(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> fx.Node:
        locals_ = iter(self.localize_operands(node, rule, assign))
        results = self.result_shardings(rule, assign)
        val = node.meta["val"]
        vals = val if isinstance(val, (tuple, list)) else (val,)

        def swap(a: Any) -> Any:
            if isinstance(a, fx.Node) and _tensor_val(a.meta.get("val")):
                return next(locals_)
            return a

        mapped: Any = fx.node.map_arg((tuple(node.args), dict(node.kwargs)), swap)
        args, kwargs = cast("tuple[Sequence[Any], dict[str, Any]]", mapped)
        sizes = rule.facts.size_args
        if sizes:
            # Kernels that take their input's sizes as ints (group norm's N) get local sizes,
            # and contiguous inputs.
            ops = self.operand_nodes(node)
            sized = list(args)
            for arg_index, operand_index, dim in sizes:
                s_in = self.sharding(self.dims_of(rule.operands[operand_index] or (), assign))
                sized[arg_index] = local_shape(s_in, self.value(ops[operand_index]).shape)[dim]
            for j, a in enumerate(sized):
                arg_j: Any = node.args[j]  # a Node where a is one (map_arg keeps positions)
                if isinstance(a, fx.Node) and _tensor_val(arg_j.meta.get("val")):
                    sized[j] = self.graph.call_function(
                        torch.ops.aten.clone.default,
                        (a,),
                        {"memory_format": torch.contiguous_format},
                    )
            args = tuple(sized)
        if rule.handler == "localize_shape":
            (res,) = [r for r in results if r is not None][:1]
            (gval,) = [v for v in vals if _tensor_val(v)][:1]
            args, kwargs = localize_shape_args(
                tuple(args), kwargs, tuple(gval.shape), local_shape(res, tuple(gval.shape))
            )
        return self.emit(node.target, tuple(args), kwargs)

    def _store_results(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]], local: fx.Node
    ) -> None:
        val = node.meta["val"]
        natural = self.result_shardings(rule, assign)
        wanted = node_meta.sharding(node)
        if isinstance(val, (tuple, list)):
            for i, (v, s) in enumerate(zip(val, natural, strict=True)):
                if not _tensor_val(v) or s is None:
                    continue
                item = self.emit(operator.getitem, (local, i))
                self.values[(node, i)] = LocalValue(item, s, tuple(v.shape), v.dtype)
                self._explain_partial((node, i), node, rule, assign, i)
                self._settle((node, i), wanted[i] if isinstance(wanted, tuple) else None, node)
        else:
            (s,) = natural
            assert s is not None  # a single tensor result always has factors
            self.values[(node, None)] = LocalValue(local, s, tuple(val.shape), val.dtype)
            self._copies[(node, None)] = self._pending_copies.pop(node, {})
            self._explain_partial((node, None), node, rule, assign, 0)
            self._settle((node, None), node_meta.single_sharding(node), node)

    def _explain_partial(
        self,
        key: ValueKey,
        node: fx.Node,
        rule: FactorRule,
        assign: dict[str, tuple[str, ...]],
        j: int,
    ) -> None:
        """Remember, in words, why an op's result is partial (for the Plan's reasons)."""
        text = partial_reason(self, key, node, rule, assign, j)
        if text is not None:
            self._partial_origin[key] = (text, node_meta.source(node))

    def settle_result(self, key: ValueKey, wanted: Sharding | None, node: fx.Node) -> None:
        """Reshard a fresh value to the sharding propagation chose for it (for handlers)."""
        self._settle(key, wanted, node)

    def _settle(self, key: ValueKey, wanted: Sharding | None, node: fx.Node) -> None:
        """Reshard a fresh result to the sharding propagation chose for the value."""
        v = self.values[key]
        if wanted is None or wanted == v.sharding:
            return
        if wanted.partial and wanted.partial != v.sharding.partial:
            wanted = wanted.with_partial(())
        why = f"the result of {op_name(node.target)} (%{node.name}) is wanted as {wanted}"
        local = self.reshard(key, wanted, why, node)
        self.values[key] = LocalValue(local, wanted, v.shape, v.dtype)
