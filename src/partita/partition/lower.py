"""Lower a propagated program into one per-device program plus its Plan.

For each op, in program order (DESIGN.md, Partitioning):

1. The op's factor assignment (``node.meta["factor_axes"]``, chosen by propagation) fixes the
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
   program has exactly ``node.meta["sharding"]``.

Special lowerings named by rules (``FactorRule.handler``) live in ``partition.handlers``.
This module does not run anything.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.errors import (
    DtypeError,
    PartitaError,
    RematerializationError,
    RematerializationWarning,
    UnsupportedOpError,
)
from partita.explain import op_name
from partita.layout import local_shape
from partita.mesh import Mesh
from partita.partition import halo as _halo  # noqa: F401 - registers its handler
from partita.partition import handlers
from partita.partition import special as _special  # noqa: F401 - registers its handlers
from partita.partition.local_args import (
    INDEX_OPERANDS,
    LOCAL_SIZE_ARGS,
    SAME_DTYPE,
    SHAPE_ONLY,
    localize_shape_args,
)
from partita.partition.masks import emit_mask_padding, identity_of
from partita.partition.plan import CollectiveRecord, Plan
from partita.partition.reasons import partial_reason
from partita.partition.reshard import emit_reshard, is_full_remat, plan_reshard
from partita.propagate_rules import compiler_error
from partita.rules import FactorKind, FactorRule
from partita.rules.opinfo import source_of
from partita.spec import Sharding

__all__ = ["LocalValue", "Lowering"]

ValueKey = tuple[fx.Node, int | None]

_PERMUTE = torch.ops.aten.permute.default


@dataclass(slots=True)
class LocalValue:
    """A value of the per-device program: its local node and what it holds."""

    node: fx.Node
    sharding: Sharding
    shape: tuple[int, ...]
    dtype: torch.dtype


def _tensor_val(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


class Lowering:
    """Builds the per-device graph for one propagated GraphModule (use :meth:`run` once)."""

    def __init__(self, gm: fx.GraphModule, mesh: Mesh, *, strict: bool = False) -> None:
        self.src = gm
        self.mesh = mesh
        self.strict = strict
        self.graph = fx.Graph()
        self.values: dict[ValueKey, LocalValue] = {}
        self.alias: dict[fx.Node, ValueKey] = {}
        # Every local copy of a value made so far, by sharding (reshards reuse them).
        self._copies: dict[ValueKey, dict[Sharding, fx.Node]] = {}
        self._pending_copies: dict[fx.Node, dict[Sharding, fx.Node]] = {}
        # Why a value is partial: (explanation, source line of the op that made it partial).
        self._partial_origin: dict[ValueKey, tuple[str, str | None]] = {}
        self.plan = Plan(mesh)

    # --- helpers shared with handlers ------------------------------------------------------

    def key(self, node: fx.Node) -> ValueKey:
        return self.alias.get(node, (node, None))

    def value(self, node: fx.Node) -> LocalValue:
        return self.values[self.key(node)]

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(target, tuple(args), kwargs)

    def reshard(self, key: ValueKey, dst: Sharding, why: str, at: fx.Node) -> fx.Node:
        """The local node of value ``key`` under ``dst``, inserting collectives as needed."""
        v = self.values[key]
        if v.sharding == dst:
            return v.node
        copies = self._copies.setdefault(key, {})
        if dst in copies:
            return copies[dst]
        through = self._reshard_through_permute(key, dst, why, at)
        if through is not None:
            copies[dst] = through
            return through
        # Start from whichever copy of the value moves the fewest bytes to ``dst``: a value
        # already gathered for one consumer is sliced locally for the next.
        start, steps = min(
            (
                (node, plan_reshard(s, dst, v.shape))
                for s, node in [(v.sharding, v.node), *copies.items()]
                if not s.partial or s == v.sharding
            ),
            key=lambda c: _collective_bytes(c[1]),
        )
        source = at.meta.get("source")
        name = key[0].name if key[1] is None else f"{key[0].name}[{key[1]}]"
        if is_full_remat(steps):
            msg = (
                f"involuntary full rematerialization of %{name} {v.dtype}{list(v.shape)} "
                f"from {v.sharding} to {dst} for {op_name(at.target)} at "
                f"{source or 'an unknown source line'}: no collective moves the tiles directly, "
                f"so every device gathers the whole value and slices it."
            )
            fix = (
                f"Annotate the value where it is produced with "
                f"partita.mark_sharding(t, mesh, {dst.spec}) (or change the in_specs/out_specs "
                f"that ask for {v.sharding.spec}) so that no reshard between the two is needed."
            )
            if self.strict:
                raise RematerializationError(f"{msg} {fix}")
            warnings.warn(f"{msg} {fix}", RematerializationWarning, stacklevel=4)
            self.plan.warnings.append(msg)
        out = emit_reshard(self.graph, start, steps, self.mesh)
        origin = self._partial_origin.get(key)
        for step in steps:
            if not step.is_collective:
                continue
            reason = f"{why}: {step.reason}" if step.reason else why
            step_source = source
            if origin is not None and step.kind in ("all_reduce", "reduce_scatter"):
                reason, step_source = f"{origin[0]}; then {reason}", origin[1]
            shape = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            self.plan.collectives.append(
                CollectiveRecord(
                    kind=step.kind,
                    mesh_axes=tuple(step.mesh_axes),
                    groups=tuple(tuple(g) for g in self.mesh.groups(step.mesh_axes)),
                    shape=tuple(shape),
                    dtype=v.dtype,
                    value=name,
                    reason=reason,
                    source=step_source,
                    detail=_detail(step),
                )
            )
        copies[dst] = out
        return out

    def note_copy(self, node: fx.Node, sharding: Sharding, local: fx.Node) -> None:
        """A handler tells that ``local`` holds the result of ``node`` under ``sharding`` too
        (for example the gathered value it sliced its result from)."""
        self._pending_copies.setdefault(node, {})[sharding] = local

    def _reshard_through_permute(
        self, key: ValueKey, dst: Sharding, why: str, at: fx.Node
    ) -> fx.Node | None:
        """Reshard ``permute(u)`` by resharding ``u`` and permuting locally.

        The same data moves either way, but a weight used transposed in the forward and as is
        in the backward is then gathered once, not twice (the reshard of ``u`` is cached).
        """
        node, idx = key
        if idx is not None or node.op != "call_function" or node.target != _PERMUTE:
            return None
        src_key = self.key(node.args[0])
        u = self.values.get(src_key)
        if u is None or u.sharding.partial or dst.partial or self.values[key].sharding.partial:
            return None
        perm = [int(p) % len(u.shape) for p in node.args[1]]
        dims: list[tuple[str, ...]] = [()] * len(perm)
        for i, p in enumerate(perm):
            dims[p] = dst.dim_axes[i]
        local = self.reshard(src_key, Sharding(self.mesh, tuple(dims)), why, at)
        return self.graph.call_function(_PERMUTE, (local, perm))

    # --- the driver ------------------------------------------------------------------------

    def run(self) -> tuple[fx.GraphModule, Plan]:
        for node in self.src.graph.nodes:
            last = next(reversed(self.graph.nodes), None)  # the last local node before this op's
            try:
                self._node(node)
                _stamp_origin(node, last.next if last is not None else None, self.graph)
            except PartitaError:
                raise
            except Exception as e:  # anything else is partita's bug: say where it happened
                raise compiler_error(node, "Partitioning", e) from e
        for n in self.src.graph.nodes:
            if "sharding" in n.meta:
                self.plan.shardings[n.name] = n.meta["sharding"]
        gm = fx.GraphModule(torch.nn.Module(), self.graph, class_name="PerDeviceProgram")
        return gm, self.plan

    def _node(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self._placeholder(node)
        elif node.op == "output":
            self._output(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            self._getitem(node)
        elif node.op == "call_function" and "annotation" in node.meta:
            self._annotation(node)
        elif node.op == "call_function":
            self._op(node)
        elif node.op == "get_attr":
            raise UnsupportedOpError(
                f"Constant {node.target} (node {node.name}) is not supported by the "
                f"partitioner: pass tensors as inputs instead of closing over them."
            )

    def _placeholder(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        local = self.graph.placeholder(node.name)
        if not _tensor_val(val):
            return
        sharding = node.meta["sharding"]
        self.values[(node, None)] = LocalValue(local, sharding, tuple(val.shape), val.dtype)
        self.plan.input_shardings.append(sharding)

    def _getitem(self, node: fx.Node) -> None:
        src, idx = node.args
        if (src, int(idx)) in self.values:
            self.alias[node] = (src, int(idx))

    def _annotation(self, node: fx.Node) -> None:
        ann = node.meta["annotation"]
        operand = node.args[0]
        why = f"annotation {ann.source or node.name} asks for {ann.sharding}"
        local = self.reshard(self.key(operand), ann.sharding, why, node)
        v = self.value(operand)
        if local is v.node:  # nothing moved: the annotation is the same value (and copies)
            self.alias[node] = self.key(operand)
            return
        self.values[(node, None)] = LocalValue(local, ann.sharding, v.shape, v.dtype)

    def _output(self, node: fx.Node) -> None:
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
        """Drop factor axes that some tensor of the op cannot hold or that need a handler the
        partitioner lacks (computing those factors whole is always correct): without its
        handler an op computes its summed and windowed factors whole, and a ``WHOLE_OP``
        handler's op (random draws) is computed entirely replicated."""
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
                        full = self.mesh.axes_size(out.get(major, ())) == rule.sizes[major]
                        if not full and out.get(minor):
                            del out[minor]
                            changed = True
        return out

    def dims_of(
        self, factors: tuple[tuple[str, ...], ...], assign: dict[str, tuple[str, ...]]
    ) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(a for f in dim for a in assign.get(f, ())) for dim in factors)

    def _op(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if not any(_tensor_val(v) for v in vals):
            raise UnsupportedOpError(
                f"Node {node.name} ({op_name(node.target)}) produces no tensor; the partitioner "
                f"only handles tensor programs."
            )
        if node.target in SAME_DTYPE:
            _check_same_dtype(node)
        rule: FactorRule = node.meta["rule"]
        assign = self.representable(node.target, rule, node.meta.get("factor_axes", {}))
        handler = handlers.get(rule.handler)
        if handler is not None and handler.applies(self, node, rule, assign):
            results = handler.lower(self, node, rule, assign)
        else:
            results = self._generic(node, rule, assign)
        self._store_results(node, rule, assign, results)

    def operand_nodes(self, node: fx.Node) -> list[fx.Node]:
        return [
            a
            for a in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, fx.Node) and _tensor_val(a.meta.get("val"))
        ]

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
                dst = Sharding.replicated(self.mesh, len(v.shape))
            else:
                dst = Sharding(self.mesh, self.dims_of(factors, assign))
            why = f"{op_name(node.target)} (%{node.name}) needs operand {i} as {dst}"
            if "replicated_reason" in node.meta:  # replicate_unsupported=True chose this
                why = (
                    f"{op_name(node.target)} (%{node.name}) runs replicated "
                    f"(replicate_unsupported=True): {node.meta['replicated_reason']}"
                )
            if node.target in SHAPE_ONLY and v.sharding.with_partial(()) == dst:
                out.append(v.node)  # only its shape is read: a partial value will do
                continue
            local = self.reshard(self.key(operand), dst, why, node)
            is_index = i in INDEX_OPERANDS.get(node.target, ())
            for d, dim in enumerate(factors or ()):
                if dst.dim_axes[d] and (is_index or any(f in reduced for f in dim)):
                    # Padding of a reduced dim gets the reduction's identity; padding of an
                    # index tensor (garbage after elementwise ops) gets a valid index, 0.
                    fill = 0 if is_index else identity_of(rule.reduce_op, v.dtype)
                    local = emit_mask_padding(
                        self.graph,
                        local,
                        self.mesh,
                        dst.dim_axes[d],
                        v.shape[d],
                        len(v.shape),
                        d,
                        fill,
                    )
            out.append(local)
        return out

    def result_shardings(
        self, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> list[Sharding | None]:
        out: list[Sharding | None] = []
        for j, factors in enumerate(rule.results):
            if factors is None:
                out.append(None)
                continue
            partial = tuple(a for f in rule.partial_factors(j) for a in assign.get(f, ()))
            dims = self.dims_of(factors, assign)
            out.append(Sharding(self.mesh, dims, partial, rule.reduce_op))
        return out

    def _generic(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]]
    ) -> fx.Node:
        locals_ = iter(self.localize_operands(node, rule, assign))
        results = self.result_shardings(rule, assign)
        vals = (
            node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
        )

        def swap(a: Any) -> Any:
            if isinstance(a, fx.Node) and _tensor_val(a.meta.get("val")):
                return next(locals_)
            return a

        args, kwargs = pytree.tree_map(swap, (tuple(node.args), dict(node.kwargs)))
        sizes = LOCAL_SIZE_ARGS.get(node.target)
        if sizes:
            # Kernels that take their input's sizes as ints (group norm's N) get local sizes,
            # and contiguous inputs.
            ops = self.operand_nodes(node)
            args = list(args)
            for arg_index, (operand_index, dim) in sizes.items():
                s_in = Sharding(self.mesh, self.dims_of(rule.operands[operand_index] or (), assign))
                args[arg_index] = local_shape(s_in, self.value(ops[operand_index]).shape)[dim]
            for j, a in enumerate(args):
                if isinstance(a, fx.Node) and _tensor_val(node.args[j].meta.get("val")):
                    args[j] = self.graph.call_function(
                        torch.ops.aten.clone.default,
                        (a,),
                        {"memory_format": torch.contiguous_format},
                    )
            args = tuple(args)
        if rule.handler == "localize_shape":
            (res,) = [r for r in results if r is not None][:1]
            (gval,) = [v for v in vals if _tensor_val(v)][:1]
            args, kwargs = localize_shape_args(
                args, kwargs, tuple(gval.shape), local_shape(res, tuple(gval.shape))
            )
        return self.graph.call_function(node.target, tuple(args), kwargs)

    def _store_results(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]], local: fx.Node
    ) -> None:
        val = node.meta["val"]
        natural = self.result_shardings(rule, assign)
        wanted = node.meta.get("sharding")
        if isinstance(val, (tuple, list)):
            for i, (v, s) in enumerate(zip(val, natural, strict=True)):
                if not _tensor_val(v) or s is None:
                    continue
                item = self.graph.call_function(operator.getitem, (local, i))
                self.values[(node, i)] = LocalValue(item, s, tuple(v.shape), v.dtype)
                self._explain_partial((node, i), node, rule, assign, i)
                self._settle((node, i), wanted[i] if isinstance(wanted, tuple) else None, node)
        else:
            (s,) = natural
            assert s is not None  # a single tensor result always has factors
            self.values[(node, None)] = LocalValue(local, s, tuple(val.shape), val.dtype)
            self._copies[(node, None)] = self._pending_copies.pop(node, {})
            self._explain_partial((node, None), node, rule, assign, 0)
            self._settle((node, None), wanted, node)

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
            self._partial_origin[key] = (text, node.meta.get("source"))

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


