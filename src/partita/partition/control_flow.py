"""Lower a control-flow op (``torch.cond``, ``while_loop``, ``scan``, ``map``): each body is
partitioned once, as a program of its own, and the per-device program keeps the op, calling
the partitioned bodies. Nothing is unrolled.

The shardings come from propagation (``propagate/bodies.py``, ``node_meta.body_layout``):
the operands are resharded to the layout's operand shardings before the op (the Plan records
why), each body is lowered by a :class:`BodyLowering` whose outputs are resharded at its end
to what the layout says (a loop's carry-out to its carry-in, a branch's results to the other
branch's), and the op's results are then resharded to what the outer program wants of them.
A body's collectives run once per iteration (or per branch taken): they are recorded in the
body's own Plan, ``plan.bodies[name]``, and the decisions about the loop in
``plan.control_flow``.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.capture.control_flow import body_modules
from partita.errors import InternalError
from partita.ir import node_meta
from partita.partition.bucket import bucket_collectives
from partita.partition.lowering_api import LoweringAPI
from partita.partition.plan import Plan
from partita.partition.resharding import LocalValue
from partita.propagate.bodies import BodyLayout
from partita.values.spec import Sharding

__all__ = ["lower_control_flow", "output_to"]


def _name(node: fx.Node) -> str:
    return f"{getattr(node.target, '_name', node.target)} (%{node.name})"


def output_to(low: Any, node: fx.Node, targets: tuple[Sharding, ...]) -> Any:
    """A body's outputs, each resharded to its target (the body's end: the loop's back edge),
    in the structure the body returned them (a tuple, a list, one value)."""
    outs = []
    leaves, spec = pytree.tree_flatten(node.args[0])
    if not all(isinstance(a, fx.Node) for a in leaves):
        raise InternalError(f"a body returns a non-tensor: {node.args[0]}")
    for i, (leaf, dst) in enumerate(zip(leaves, targets, strict=True)):
        key = low.key(leaf)
        why = f"body output {i} is carried on as {dst} (the next iteration's input, or the result)"
        local = low.reshard(key, dst, why, node)
        low.values[key] = LocalValue(local, dst, low.values[key].shape, low.values[key].dtype)
        outs.append(local)
        low.plan.output_shardings.append(dst)
    return pytree.tree_unflatten(outs, spec)


def lower_control_flow(low: LoweringAPI, node: fx.Node, lowering: Any) -> None:
    """Emit ``node``'s op on its local operands, with its bodies lowered once each by the
    ``lowering`` class (``partition.lower.Lowering``, passed in: it imports this module)."""

    def make_body(body: fx.GraphModule, outs: tuple[Sharding, ...]) -> tuple[Any, Plan]:
        low_any = cast(Any, low)
        sub = lowering(body, low_any.mesh, strict=low_any.strict, collectives=low_any.collectives)
        sub.output_targets = outs
        return cast("tuple[Any, Plan]", sub.run())

    layout = cast(BodyLayout, node_meta.body_layout(node))
    if layout is None:
        raise InternalError(f"{_name(node)} has no body layout: propagation did not reach it")
    low_any = cast(Any, low)
    plan: Plan = low_any.plan
    operands = low_any.operand_nodes(node)
    locals_: list[fx.Node] = []
    for i, (operand, dst) in enumerate(zip(operands, layout.operands, strict=True)):
        why = f"operand {i} of {_name(node)} enters its body as {dst}"
        if i == 0 and layout.kind == "cond":
            why = f"the predicate of {_name(node)} must be the same on every device"
        locals_.append(low_any.reshard(low_any.key(operand), dst, why, node))
    plan.control_flow.extend(layout.notes)
    bodies = iter(body_modules(node))
    outputs = iter(layout.outputs)
    feed = iter(locals_)

    def swap(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr":
            local_body, body_plan = make_body(next(bodies), next(outputs))
            bucket_collectives(local_body, body_plan, 0)  # their bytes, for the schedule
            name = f"{node.name}_{a.target}"
            low_any.bodies[name] = local_body
            plan.bodies[name] = body_plan
            return low_any.graph.get_attr(name)
        return next(feed)

    args = fx.node.map_arg(node.args, swap)
    op = low_any.emit(node.target, tuple(args))
    wanted = node_meta.sharding(node)
    vals = node.meta["val"]
    if isinstance(vals, torch.Tensor):  # one result: the op's own node
        (s,) = layout.results
        low_any.values[(node, None)] = LocalValue(op, s, tuple(vals.shape), vals.dtype)
        low_any.settle_result((node, None), node_meta.single_sharding(node), node)
        return
    for i, (val, s) in enumerate(zip(vals, layout.results, strict=True)):
        if not isinstance(val, torch.Tensor):
            continue
        item = low_any.emit(operator.getitem, (op, i))
        low_any.values[(node, i)] = LocalValue(item, s, tuple(val.shape), val.dtype)
        want = wanted[i] if isinstance(wanted, tuple) else None
        low_any.settle_result((node, i), want, node)
