"""The ``global_random`` handler: random ops draw the *global* tensor on every device (the
``partita::global_random_draw`` custom op, same generator state everywhere) and keep this
device's tile."""

from __future__ import annotations

import json
from typing import Any, cast

import torch
import torch.fx as fx

from partita.errors import CompilerError, InternalError, UnsupportedOpError
from partita.ir.op_lookup import find_op, torch_constant
from partita.partition.emit import Emitter, Proxy, emitting, node_of
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.reshard import plan_reshard
from partita.partition.reshard_emit import emit_reshard
from partita.partition.special.common import Assign, aten, fake_value
from partita.report.explain import op_name
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.rules.random import GENERATOR_OVERLOADS, RANDOM_VALUE_OPS
from partita.values.spec import Sharding

__all__ = ["draw_target", "global_random_draw"]


# --- global_random -------------------------------------------------------------------------------

#: Random ops whose tensor operands' *values* matter (the others only give a shape).
_VALUE_OPERANDS = frozenset(RANDOM_VALUE_OPS)


#: Ops that make a tensor whose values nothing reads: a random op on one fills it.
_EMPTY_OPS = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_permuted.default,
    aten.empty_strided.default,
}


def _draw_op(node: fx.Node) -> str:
    """The aten op (``packet.overload``) that draws ``node``'s numbers as eager does.

    Eager dropout is ``empty_like(x).bernoulli_(p)``: it fills ``x``'s memory layout in memory
    order. Functionalization turns it into ``bernoulli.p``, whose kernel returns a contiguous
    tensor filled in *logical* order: for a permuted ``x`` (``nn.TransformerEncoderLayer``'s
    attention output) every mask element lands elsewhere. The in-place draw on an empty tensor
    of ``x``'s strides is eager's. (The other functional random ops keep their input's layout.)
    """
    op = str(node.target).removeprefix("aten.")
    if op in GENERATOR_OVERLOADS:  # generator=None: the global generator, as the plain overload
        return GENERATOR_OVERLOADS[op]
    first = node.args[0] if node.args else None
    if (
        node.target == aten.bernoulli.p
        and isinstance(first, fx.Node)
        and first.target in _EMPTY_OPS
    ):
        return "bernoulli_.float"
    return op


def _encode(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, (list, tuple)):
        return [_encode(x) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    raise UnsupportedOpError(f"global_random cannot pass the argument {a!r} to a random op")


def _decode(a: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(a, list):
        return [_decode(x, inputs) for x in a]
    if not isinstance(a, dict):
        return a
    if "tensor" in a:
        return inputs[a["tensor"]]
    if "like" in a:  # only its shape, strides and dtype matter
        shape, stride, dtype = a["like"]
        return torch.empty_strided(shape, stride, dtype=_constant(dtype["dtype"]))
    if "device" in a:
        return torch.device(a["device"])
    ((_kind, name),) = a.items()
    return _constant(name)


def _constant(name: Any) -> Any:
    """A dtype, layout or memory format by its exact name (never another torch attribute)."""
    value = torch_constant(name, (torch.dtype, torch.layout, torch.memory_format))
    if value is None:
        raise CompilerError(
            f"partita::global_random_draw: {name!r} is not a torch dtype, layout or memory "
            f"format (its arguments are not what partita wrote); {CompilerError.WORKAROUND}"
        )
    return value


def draw_target(op: Any) -> torch._ops.OpOverload | None:
    """The aten op a draw names (``"packet.overload"``), found by exact name, or None."""
    parts = op.split(".") if isinstance(op, str) else []
    return find_op("aten", parts[0], parts[1], ("aten",)) if len(parts) == 2 else None


def _run_draw(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    target = draw_target(op)
    if target is None:
        raise CompilerError(
            f"partita::global_random_draw: {op!r} is not an aten op named 'packet.overload' "
            f"(the program is not what partita wrote); {CompilerError.WORKAROUND}"
        )
    spec = json.loads(args)
    out = target(
        *_decode(spec["args"], inputs), **{k: _decode(v, inputs) for k, v in spec["kwargs"].items()}
    )
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o.clone() if any(o is i for i in inputs) else o for o in outs]


@torch.library.custom_op("partita::global_random_draw", mutates_args=())
def global_random_draw(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    """Run the random aten op ``op`` on *global* arguments (JSON; ``{"like": [shape, stride,
    dtype]}`` stands for a tensor whose values the op ignores, ``{"tensor": i}`` for
    ``inputs[i]``). Every device runs it with the same generator state, so all hold the same
    global draw. Not tagged nondeterministic: an executor runs it like any local op (once per
    program run when its inputs are the same on every device)."""
    return _run_draw(inputs, op, args)


@global_random_draw.register_fake
def _(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    return _run_draw(inputs, op, args)


def _random_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return True  # even replicated: the executor runs the wrapped draw, never a raw random op


@emitting
def _random_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """Draw the global tensor(s) and keep this device's tile (docs/rules.md, random numbers)."""
    low, target = e.low, node.target
    if target == aten.native_dropout.default and node.args[2] is False:
        (x,) = e.operands(rule, assign)
        return e.tuple(x.clone(), torch.ones_like(x, dtype=torch.bool))
    inputs: list[Proxy] = []

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = fake_value(a)
            if target in _VALUE_OPERANDS:
                dst = Sharding.replicated(low.mesh, v.ndim)
                why = f"{op_name(target)} (%{node.name}) draws from the global tensor"
                inputs.append(e(low.reshard(low.key(a), dst, why, node)))
                return {"tensor": len(inputs) - 1}
            return {"like": [list(v.shape), list(v.stride()), _encode(v.dtype)]}
        return _encode(a)

    op = _draw_op(node)
    # generator=None is the global generator (a torch.Generator object is refused by lower.py)
    kwargs = {k: v for k, v in node.kwargs.items() if k != "generator"}
    spec = {"args": [enc(a) for a in node.args], "kwargs": {k: enc(v) for k, v in kwargs.items()}}
    draw = e.call(torch.ops.partita.global_random_draw.default, inputs, op, json.dumps(spec))
    vals = node.meta["val"]
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    shardings = low.result_shardings(rule, assign)
    tiles = []
    for j, (v, s) in enumerate(zip(vals, shardings, strict=True)):
        whole = draw[j]
        if s is None:
            tiles.append(whole)
            continue
        steps = plan_reshard(Sharding.replicated(low.mesh, v.ndim), s, tuple(v.shape))
        # Slicing a replicated value is local (a size-1 mesh axis plans nothing at all).
        if any(step.is_collective for step in steps):
            raise InternalError(
                f"global_random at node {node.name!r}: slicing the replicated draw to {s} "
                f"planned collectives {steps}. {InternalError.REPORT}"
            )
        tiles.append(e(emit_reshard(low.graph, node_of(whole), steps, low.mesh)))
    if target == aten.native_dropout.default:  # out = x * mask * scale, as the CPU kernel
        (x,) = e.operands(rule, assign)
        p1m = 1.0 - float(cast(float, node.args[1]))  # native_dropout(x, p, train)
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        tiles[0] = x * aten._to_copy.default(tiles[1], dtype=vals[0].dtype) * scale
    return tiles[0] if len(tiles) == 1 else e.tuple(*tiles)


register(Handler(HandlerName.GLOBAL_RANDOM.value, _random_applies, _random_lower))
