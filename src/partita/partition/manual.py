"""Lower the manual (``shard_map``) regions of a program: their bodies are copied verbatim.

A region's body was traced on local blocks, so every device runs it as written. Its
boundaries (``partita.capture.manual``) become plain wiring: an entry reshards its global operand
to the region's in_spec (a no-op when propagation already gave it that sharding) and hands the
local node to the body; an exit turns the body's local node into a global value with the
out_spec's sharding. A body op that reads a global value (a tensor the body closed over) reads
it replicated: every device sees the whole value, as the body's code expects.

The mesh ops a body calls (``partita.psum`` and the others lower to ``partita.ir.collectives``
directly at capture) are recorded in the Plan as the user's own collectives. This module does
not check specs (``partita.manual`` did, at trace time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita.capture.manual import ENTER_OP, Boundary, boundary
from partita.errors import ShardMapError, ShardMapWarning, warn
from partita.ir import node_meta
from partita.ir.collectives import COLLECTIVE_OPS
from partita.partition.lowering_api import LoweringAPI
from partita.partition.plan import CollectiveRecord
from partita.partition.resharding import LocalValue
from partita.values.layout import local_shape
from partita.values.spec import Sharding

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


def _local_arg(low: LoweringAPI, node: fx.Node, a: Any) -> Any:
    if not isinstance(a, fx.Node):
        return a
    if a in low.manual:
        return low.manual[a]
    if not isinstance(a.meta.get("val"), torch.Tensor):
        return a
    v = low.value(a)
    why = f"%{node.name} in a shard_map body reads %{a.name} whole (it closes over it)"
    return low.reshard(low.key(a), Sharding.replicated(low.mesh, len(v.shape)), why, node)


def _crossing(node: fx.Node) -> tuple[fx.Node, Boundary]:
    """An enter or exit node's value and boundary: ``enter(x, key)``, ``exit(x, key)``."""
    return cast(fx.Node, node.args[0]), boundary(cast(int, node.args[1]))


def lower_local(low: LoweringAPI, node: fx.Node) -> None:
    """Emit a node of a region body (or an entry) on this device."""
    if node.target is ENTER_OP:
        x, b = _crossing(node)
        why = f"shard_map {b.what} enters its region as {b.sharding}"
        low.manual[node] = low.reshard(low.key(x), b.sharding, why, node)
        return
    args, kwargs = pytree.tree_map(
        lambda a: _local_arg(low, node, a), (tuple(node.args), dict(node.kwargs))
    )
    local = low.graph.call_function(cast(Callable[..., Any], node.target), tuple(args), kwargs)
    local.meta["val"] = node.meta.get("val")
    low.manual[node] = local
    record_user_collective(low, node)


def lower_exit(low: LoweringAPI, node: fx.Node) -> None:
    """An exit: the body's local node is the global value's local block."""
    src, b = _crossing(node)
    if src not in low.manual:
        raise ShardMapError(
            f"shard_map {b.what} (node %{node.name}) leaves a region but its value "
            f"%{src.name} was not computed inside one; return a value the body computed."
        )
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(low.manual[src], b.sharding, tuple(val.shape), val.dtype)


def record_user_collective(low: LoweringAPI, node: fx.Node, split: Sharding | None = None) -> None:
    """Record ``node`` in the Plan if it is a collective (one the user wrote in a body);
    ``split``: how a partially manual body splits the block it moves (auto axes)."""
    if node.target not in _KINDS:
        return
    kind = _KINDS[node.target]
    args: tuple[Any, ...] = node.args  # (x, ..., mesh_axes[, group size]) of the collective
    axes = tuple(args[-1] if kind == "collective_permute" else args[-2])
    moved: fx.Node = args[0] if kind == "reduce_scatter" else node
    val = moved.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    if split is not None and shape:  # partially manual: the block is split further
        shape = local_shape(split, shape)
    detail = ""
    if kind == "collective_permute":  # "from->to" positions along the axes, as halos say it
        groups = low.mesh.groups(axes)
        at = {int(d): i for g in groups for i, d in enumerate(g)}
        flat = [int(d) for d in args[1]]
        first = {int(d) for d in groups[0]}
        detail = " ".join(
            f"{at[a]}->{at[b]}" for a, b in zip(flat[::2], flat[1::2], strict=True) if a in first
        )
    low.plan.collectives.append(
        CollectiveRecord(
            kind=kind,
            mesh_axes=axes,
            groups=low.mesh.device_groups(axes),
            shape=shape,
            dtype=val.dtype if isinstance(val, torch.Tensor) else torch.float32,
            value=node.name,
            reason=f"{USER_COLLECTIVE} ({math.prod(shape)} elements)",
            source=node_meta.source(node),
            detail=detail,
        )
    )


