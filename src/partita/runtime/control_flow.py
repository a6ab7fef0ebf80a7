"""Run a control-flow op (``cond``, ``while_loop``, ``scan``, ``map``) of a per-device program
on the LocalMesh: a Python loop over iterations, each body run by the LocalMesh itself on the
stacked values (its segments vmapped, its collectives on the stack), so a body holding
collectives runs exactly as the devices would run it. Nothing is unrolled: a body's segment
plan is built once and reused by every iteration.

Values are held as the LocalMesh holds them (``(value, axes)``, see ``runtime.local``). A
predicate must be the same on every device (the partitioner made it so,
``propagate.bodies``); a predicate that differs is partita's bug and raises InternalError.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from partita.errors import InternalError

__all__ = ["bind_bodies", "run_control_flow"]

Held = tuple[Any, tuple[bool, ...]]
Execute = Callable[[fx.GraphModule, list[Held]], list[Held]]


def _uniform(pred: Held, node: fx.Node) -> bool:
    value, axes = pred
    flat = torch.as_tensor(value).reshape(-1)
    if any(axes) and not bool((flat == flat[0]).all()):
        raise InternalError(
            f"The predicate of {node.name} differs between devices ({flat.tolist()}); the "
            f"partitioner should have made it uniform: a bug in partita."
        )
    return bool(flat[0])


def _slice(x: Held, t: int) -> Held:
    value, axes = x
    return value.select(sum(axes), t), axes


def _spread(x: Held, axes: tuple[bool, ...], mesh_shape: tuple[int, ...]) -> Any:
    """``x`` held as varying along ``axes`` (a superset of its own)."""
    value, own = x
    dim = 0
    for i, want in enumerate(axes):
        if want and not own[i]:
            value = value.unsqueeze(dim)
            sizes = [-1] * value.dim()
            sizes[dim] = mesh_shape[i]
            value = value.expand(sizes)
        dim += int(want)
    return value


def _stack(steps: list[Held], mesh_shape: tuple[int, ...]) -> Held:
    axes = tuple(any(s[1][i] for s in steps) for i in range(len(mesh_shape)))
    return torch.stack([_spread(s, axes, mesh_shape) for s in steps], sum(axes)), axes


def run_control_flow(
    gm: fx.GraphModule,
    node: fx.Node,
    env: dict[fx.Node, Any],
    execute: Execute,
    mesh_shape: tuple[int, ...],
) -> Any:
    """The held results of ``node`` (a list, or one value for a single-result op)."""
    kind = getattr(node.target, "_name", "")
    args: tuple[Any, ...] = node.args

    def body(a: fx.Node) -> fx.GraphModule:
        return getattr(gm, str(a.target))

    def held(xs: Any) -> list[Held]:
        return [env[a] for a in xs]

    if kind == "cond":
        branch = body(args[1] if _uniform(env[args[0]], node) else args[2])
        outs = execute(branch, held(args[3]))
    elif kind == "while_loop":
        cond_gm, body_gm = body(args[0]), body(args[1])
        carry, rest = held(args[2]), held(args[3])
        while _uniform(execute(cond_gm, [*carry, *rest])[0], node):
            carry = execute(body_gm, [*carry, *rest])
        outs = carry
    else:
        scan = kind == "scan"
        f = body(args[0])
        carry = held(args[1]) if scan else []
        xs = held(args[2] if scan else args[1])
        rest = held(args[3] if scan else args[2])
        value, axes = xs[0]
        length = value.shape[sum(axes)]
        steps: list[list[Held]] = []
        for t in range(length):
            step = execute(f, [*carry, *(_slice(x, t) for x in xs), *rest])
            carry, ys = step[: len(carry)], step[len(carry) :]
            steps.append(ys)
        if not steps:
            raise InternalError(f"{node.name}: a {kind} over 0 steps is not supported")
        outs = [*carry, *(_stack([s[j] for s in steps], mesh_shape) for j in range(len(steps[0])))]
    if node.users and all(u.target is operator.getitem for u in node.users):
        return outs
    return outs[0]  # a single-result op is its result (partition.control_flow)


def bind_bodies(gm: fx.GraphModule, bound: fx.GraphModule, bind: Callable[..., Any]) -> Any:
    """``bound`` (the DistributedMesh's copy of ``gm``) with each control-flow body of ``gm``
    bound too (``bind(body, 0, donate=False)``): its mesh ops call the executor as well."""
    for node in bound.graph.nodes:
        body = getattr(gm, str(node.target), None) if node.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            setattr(bound, str(node.target), bind(body, 0, donate=False))
    return bound
