"""The prices of the choice space: per candidate its compute and op-internal collectives, per
(value, sharding it has, sharding a user needs) the exact reshard the partitioner would emit.

The reshard's steps come from ``partition.reshard.plan_reshard``, the planner the partitioner
runs, so a reshard is priced as exactly the collectives it becomes; each collective's reported
bytes follow the Plan's convention (output bytes; input bytes for a reduce_scatter) and are
turned into seconds (``Hardware.collective_seconds``) or wire bytes (``cost.wire_bytes``).
Compute is the roofline time (``Hardware.op_seconds``, the Plan estimate's) of the op's FLOPs
divided by the devices that split it and of the bytes one device reads and writes; a view
computes nothing. A collective of a parameter or its gradient is bucketed by the partitioner:
it pays its bandwidth and its bytes' share of one call's fixed cost (latency and per-call
overhead) in a bucket of ``bucket_bytes`` or of all the parameters' bytes when they are fewer
(an approximation: the Plan's buckets follow the program's order, see docs/auto.md). A slice
or cat of a split dim pays the collective_permute rounds ``partition.retile`` plans for it.
A softmax over a split dim pays its handler's all_reduces (the max and the sum; the backward:
the sum) of the rows' statistics. A training batch norm with a split batch or spatial dim
pays its handler's all_reduce of the per-channel sums (forward and backward). A windowed
op's halo exchanges are priced as its handler emits them (``auto.halos``). A handler's
other op-internal collectives (a loss's scalars, a scan's carries: ``_INTERNAL``) are
priced as a few collectives of the local result over the axes of the op's split factors that
are not summed (a summed factor's reduction is priced where its partial result is reduced):
a model of them, not their exact lowering. The reshards are planned once
per signature (``auto.moves``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from partita.auto.halos import halo_sends
from partita.auto.moves import collectives
from partita.cost import Hardware, link_of, node_bytes, node_flops, wire_bytes
from partita.cost.model import ring_steps
from partita.partition.retile import Segment, plan_retile_many, retile_dim, slice_start
from partita.partition.special.common import acc_dtype
from partita.rules import FactorKind, FactorRule
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["Pricer"]

_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    found = _ITEMSIZE.get(dtype)
    if found is None:
        found = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return found


#: Handlers that emit collectives inside their op when a reduction or windowed factor is split:
#: (collective kind, how many) over the axes of those factors, each on the result reduced
#: over those factors (a softmax's max and sum, a loss's two scalars, a scan's carries). A
#: softmax's, a batch norm's and a halo's are priced exactly (``Pricer._softmax``,
#: ``Pricer._batch_stats``, ``Pricer._halo``): not by this model.
_INTERNAL: dict[str, tuple[str, int]] = {
    "softmax_reduce": ("all_reduce", 2),
    "weighted_mean": ("all_reduce", 1),
    "sharded_scan": ("all_gather", 1),
}


class Pricer:
    """Prices in microseconds (``objective="time"``: numbers near 1 keep the solver's
    tolerances meaningful) or wire bytes (``"bytes"``), memoised."""

    def __init__(
        self,
        mesh: Mesh,
        hardware: Hardware,
        objective: str,
        bucket_bytes: int = 4 << 20,
        stored_bytes: float = 0.0,
    ) -> None:
        self.mesh = mesh
        self.hw = hardware
        self.bytes = objective == "bytes"
        self.bucket_bytes = bucket_bytes
        #: the bytes one bucket call carries: ``bucket_bytes``, or all the parameters' bytes
        #: when they are fewer (a program whose gradients fit in one bucket makes one call)
        self.bucket_fill = float(min(bucket_bytes, stored_bytes or bucket_bytes))
        #: the price of one stored byte per device: it only breaks ties between equal plans
        self.per_stored_byte = 1e-6 if self.bytes else 1e-8
        self._reshard: dict[
            tuple[Sharding, Sharding, tuple[int, ...], torch.dtype, bool], float
        ] = {}

    def collective(
        self,
        kind: str,
        nbytes: float,
        axes: Sequence[str],
        bucketed: bool = False,
        compute_before: float | None = None,
    ) -> float:
        """A collective's price; ``bucketed``: it is fused with others of its kind into calls
        of ``bucket_bytes`` (a parameter's gather, a gradient's reduction), so it pays its
        share of one call's latency.

        Its call overhead is the step estimate's (``Hardware.call_seconds``): it grows with the
        compute since the previous launch up to the profile's ``call_window``. The solver does
        not know the per-device program's order, so it prices each call at the compute it
        can place (``compute_before``): an op-internal collective after its op's own compute
        (what it reduces is that op's local result); a parameter's gather (a ``bucketed``
        all_gather) after none (the runtime launches the step's gathers at its start, one
        right behind the other); any other (None: a reshard of an activation or a gradient,
        a halo, a re-tiling permute) the whole overhead, as the estimate charges a call whose
        place it does not know. So a call pays at most what the estimate charges it but for
        the step's first gather, and a reshard that follows little compute (in a small model,
        most of them) is overcharged; see docs/auto.md."""
        if self.bytes:
            return wire_bytes(kind, nbytes, self.mesh.axes_size(axes))
        if bucketed and kind == "all_gather":
            compute_before = 0.0  # launched at the step's start, right behind the previous
        seconds = self.hw.collective_seconds(kind, nbytes, self.mesh, tuple(axes), compute_before)
        if bucketed and self.bucket_bytes:
            n = self.mesh.axes_size(axes)
            fixed = ring_steps(kind, n) * link_of(self.hw, self.mesh, axes).latency
            overhead = self.hw.call_seconds(compute_before)
            fixed = fixed * self.hw.collective_scale.get(kind, 1.0) + overhead
            seconds -= fixed * (1.0 - min(1.0, nbytes / self.bucket_fill))
        return seconds * 1e6

    def reshard(
        self,
        src: Sharding,
        dst: Sharding,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        bucketed: bool = False,
    ) -> float:
        """The price of moving a value of ``shape`` from ``src`` to ``dst``."""
        if src == dst:
            return 0.0
        key = (src, dst, shape, dtype, bucketed)
        found = self._reshard.get(key)
        if found is None:
            size = _itemsize(dtype)
            found = 0.0
            first = bucketed
            for kind, axes, elems in collectives(src, dst, shape):
                # only the first collective reads the parameter (or gradient) itself: a later
                # step waits for it and is not ready with the others, so it is not fused
                found += self.collective(kind, elems * size, axes, first)
                first = False
            self._reshard[key] = found
        return found

    def local_bytes(self, s: Sharding, shape: tuple[int, ...], dtype: torch.dtype) -> float:
        """Per-device bytes of a value of ``shape`` stored as ``s``."""
        shards = self.mesh.axes_size([a for d in s.dim_axes for a in d])
        return math.prod(shape) * _itemsize(dtype) / shards

    def op(
        self,
        node: fx.Node,
        rule: FactorRule,
        assigns: Sequence[dict[str, tuple[str, ...]]],
        local_bytes: Sequence[float],
    ) -> tuple[list[float], list[float]]:
        """Per candidate: (the price the objective counts, the modelled compute in us).

        Compute is the roofline of the op's FLOPs over the devices that split it and of the
        bytes one device reads and writes (``local_bytes``: a replicated operand is read
        whole on every device)."""
        # a view, getitem or mesh op computes nothing (``cost.node_bytes`` is 0, as the Plan's
        # estimate counts it): no FLOPs and no bytes
        active = bool(node_bytes(node))
        flops = node_flops(node) if active else 0
        val = node.meta.get("val")
        out = val[0] if isinstance(val, (tuple, list)) else val
        out_bytes = out.numel() * _itemsize(out.dtype) if isinstance(out, torch.Tensor) else 0
        prices, computes = [], []
        for assign, nbytes in zip(assigns, local_bytes, strict=True):
            axes = [a for fa in assign.values() for a in fa]
            shards = self.mesh.axes_size(axes)
            compute = self.hw.op_seconds(flops / shards, nbytes) * 1e6 if active else 0.0
            internal = self._internal(rule, assign, out_bytes / shards, compute * 1e-6)
            if rule.handler == "softmax_reduce":
                internal += self._softmax(node, rule, assign, out, shards, compute * 1e-6)
            if rule.handler == "retile":
                internal += self._retile(node, rule, assign, out)
            if rule.handler == "batch_stats":
                internal += self._batch_stats(node, rule, assign, compute * 1e-6)
            if rule.handler == "halo":
                internal += self._halo(node, rule, assign)
            prices.append(internal if self.bytes else compute + internal)
            computes.append(compute)
        return prices, computes

    def _retile(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]], out: Any
    ) -> float:
        """A slice's, cat's or slice_scatter's re-tiling of a split dim: the collective_permute
        rounds ``partition.retile`` plans for it, each of its widest piece. The slices of
        one value along one dim are planned together, as the partitioner does (q, k and v
        share rounds), and each pays an equal share of the rounds (exact when they all split
        the dim on the same axes, as a plan does)."""
        if not isinstance(out, torch.Tensor) or not rule.results or rule.results[0] is None:
            return 0.0
        dim = retile_dim(node)
        axes = tuple(a for f in rule.results[0][dim] for a in assign.get(f, ()))
        if not axes:
            return 0.0
        n_out = int(out.shape[dim])
        if str(node.target).startswith(("aten.cat", "aten.slice_scatter")):
            if str(node.target).startswith("aten.cat"):
                vals = [a.meta["val"] for a in cast(Sequence[fx.Node], node.args[0])]
                sizes = [int(v.shape[dim]) if v.ndim == out.ndim else 0 for v in vals]
                segments = [Segment(sum(sizes[:i]), i, 0, n) for i, n in enumerate(sizes)]
            else:
                m = int(cast(fx.Node, node.args[1]).meta["val"].shape[dim])
                st = slice_start(node, 3, n_out)
                sizes = [n_out, m]
                parts = [
                    Segment(0, 0, 0, st), Segment(st, 1, 0, m),
                    Segment(st + m, 0, st + m, n_out - st - m),
                ]  # fmt: skip
                segments = [p for p in parts if p.length]
            outputs = [(segments, n_out)]
        else:  # the slices of one value along one dim share their rounds (q, k and v)
            source = cast(fx.Node, node.args[0])
            n = int(source.meta["val"].shape[dim])
            sizes, outputs = [n], []
            for u in source.users:
                if u.target == node.target and u.args[0] is source and retile_dim(u) == dim:
                    m = int(u.meta["val"].shape[dim])
                    outputs.append(([Segment(0, 0, slice_start(u, 2, n), m)], m))
        k = self.mesh.axes_size(axes)
        rounds = plan_retile_many(k, sizes, outputs).rounds
        others = self.mesh.axes_size([a for fa in assign.values() for a in fa if a not in axes])
        row = out.numel() / max(1, n_out) / others * _itemsize(out.dtype)
        share = 1.0 / len(outputs)  # each slice pays its share of the shared rounds
        return share * sum(
            self.collective("collective_permute", r.width * row, axes) for r in rounds
        )

    def _softmax(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]], out: Any,
        shards: int, compute: float,
    ) -> float:  # fmt: skip
        """A softmax over a split dim (its factor passes through): the partitioner's handler
        all_reduces the max and the sum of the local rows (the backward: one sum), each of
        the result's size with that dim reduced, after the op's own ``compute`` seconds."""
        dim = _dim_arg(node)
        if dim is None or not isinstance(out, torch.Tensor) or not rule.results[0]:
            return 0.0
        d = int(dim) % out.ndim
        axes = [a for f in rule.results[0][d] for a in assign.get(f, ())]
        if not axes:
            return 0.0
        local_dim = out.shape[d] / self.mesh.axes_size(axes)
        reduced = out.numel() * _itemsize(out.dtype) / shards / max(1.0, local_dim)
        count = 1 if "backward" in str(node.target) else 2
        return count * self.collective("all_reduce", reduced, axes, compute_before=compute)

    def _batch_stats(
        self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]], compute: float
    ) -> float:
        """A training batch norm whose batch or spatial dims are split (they pass through):
        the partitioner's SyncBatchNorm (``partition.special.batchnorm``) all-reduces one
        ``(2, local channels)`` tensor over their axes, the forward its sums and sums of
        squares in float64, the backward its sums of ``dy`` and ``dy * (x - mean)`` in the
        input's accumulation dtype (float32 for a half input)."""
        backward = str(node.target).startswith("aten.native_batch_norm_backward")
        x = 1 if backward else 0
        factors = rule.operands[x]
        if factors is None:
            return 0.0
        axes: list[str] = []
        for d, dim in enumerate(factors):
            if d != 1:
                axes += [a for f in dim for a in assign.get(f, ()) if a not in axes]
        if not axes:
            return 0.0
        val = cast(fx.Node, node.args[x]).meta["val"]
        by = self.mesh.axes_size([a for f in factors[1] for a in assign.get(f, ())])
        channels = -(-int(val.shape[1]) // by)
        dtype = acc_dtype(val.dtype) if backward else torch.float64
        nbytes = 2 * channels * _itemsize(dtype)
        return self.collective("all_reduce", nbytes, axes, compute_before=compute)

    def _halo(self, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]]) -> float:
        """A windowed op's halo exchanges (``auto.halos``), each before the op computes."""
        return sum(
            self.collective("collective_permute", nbytes, axes)
            for nbytes, axes in halo_sends(self.mesh, node, rule, assign)
        )

    def _internal(
        self,
        rule: FactorRule,
        assign: dict[str, tuple[str, ...]],
        local_out: float,
        compute: float | None = None,
    ) -> float:
        """The handler's op-internal collectives under ``assign`` (a model, see the module),
        each after the op's own ``compute`` seconds (its local result is what they reduce)."""
        found = _INTERNAL.get(rule.handler or "")
        if found is None:
            return 0.0
        kind, count = found
        # a summed factor leaves its results partial: their reduction is priced on the edge
        summed = {f for j in range(len(rule.results)) for f in rule.partial_factors(j)}
        split = [
            f for f in assign if rule.kind(f) is not FactorKind.PASS_THROUGH and f not in summed
        ]
        axes = [a for f in split for a in assign[f]]
        if not axes:
            return 0.0
        reduced = local_out
        for f in split:
            reduced /= max(1.0, rule.sizes[f] / self.mesh.axes_size(assign[f]))
        return count * self.collective(kind, reduced, axes, compute_before=compute)


def _dim_arg(node: fx.Node) -> Any:
    """The node's ``dim`` argument (by keyword or by its schema's position), or None."""
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dim" in names and names.index("dim") < len(node.args):
        return node.args[names.index("dim")]
    return None