# --- partially manual regions: the auto axes were propagated through the body -----------------


#: An auto split a boundary cannot keep: (dim, the dim's auto axes, the ones dropped, the
#: number of devices of the first split that does not divide the block).
_Dropped = tuple[int, tuple[str, ...], tuple[str, ...], int]


def _inner(low: LoweringAPI, b: Boundary, sharding: Sharding) -> tuple[Sharding, list[_Dropped]]:
    """How the body splits a block of boundary ``b`` over the auto axes: ``sharding`` (the body
    side's, from propagation) without partial axes, on the tiles the global value can hold; and
    the splits it could not keep.

    On a dim the region's spec does not split, the block's dim is the global dim, so the body's
    tiles (uneven ones too, zero padded as everywhere in partita) are the global value's tiles:
    the auto axes are kept. On a dim the spec splits over manual axes, an auto axis that does
    not divide the block would pad each block, and padded blocks do not line up with the global
    value's tiles: the axis is dropped at the boundary (the value is resharded there).
    """
    dims: list[tuple[str, ...]] = []
    dropped: list[_Dropped] = []
    for d, (axes, n, manual) in enumerate(
        zip(sharding.dim_axes, b.local_shape, b.sharding.dim_axes, strict=True)
    ):
        kept: tuple[str, ...] = ()
        for a in axes:
            k = low.mesh.axes_size((*kept, a))
            if manual and n % k:
                dropped.append((d, axes, axes[len(kept) :], k))
                break
            kept = (*kept, a)
        dims.append(kept)
    return Sharding(low.mesh, tuple(dims)), dropped


def _warn_dropped(
    low: LoweringAPI,
    b: Boundary,
    node: fx.Node,
    dropped: list[_Dropped],
    records: list[CollectiveRecord],
) -> None:
    """A :class:`ShardMapWarning` per dropped auto split: the value, why, the collectives it
    cost at this boundary (``records``) and the fix."""
    source = node_meta.source(node) or "an unknown line"
    moved = ", ".join(f"{r.kind} over {r.mesh_axes} of {r.bytes} bytes" for r in records)
    cost = f"here {moved} per device" if moved else "here no collective (a local slice)"
    for d, auto, lost, k in dropped:
        n = b.local_shape[d]
        manual = b.sharding.dim_axes[d]
        warn(
            ShardMapWarning(
                f"shard_map {b.what} (%{node.name}, {source}): propagation splits dim {d} of "
                f"its [{', '.join(map(str, b.local_shape))}] block over {auto} inside the "
                f"region, but {k} devices do not divide {n}, and the region's spec "
                f"{b.sharding} splits that dim over {manual}: padded blocks would not line up "
                f"with the tiles of the global {list(b.global_shape)} value, so it crosses "
                f"the boundary whole over {lost}. That costs {cost} (see the Plan), and a "
                f"reshard wherever the program outside wants it split over {lost}. To avoid "
                f"it, make dim {d} a multiple of {low.mesh.axes_size(manual) * k} (pad it), "
                f"or shard another dim over {lost}."
            )
        )


def lower_partial_enter(low: LoweringAPI, node: fx.Node) -> None:
    """Entering a partially manual region: the operand's tile is the spec's manual split then
    the body value's auto split, manual axes major."""
    x, b = _crossing(node)
    inner, dropped = _inner(low, b, node_meta.value_sharding(node))
    dims = tuple(m + a for m, a in zip(b.sharding.dim_axes, inner.dim_axes, strict=True))
    why = f"shard_map {b.what} enters its region as {b.sharding} (then {inner} inside)"
    before = len(low.plan.collectives)
    local = low.reshard(low.key(x), Sharding(low.mesh, dims), why, node)
    if dropped:
        _warn_dropped(low, b, node, dropped, low.plan.collectives[before:])
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(local, inner, b.local_shape, val.dtype)
    low.settle_result((node, None), node_meta.single_sharding(node), node)


def lower_partial_exit(low: LoweringAPI, node: fx.Node) -> None:
    """Leaving a partially manual region: the inverse of :func:`lower_partial_enter`."""
    src, b = _crossing(node)
    v = low.value(src)
    inner, dropped = _inner(low, b, v.sharding)
    why = f"shard_map {b.what} leaves its region as {b.sharding}"
    before = len(low.plan.collectives)
    local = low.reshard(low.key(src), inner, why, node)
    if dropped:
        _warn_dropped(low, b, node, dropped, low.plan.collectives[before:])
    dims = tuple(m + a for m, a in zip(b.sharding.dim_axes, inner.dim_axes, strict=True))
    val = node.meta["val"]
    low.values[(node, None)] = LocalValue(
        local, Sharding(low.mesh, dims), tuple(val.shape), val.dtype
    )
    low.settle_result((node, None), node_meta.single_sharding(node), node)
