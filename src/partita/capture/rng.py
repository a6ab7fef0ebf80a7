"""Random draws that replay an earlier one: what ``torch.utils.checkpoint`` recomputes.

Eagerly, ``checkpoint(block, x)`` saves the CPU generator's state before ``block`` and restores
it when the backward recomputes ``block``, so a dropout inside draws the *same* mask twice and
the gradient is the forward mask's. A trace runs on fake tensors: random ops never advance the
generator, the save and restore are invisible, and the recomputed dropout would be a second,
independent draw at run time: a silently wrong gradient.

So while tracing, every random op reads a key of the generator's state and moves the generator
on (deterministically from that state), as a real draw would. A draw traced with the state of
an earlier draw (checkpoint's recomputation, or ``torch.manual_seed`` twice with the same seed
inside the function) is that draw again: :func:`replay_draws` makes it read the earlier node.
The whole trace runs inside ``torch.random.fork_rng``, so the user's generator is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from partita.errors import CaptureError
from partita.ir import node_meta

__all__ = ["DrawKeys", "draws_from_values", "random_ops", "replay_draws", "tracing_rng"]

aten = torch.ops.aten

#: ATen random ops, by packet name (each overload with a ``Generator`` argument counts).
_RANDOM_PACKETS = (
    "bernoulli", "binomial", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "native_dropout", "normal", "poisson", "rand", "rand_like", "randint", "randint_like",
    "randn", "randn_like", "random", "randperm", "uniform", "_standard_gamma",
)  # fmt: skip


@functools.cache
def random_ops() -> frozenset[torch._ops.OpOverload]:
    """Overloads that draw from a generator and reach the tracer as one node (not the ones
    ``CompositeImplicitAutograd`` decomposes into other random ops)."""
    ops = set()
    for name in _RANDOM_PACKETS:
        packet = getattr(aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if not torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"
            ):
                ops.add(op)
    return frozenset(ops)


#: Random ops whose tensor operands give only a shape (and dtype), not values.
_SHAPE_ONLY = frozenset(
    {"cauchy", "exponential", "geometric", "log_normal", "random", "uniform", "rand_like",
     "randn_like"}
)  # fmt: skip


def draws_from_values(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s draw depends on its tensor operands' values (probabilities, means,
    counts), not only on their shapes: repeating such a draw needs the very same operands."""
    has_tensor = any("Tensor" in str(a.type) for a in op._schema.arguments)
    return has_tensor and not _shape_only(op)


def _shape_only(op: torch._ops.OpOverload) -> bool:
    name, overload = op._schema.name.removeprefix("aten::"), op._overloadname
    if name == "bernoulli":
        return overload in ("p", "float_out")
    if name == "randint_like":
        return not overload.startswith("Tensor")
    return name in _SHAPE_ONLY


class DrawKeys:
    """The generator-state key of each random op as it is traced, in trace order."""

    def __init__(self) -> None:
        self.keys: list[tuple[torch._ops.OpOverload, bytes]] = []

    def wrap(
        self, table: dict[torch._ops.OpOverload, Callable[..., Any]]
    ) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
        """``table`` (a make_fx decomposition table) with each random op recorded first."""
        out = dict(table)
        for op in random_ops():
            out[op] = functools.partial(self._draw, op, table.get(op))
        return out

    def _draw(
        self, op: torch._ops.OpOverload, decomposition: Callable[..., Any] | None, *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if decomposition is not None:  # the ops it decomposes into are recorded instead
            return decomposition(*args, **kwargs)
        with _disable_current_modes():
            state = torch.get_rng_state().numpy().tobytes()
        key = hashlib.blake2b(state, digest_size=16).digest()
        torch.default_generator.manual_seed(int.from_bytes(key[:8], "little"))
        self.keys.append((op, key))
        return NotImplemented  # traced as usual, as the next node


@contextlib.contextmanager
def tracing_rng() -> Iterator[None]:
    """The generator as the user left it, before and after tracing."""
    with torch.random.fork_rng(devices=[]):
        yield


def replay_draws(gm: fx.GraphModule, draws: DrawKeys, fn_name: str) -> None:
    """Replace each random node that replays an earlier draw (same generator state, same op,
    same arguments) by that draw's node, in place. Call it right after make_fx, before any
    pass adds or removes random nodes. A replay partita cannot reproduce is an error."""
    keys = [key for _, key in draws.keys]
    if len(set(keys)) == len(keys):
        return  # no draw replays another: nothing to do
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in random_ops()]
    if [n.target for n in nodes] != [op for op, _ in draws.keys]:
        raise _replay_error(fn_name, "the draws could not be matched to the traced ops")
    seen: dict[tuple[Any, ...], fx.Node] = {}
    first_of_key: dict[bytes, fx.Node] = {}
    for node, key in zip(nodes, keys, strict=True):
        signature = (key, node.target, *_arguments(node))
        first = seen.setdefault(signature, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
        elif first_of_key.setdefault(key, node) is not node:
            raise _replay_error(
                fn_name,
                f"{node.target} at {node_meta.source(node) or 'an unknown line'} replays "
                f"the draw of {first_of_key[key].target} with other arguments or inputs",
            )


def _replay_error(fn_name: str, why: str) -> CaptureError:
    return CaptureError(
        f"Cannot trace {fn_name!r}: a random op draws again with the generator state of an "
        f"earlier draw (torch.utils.checkpoint recomputing a block with dropout, or "
        f"torch.manual_seed with the same seed inside the function), and {why}, so partita "
        f"cannot make it repeat that draw as eager PyTorch does. Keep the random op out of the "
        f"checkpointed block (or make its input a value computed outside the block), or seed "
        f"outside the function."
    )


def _arguments(node: fx.Node) -> tuple[Any, ...]:
    """What a draw depends on besides the generator: its non-tensor arguments, the shape and
    dtype of tensor arguments that only give a shape, and the very node of those whose values
    matter (a recomputed value is another node: no match)."""
    shape_only = _shape_only(cast(torch._ops.OpOverload, node.target))  # a draw: an aten op
    out: list[Any] = []
    for a in (*node.args, *sorted(node.kwargs.items())):
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if shape_only and isinstance(val, torch.Tensor):  # strides: dropout draws in layout
            out.append((tuple(val.shape), val.stride(), val.dtype))
        else:
            out.append(a if isinstance(a, fx.Node) else repr(a))
    return tuple(out)
