"""Propagation through the bodies of control-flow ops (``torch.cond``, ``while_loop``,
``scan``, ``map``): each body is a program of its own, propagated once its inputs' shardings
are known, to a fixed point on the carried values.

After the outer program's fixpoint, for each control-flow op in program order:

1. Each body input takes the sharding of the operand it receives, never partial (a loop
   carries whole values): a scan's ``xs`` without their scanned dim 0 (each step reads one
   slice, so dim 0 is gathered first), a map's without their mapped dim 0 (each device maps
   its own rows; the body's values may not use those mesh axes).
2. The body is propagated with those inputs fixed (``propagate(..., pinned=...)``).
3. A carried value whose sharding comes out of the body different from the one it went in
   with takes the body's sharding and the body is propagated again; if it still differs the
   carry is replicated (the Plan records it). So carry-in equals carry-out, and the loop
   needs no collective at its back edge unless the body itself asks for one.
4. A predicate (``cond``'s, or the result of ``while_loop``'s condition body) is one boolean
   the same on every device: it is wanted replicated and whole, so a predicate computed from
   sharded data is reduced (the Plan records where and why).

The result is one :class:`BodyLayout` per op (``node_meta.body_layout``), which
``partition/control_flow.py`` lowers. This module does not insert collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.capture.control_flow import CONTROL_FLOW_OPS, body_modules
from partita.ir import node_meta
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["BodyLayout", "is_control_flow", "propagate_bodies"]

#: propagate(body, pinned input shardings) -> the shardings of the body's outputs
RunBody = Callable[[fx.GraphModule, Sequence[Sharding]], list[Sharding]]

_OPS = frozenset(CONTROL_FLOW_OPS.values())


def is_control_flow(node: fx.Node) -> bool:
    """Whether ``node`` calls ``cond``, ``while_loop``, ``scan`` or ``map``."""
    return node.op == "call_function" and node.target in _OPS


@dataclass(frozen=True)
class BodyLayout:
    """How one control-flow op's values are sharded around and inside its bodies.

    Attributes:
        kind: ``cond``, ``while_loop``, ``scan`` or ``map_impl``.
        operands: the sharding each tensor operand is resharded to before the op (operand
            order of its rule: ``rules/control_flow.py``).
        inputs: per body (argument order), the sharding of each of its inputs.
        outputs: per body, the sharding each of its outputs is resharded to at its end.
        results: the sharding of each result of the op in the per-device program.
        notes: decisions worth a line in the Plan (a replicated carry, a reduced predicate).
    """

    kind: str
    operands: tuple[Sharding, ...]
    inputs: tuple[tuple[Sharding, ...], ...]
    outputs: tuple[tuple[Sharding, ...], ...]
    results: tuple[Sharding, ...]
    notes: tuple[str, ...]


def _whole(s: Sharding) -> Sharding:
    return s.with_partial(())


def _replicated(s: Sharding) -> Sharding:
    return Sharding(s.mesh, ((),) * len(s.dim_axes))


def _drop_dim0(s: Sharding) -> Sharding:
    return Sharding(s.mesh, s.dim_axes[1:])


def _with_dim0(s: Sharding, axes: tuple[str, ...]) -> Sharding:
    return Sharding(s.mesh, (axes, *s.dim_axes))


def _without(s: Sharding, axes: tuple[str, ...]) -> Sharding:
    return Sharding(s.mesh, tuple(tuple(a for a in d if a not in axes) for d in s.dim_axes))


def _operand_shardings(node: fx.Node) -> list[Sharding]:
    out = []

    def visit(a: fx.Node) -> fx.Node:
        if isinstance(a.meta.get("val"), torch.Tensor):
            out.append(_whole(node_meta.value_sharding(a)))
        return a

    fx.node.map_arg((node.args, node.kwargs), visit)
    return out


def _sharded_ancestor(node: fx.Node) -> fx.Node | None:
    """The nearest value ``node`` is computed from that is split or partial, if any."""
    seen, todo = {node}, [node]
    while todo:
        n = todo.pop(0)
        s = node_meta.sharding(n)
        if isinstance(s, Sharding) and (s.partial or any(s.dim_axes)):
            return n
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return None


def _count(arg: object) -> int:
    return len(arg) if isinstance(arg, (tuple, list)) else 0


class _Bodies:
    """One op's layout, built by propagating its bodies (``run``)."""

    def __init__(self, node: fx.Node, mesh: Mesh, run: RunBody) -> None:
        self.node, self.mesh, self.run = node, mesh, run
        self.bodies = body_modules(node)
        self.ops = _operand_shardings(node)
        self.notes: list[str] = []
        self.name = f"{getattr(node.target, '_name', node.target)} (%{node.name})"

    def carried(self, body: fx.GraphModule, carry: list[Sharding], rest: list[Sharding]) -> None:
        """Settle ``carry`` (in place) to a fixed point of ``body``: carry-in == carry-out."""
        for attempt in range(3):
            outs = self.run(body, [*carry, *rest])
            changed = False
            for i, out in enumerate(outs[: len(carry)]):
                out = _whole(out)
                if out == carry[i]:
                    continue
                if attempt == 0:
                    carry[i] = out
                elif carry[i] != _replicated(carry[i]):
                    self.notes.append(
                        f"{self.name}: carried value {i} goes in as {carry[i]} and comes out of "
                        f"the body as {out}; no sharding is a fixed point, so it is replicated"
                    )
                    carry[i] = _replicated(carry[i])
                else:
                    continue
                changed = True
            if not changed:
                return

    def predicate(self, sharding: Sharding, what: str, value: fx.Node) -> Sharding:
        """The predicate wanted whole and replicated: one decision, the same on every device
        (the Plan says so when it is computed from sharded data)."""
        source = _sharded_ancestor(value)
        if sharding.partial or any(sharding.dim_axes) or source is not None:
            at = f"%{source.name}: {node_meta.value_sharding(source)}" if source else sharding
            self.notes.append(
                f"{self.name}: {what} is computed from sharded data ({at}); it is reduced to "
                f"one value, the same on every device, before it is read, so that every device "
                f"takes the same decision"
            )
        return _replicated(sharding)

    def layout(self) -> BodyLayout:
        node, args = self.node, self.node.args
        kind = getattr(node.target, "_name", str(node.target))
        if kind == "while_loop":
            n = _count(args[2])
            carry, rest = list(self.ops[:n]), list(self.ops[n:])
            cond_gm, body_gm = self.bodies
            self.carried(body_gm, carry, rest)
            (pred,) = self.run(cond_gm, [*carry, *rest])
            out = pytree.tree_leaves(cond_gm.graph.output_node().args[0])[0]
            pred = self.predicate(pred, "the loop condition", out)
            ins = (*carry, *rest)
            return self._done(kind, ins, (ins, ins), ((pred,), tuple(carry)), tuple(carry))
        if kind == "scan":
            n, m = _count(args[1]), _count(args[2])
            carry, xs, rest = list(self.ops[:n]), self.ops[n : n + m], list(self.ops[n + m :])
            if any(x.dim_axes[0] for x in xs):
                self.notes.append(f"{self.name}: the scanned dim 0 of xs is gathered")
            slices = [_drop_dim0(x) for x in xs]
            (body_gm,) = self.bodies
            self.carried(body_gm, carry, [*slices, *rest])
            outs = [_whole(o) for o in self.run(body_gm, [*carry, *slices, *rest])]
            ys = [_with_dim0(y, ()) for y in outs[n:]]
            operands = (*carry, *(_with_dim0(s, ()) for s in slices), *rest)
            body_in = (*carry, *slices, *rest)
            results = (*carry, *ys)
            return self._done(kind, operands, (body_in,), ((*carry, *outs[n:]),), results)
        if kind == "map_impl":
            return self._map(kind)
        return self._cond(kind)

    def _map(self, kind: str) -> BodyLayout:
        m = _count(self.node.args[1])
        xs, rest = self.ops[:m], self.ops[m:]
        rows = xs[0].dim_axes[0] if xs else ()
        (body_gm,) = self.bodies
        for _ in range(2):
            slices = [_without(_drop_dim0(x), rows) for x in xs]
            pos = [_without(r, rows) for r in rest]
            outs = [_whole(o) for o in self.run(body_gm, [*slices, *pos])]
            if not any(a in rows for o in outs for d in o.dim_axes for a in d):
                break
            rows = ()  # the body would use the mapped axes too: map over whole rows
        operands = (*(_with_dim0(s, rows) for s in slices), *pos)
        results = tuple(_with_dim0(o, rows) for o in outs)
        return self._done(kind, operands, ((*slices, *pos),), (tuple(outs),), results)

    def _cond(self, kind: str) -> BodyLayout:
        pred_node = cast(fx.Node, self.node.args[0])
        pred, operands = self.predicate(self.ops[0], "the predicate", pred_node), self.ops[1:]
        true_gm, false_gm = self.bodies
        outs = tuple(_whole(o) for o in self.run(true_gm, operands))
        false_outs = [_whole(o) for o in self.run(false_gm, operands)]
        if list(outs) != false_outs:
            self.notes.append(
                f"{self.name}: the false branch's results ({', '.join(map(str, false_outs))}) "
                f"are resharded to the true branch's ({', '.join(map(str, outs))})"
            )
        ins = tuple(operands)
        return self._done(kind, (pred, *ins), (ins, ins), (outs, outs), outs)

    def _done(
        self,
        kind: str,
        operands: tuple[Sharding, ...],
        inputs: tuple[tuple[Sharding, ...], ...],
        outputs: tuple[tuple[Sharding, ...], ...],
        results: tuple[Sharding, ...],
    ) -> BodyLayout:
        return BodyLayout(kind, operands, inputs, outputs, results, tuple(self.notes))


def propagate_bodies(gm: fx.GraphModule, mesh: Mesh, run: RunBody) -> None:
    """Give every control-flow op of ``gm`` its :class:`BodyLayout` (``node_meta``), its
    bodies propagated by ``run``."""
    for node in gm.graph.nodes:
        if is_control_flow(node):
            node_meta.set_body_layout(node, _Bodies(node, mesh, run).layout())
