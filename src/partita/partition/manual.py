"""Lower the manual (``shard_map``) regions of a program: their bodies are copied verbatim.

A region's body was traced on local blocks, so every device runs it as written. Its
boundaries (``partita.capture.manual``) become plain wiring: an entry reshards its global operand
to the region's in_spec (a no-op when propagation already gave it that sharding) and hands the
local node to the body; an exit turns the body's local node into a global value with the
out_spec's sharding. A body op that reads a global value (a tensor the body closed over) reads
it replicated: every device sees the whole value, as the body's code expects.

The mesh ops a body calls (``partita.psum`` and the others lower to ``partita.collectives``
directly at capture) are recorded in the Plan as the user's own collectives. This module does
not check specs (``partita.manual`` did, at trace time).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.capture.manual import ENTER_OP, boundary
from partita.collectives import COLLECTIVE_OPS
from partita.errors import ShardMapError
from partita.layout import local_shape
from partita.partition.plan import CollectiveRecord
from partita.partition.resharding import LocalValue
from partita.spec import Sharding

if TYPE_CHECKING:
    from partita.partition.lower import Lowering

__all__ = [
    "USER_COLLECTIVE",
    "lower_exit",
    "lower_local",
    "lower_partial_enter",
    "lower_partial_exit",
    "record_user_collective",
]

#: How the Plan's reason of a collective written in a shard_map body starts.
USER_COLLECTIVE = "written in a shard_map body"

_KINDS = {op: op.name().split("::")[1] for op in COLLECTIVE_OPS}


def _local_arg(low: Lowering, node: fx.Node, a: Any) -> Any:
    if not isinstance(a, fx.Node):
        return a
    if a in low.manual:
        return low.manual[a]
    if not isinstance(a.meta.get("val"), torch.Tensor):
        return a
    v = low.value(a)
    why = f"%{node.name} in a shard_map body reads %{a.name} whole (it closes over it)"
    return low.reshard(low.key(a), Sharding.replicated(low.mesh, len(v.shape)), why, node)


def lower_local(low: Lowering, node: fx.Node) -> None:
    """Emit a node of a region body (or an entry) on this device."""
    if node.target is ENTER_OP:
        b = boundary(node.args[1])
        why = f"shard_map {b.what} enters its region as {b.sharding}"
        low.manual[node] = low.reshard(low.key(node.args[0]), b.sharding, why, node)
        return
    args, kwargs = pytree.tree_map(
        lambda a: _local_arg(low, node, a), (tuple(node.args), dict(node.kwargs))
    )
    local = low.graph.call_function(node.target, tuple(args), kwargs)
    local.meta["val"] = node.meta.get("val")
    low.manual[node] = local
    record_user_collective(low, node)


def lower_exit(low: Lowering, node: fx.Node) -> None:
    """An exit: the body's local node is the global value's local block."""
    b = boundary(node.args[1])
    src = node.args[0]
    if src not in low.manual:
        raise ShardMapError(
            f"shard_map {b.what} (node %{node.name}) leaves a region but its value "
            f"%{src.name} was not computed inside one; return a value the body computed."
        )
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(low.manual[src], b.sharding, tuple(val.shape), val.dtype)


def record_user_collective(low: Lowering, node: fx.Node, split: Sharding | None = None) -> None:
    """Record ``node`` in the Plan if it is a collective (one the user wrote in a body);
    ``split``: how a partially manual body splits the block it moves (auto axes)."""
    if node.target not in _KINDS:
        return
    kind = _KINDS[node.target]
    axes = tuple(node.args[-1] if kind == "collective_permute" else node.args[-2])
    moved = node.args[0] if kind == "reduce_scatter" else node
    val = moved.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    if split is not None and shape:  # partially manual: the block is split further
        shape = local_shape(split, shape)
    low.plan.collectives.append(
        CollectiveRecord(
            kind=kind,
            mesh_axes=axes,
            groups=tuple(tuple(g) for g in low.mesh.groups(axes)),
            shape=shape,
            dtype=val.dtype if isinstance(val, torch.Tensor) else torch.float32,
            value=node.name,
            reason=f"{USER_COLLECTIVE} ({math.prod(shape)} elements)",
            source=node.meta.get("source"),
            detail="",
        )
    )


# --- partially manual regions: the auto axes were propagated through the body -----------------


def _even(low: Lowering, sharding: Sharding, shape: tuple[int, ...]) -> Sharding:
    """``sharding`` without partial axes and keeping, per dim, the axes that split ``shape``
    evenly: a block that is itself padded would not line up with the global value's tiles."""
    dims = []
    for axes, n in zip(sharding.dim_axes, shape, strict=True):
        kept: tuple[str, ...] = ()
        for a in axes:
            if n % (low.mesh.axes_size((*kept, a))):
                break
            kept = (*kept, a)
        dims.append(kept)
    return Sharding(low.mesh, tuple(dims))


def lower_partial_enter(low: Lowering, node: fx.Node) -> None:
    """Entering a partially manual region: the operand's tile is the spec's manual split then
    the body value's auto split, manual axes major."""
    b = boundary(node.args[1])
    inner = _even(low, node.meta["sharding"], b.local_shape)
    dims = tuple(m + a for m, a in zip(b.sharding.dim_axes, inner.dim_axes, strict=True))
    why = f"shard_map {b.what} enters its region as {b.sharding} (then {inner} inside)"
    local = low.reshard(low.key(node.args[0]), Sharding(low.mesh, dims), why, node)
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(local, inner, b.local_shape, val.dtype)
    low.settle_result((node, None), node.meta["sharding"], node)


def lower_partial_exit(low: Lowering, node: fx.Node) -> None:
    """Leaving a partially manual region: the inverse of :func:`lower_partial_enter`."""
    b = boundary(node.args[1])
    src = node.args[0]
    v = low.value(src)
    inner = _even(low, v.sharding, b.local_shape)
    why = f"shard_map {b.what} leaves its region as {b.sharding}"
    local = low.reshard(low.key(src), inner, why, node)
    dims = tuple(m + a for m, a in zip(b.sharding.dim_axes, inner.dim_axes, strict=True))
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(
        local, Sharding(low.mesh, dims), tuple(val.shape), val.dtype
    )
    low.settle_result((node, None), node.meta.get("sharding"), node)