def _stamp_origin(node: fx.Node, first: fx.Node | None, graph: fx.Graph) -> None:
    """Tag the local nodes emitted for ``node`` (from ``first`` on; ``None``: the whole graph)
    with the op and source line they come from, so that a failure while running names them."""
    local = first if first is not None else next(iter(graph.nodes), None)
    while local is not None and local.op != "root":
        local.meta.setdefault("origin", f"{op_name(node.target)} (%{node.name})")
        if "source" in node.meta:
            local.meta.setdefault("source", node.meta["source"])
        local = local.next


def _check_same_dtype(node: fx.Node) -> None:
    """An op that does not promote types gets one floating dtype, or the run would fail."""
    tensors = [a.meta["val"] for a in node.all_input_nodes if _tensor_val(a.meta.get("val"))]
    floats = [(i, t) for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if len({t.dtype for _, t in floats}) > 1:
        listed = ", ".join(f"operand {i} {t.dtype} {list(t.shape)}" for i, t in floats)
        raise DtypeError(
            f"{op_name(node.target)} at node {node.name} "
            f"({source_of(node) or 'source line unknown'}) mixes dtypes ({listed}). This op "
            f"does not promote types, so its per-device program would fail when it runs. Cast "
            f"the operands to one dtype first (for example b.to(a.dtype))."
        )


def _detail(step: Any) -> str:
    parts = [str(a) for a in step.args if not isinstance(a, (list, tuple))]
    return ", ".join(parts)


def _collective_bytes(steps: list[Any]) -> int:
    """Per-device bytes a step list moves, in element counts (dtype is the same for all)."""
    total = 0
    for step in steps:
        if step.is_collective:
            shape = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            n = 1
            for d in shape:
                n *= d
            total += n
    return total
