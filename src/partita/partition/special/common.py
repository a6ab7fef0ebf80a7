"""Helpers the special handlers share: the tuple node of a multi-output op, reading a rule's
mesh axes for an operand dim, the recorded ``all_reduce``, padding masks and dtype casts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from partita.explain import op_name
from partita.partition.masks import emit_mask_padding
from partita.partition.plan import CollectiveRecord
from partita.rules import FactorRule
from partita.spec import Sharding

if TYPE_CHECKING:
    from partita.partition.lower import Lowering

__all__ = ["fake_value", "make_tuple", "mask_padding", "record_collective"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


def make_tuple(*xs: Any) -> tuple[Any, ...]:
    """The local result of a multi-output op built from several nodes (``getitem`` reads it)."""
    return tuple(xs)


def fake_value(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def axes_of(rule: FactorRule, tensor: int, dim: int, assign: Assign) -> tuple[str, ...]:
    factors = rule.operands[tensor]
    if factors is None:
        return ()
    return tuple(a for f in factors[dim] for a in assign.get(f, ()))


def operand_sharding(low: Lowering, rule: FactorRule, i: int, assign: Assign) -> Sharding:
    factors = rule.operands[i]
    assert factors is not None
    return Sharding(low.mesh, low.dims_of(factors, assign))


def recorded_all_reduce(
    low: Lowering,
    node: fx.Node,
    x: fx.Node,
    reduce_op: str,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    what: str,
) -> fx.Node:
    """Emit ``all_reduce(x)`` over ``axes`` and record it in the Plan."""
    n = low.mesh.axes_size(axes)
    out = low.call(torch.ops.partita.all_reduce.default, x, reduce_op, list(axes), n)
    why = f"{op_name(node.target)} (%{node.name}) with a sharded dim: {what}"
    record_collective(low, node, "all_reduce", axes, shape, dtype, what, why, f"{reduce_op}, {n}")
    return out


def record_collective(
    low: Lowering,
    node: fx.Node,
    kind: str,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    what: str,
    reason: str,
    detail: str,
) -> None:
    """Record in the Plan a collective a handler emitted for ``node`` (``what`` it moves,
    ``reason`` why), with the node's source line."""
    low.plan.collectives.append(
        CollectiveRecord(
            kind=kind,
            mesh_axes=tuple(axes),
            groups=tuple(tuple(g) for g in low.mesh.groups(axes)),
            shape=tuple(shape),
            dtype=dtype,
            value=f"{node.name}.{what.split()[0]}",
            reason=reason,
            source=node.meta.get("source"),
            detail=detail,
        )
    )


def mask_padding(
    low: Lowering, x: fx.Node, axes: tuple[str, ...], size: int, ndim: int, dim: int, fill: Any
) -> fx.Node:
    return emit_mask_padding(low.graph, x, low.mesh, axes, size, ndim, dim, fill)


def cast_to(low: Lowering, x: fx.Node, have: torch.dtype, want: torch.dtype) -> fx.Node:
    return x if have == want else low.call(aten._to_copy.default, x, dtype=want)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
