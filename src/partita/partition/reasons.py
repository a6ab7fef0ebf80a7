"""The words of the Plan: why a value ended up partial, and what the alternative would cost.

A reduction a user did not write (an all_reduce after a matmul whose contracting dim is split)
is the most common surprise in a sharded program. When an op leaves its result partial, the
partitioner keeps a sentence saying which factor was split over which mesh axes, how large the
partial result is, and how much gathering the operands instead would have moved; the Plan's
record of the reducing collective quotes it with the op's source line. This module only writes
text.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partita.ir import node_meta
from partita.partition.lowering_api import LoweringAPI
from partita.partition.plan import format_bytes
from partita.report.explain import op_name
from partita.rules import FactorRule
from partita.values.layout import local_shape
from partita.values.spec import Sharding

__all__ = ["nbytes", "needs_why", "partial_reason"]


def partial_reason(
    low: LoweringAPI,
    key: tuple[fx.Node, int | None],
    node: fx.Node,
    rule: FactorRule,
    assign: dict[str, tuple[str, ...]],
    j: int,
) -> str | None:
    """Why result ``j`` of ``node`` is partial, in words, with what gathering would have cost;
    None when it is not partial."""
    v = low.values[key]
    summed = [f for f in rule.partial_factors(j) if assign.get(f)]
    if not summed:
        return None
    axes = [a for f in summed for a in assign[f]]
    reduce_bytes = nbytes(local_shape(v.sharding, v.shape), v.dtype)
    gathers: list[tuple[str, int]] = []
    operands = zip(low.operand_nodes(node), rule.operands, strict=True)
    for i, (operand, factors) in enumerate(operands):
        ov = low.value(operand)
        split = [
            d
            for d, dim in enumerate(factors or ())
            if any(f in summed for f in dim) and ov.sharding.dim_axes[d]
        ]
        if not split:
            continue  # this operand is only sliced locally, never gathered
        gathered = ov.sharding.with_dims(
            () if d in split else axes_ for d, axes_ in enumerate(ov.sharding.dim_axes)
        )
        dtype = str(ov.dtype).removeprefix("torch.")
        shape = list(local_shape(gathered, ov.shape))
        gathers.append((f"operand {i} {dtype}{shape}", nbytes(tuple(shape), ov.dtype)))
    verb = "contracts" if rule.reduction_factors else "sums over"
    shape = list(local_shape(v.sharding, v.shape))
    text = (
        f"{op_name(node.target)} (%{node.name}) {verb} {', '.join(summed)} split over "
        f"{', '.join(axes)}: each device works on its local slices and holds a partial "
        f"{rule.reduce_op} of the result {str(v.dtype).removeprefix('torch.')}{shape} "
        f"({format_bytes(reduce_bytes)})"
    )
    if gathers:
        alt = " and ".join(f"{n} ({format_bytes(b)})" for n, b in gathers)
        cheaper = reduce_bytes <= sum(b for _, b in gathers)
        text += (
            f"; reducing it moves less than gathering {alt}"
            if cheaper
            else f" (gathering {alt} would have moved less)"
        )
    return text


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def needs_why(node: fx.Node, i: int, dst: Sharding) -> str:
    """Why operand ``i`` of ``node`` is resharded to ``dst``, in words for the Plan."""
    if node_meta.replicated_reason(node) is not None:  # replicate_unsupported=True chose this
        return (
            f"{op_name(node.target)} (%{node.name}) runs replicated "
            f"(replicate_unsupported=True): {node_meta.replicated_reason(node)}"
        )
    return f"{op_name(node.target)} (%{node.name}) needs operand {i} as {dst}"
