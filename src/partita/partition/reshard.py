"""The reshard planner: the steps that move a value from one Sharding to another.

One table, one function per transition. A plan is a list of :class:`ReshardStep`; the planner
repeats the first transition that applies (in this order) until the value has the target
sharding. Per mesh axis ``a`` (``g`` = the group size, ``c`` = the current local size of a dim):

==================================  ==================================  =====================
from -> to                          steps                               function
==================================  ==================================  =====================
tile counts equal per dim, other    ONE collective_permute of the       ``_permute``
device order (T07)                  tile (self pairs included)
replicated on a -> dim d split by a shard_slice (local, no communication) ``_shard_slice``
partial on a -> dim d split by a    [pad d to a multiple of g]          ``_reduce_scatter``
                                    reduce_scatter along d (T15)
partial on a -> not partial         all_reduce over every such axis     ``_all_reduce``
dim d split by a (minor-most) ->    [pad e] all_to_all(split e, concat  ``_all_to_all``
dim e split by a                    d) [slice d to its real size] (T03)
dim d split by a -> replicated      all_gather along d over all of d's  ``_all_gather``
                                    axes not kept, at once (T04, T06)
                                    [slice d to its real size]
tiles that do not line up (uneven)  all_gather d fully, slice to the    ``_realign``
                                    real size; the table goes on
replicated -> partial on a          sum: keep the value on coordinate 0 ``_make_partial``
                                    of a, zeros elsewhere (local)
even tiles that divide one another  per round take_piece, one           ``permute_pieces``
(not partial), when it moves fewer  collective_permute of the piece;
bytes than the steps above (T02)    then place_pieces (local)
==================================  ==================================  =====================

The last row is not tried in order: :func:`plan_reshard` plans the table above, then the
piecewise permute (:mod:`partita.partition.permute_pieces`), and keeps the latter only when the
tiles keep their size, it has no more collectives (rounds) than the former, and it moves
strictly fewer bytes per device.

Gathers run over the dims from last to first (as XLA does); a dim split over several mesh
axes is gathered over all of them in one all_gather. *Line up* means the new tiles are whole
numbers of the old ones: with ceil padding, gathering ``g`` tiles of size ``c`` gives a tile of
``g * c`` rows starting at ``i * g * c``, which is the target's tile only if
``g * c == ceil(n / k')`` (or ``k' == 1``, where slicing to ``n`` fixes it); splitting ``c``
into ``g`` lines up if ``c % g == 0`` or the dim was whole (zero-pad first). Otherwise the dim
is gathered whole and cut again: a *re-alignment*.

There is no "none of the above": any two shardings are connected by these steps. When the
value becomes fully replicated on the way to a sharded target, the plan is an *involuntary
full rematerialization*: every collective step's reason says so and :func:`is_full_remat`
is true. This module does not warn or raise about it (the partitioner does, under its
``strict`` flag), does not pick shardings, and never runs on devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from partita.errors import InternalError, ShardingError
from partita.partition import permute_pieces
from partita.values.layout import ceil_div, permute_sources
from partita.values.spec import Sharding

__all__ = ["ReshardStep", "is_full_remat", "plan_reshard"]

COLLECTIVE_KINDS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
)
FULL_REMAT = "involuntary full rematerialization"


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One step of a reshard on the per-device value.

    ``args`` are the op's arguments after ``x`` (mesh axes as tuples). Local kinds:
    ``shard_slice`` (``dim, mesh_axes, group_size``), ``slice`` (``dim, size``: keep the first
    ``size``), ``pad`` (``dim, size``: zero-pad at the end to ``size``), ``make_partial``
    (``reduce_op, mesh_axes``), ``take_piece`` (``tile, piece, slots``) and ``place_pieces``
    (``piece, rounds``) (see :mod:`partita.partition.permute_pieces`).
    """

    kind: str
    args: tuple[Any, ...]
    mesh_axes: tuple[str, ...]
    in_local_shape: tuple[int, ...]
    out_local_shape: tuple[int, ...]
    reason: str = ""

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS


def is_full_remat(steps: Sequence[ReshardStep]) -> bool:
    """True when the plan gathers the whole value on every device on the way to a sharding."""
    return any(FULL_REMAT in s.reason for s in steps)


class _Planner:
    """The current state (dims, partial axes, local shape) and the steps so far."""

    def __init__(self, src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> None:
        self.mesh, self.shape, self.dst = src.mesh, shape, dst
        self.dims = [tuple(d) for d in src.dim_axes]
        self.partial = list(src.partial)
        self.reduce_op = src.reduce_op
        self.local = [
            ceil_div(n, src.mesh.axes_size(d)) for n, d in zip(shape, self.dims, strict=True)
        ]
        self.steps: list[ReshardStep] = []
        keep = src.reduce_op == dst.reduce_op or not dst.partial
        self.to_reduce = [a for a in src.partial if not (keep and a in dst.partial)]
        self.was_replicated = False

    # --- bookkeeping ---------------------------------------------------------------------

    def size(self, axes: Sequence[str]) -> int:
        return self.mesh.axes_size(axes)

    def emit(self, kind: str, args: tuple[Any, ...], axes: Sequence[str], reason: str) -> None:
        before = tuple(self.local)
        after = list(before)
        if kind in ("all_gather",):
            after[args[0]] *= args[-1]
        elif kind in ("reduce_scatter",):
            after[args[0]] //= args[-1]
        elif kind == "shard_slice":
            after[args[0]] = ceil_div(after[args[0]], args[-1])
        elif kind == "all_to_all":
            after[args[0]] //= args[-1]
            after[args[1]] *= args[-1]
        elif kind in ("slice", "pad"):
            after[args[0]] = args[1]
        self.local = after
        self.steps.append(ReshardStep(kind, args, tuple(axes), before, tuple(after), reason))
        if kind == "all_gather" and not any(self.dims):
            self.was_replicated = True  # every device now holds the whole value

    def used(self) -> set[str]:
        return {a for d in self.dims for a in d} | set(self.partial)

    def is_prefix(self, d: int) -> bool:
        cur, want = self.dims[d], self.dst.dim_axes[d]
        return want[: len(cur)] == cur

    def splits_evenly(self, d: int, g: int) -> bool:
        """Cutting dim d's current tile into g lines up with the target's tiles."""
        return not self.dims[d] or self.local[d] % g == 0

    def pad_for(self, d: int, g: int, why: str) -> None:
        if self.local[d] % g:
            self.emit("pad", (d, ceil_div(self.local[d], g) * g), (), why)

    def trim(self, d: int) -> None:
        if not self.dims[d] and self.local[d] > self.shape[d]:
            self.emit("slice", (d, self.shape[d]), (), f"drop the padding of dim {d}")

    # --- the transitions, in the order they are tried --------------------------------------

    def _permute(self) -> bool:
        """Same tile counts per dim, other device order: one collective_permute."""
        target = [tuple(d) for d in self.dst.dim_axes]
        if self.to_reduce or self.dims == target:
            return False
        if [self.size(d) for d in self.dims] != [self.size(d) for d in target]:
            return False
        mesh = self.mesh
        src = Sharding(mesh, tuple(self.dims), tuple(self.partial), self.reduce_op)
        dst = Sharding(mesh, tuple(target), tuple(self.partial), self.reduce_op)
        q, coords = permute_sources(src, dst, self.partial)
        ids = mesh.devices.reshape(-1)
        pairs = np.stack([ids[q], ids], -1).reshape(-1).tolist()
        moved = (coords != coords[q]).any(axis=0)  # per mesh axis: does any device cross it
        axes = tuple(a for a, m in zip(mesh.axis_names, moved, strict=True) if m)
        self.dims = target
        self.emit("collective_permute", (tuple(pairs), axes), axes, "same tiles, other devices")
        return True

    def _shard_slice(self) -> bool:
        for d, want in enumerate(self.dst.dim_axes):
            if not self.is_prefix(d) or len(want) == len(self.dims[d]):
                continue
            run: list[str] = []
            for a in want[len(self.dims[d]) :]:
                if a in self.used():
                    break
                run.append(a)
            g = self.size(run)
            if run and self.splits_evenly(d, g):
                self.dims[d] = self.dims[d] + tuple(run)
                self.emit("shard_slice", (d, tuple(run), g), run, f"split dim {d} locally")
                return True
        return False

    def _reduce_scatter(self) -> bool:
        for d, want in enumerate(self.dst.dim_axes):
            if not self.is_prefix(d):
                continue
            run: list[str] = []
            for a in want[len(self.dims[d]) :]:
                if a not in self.to_reduce:
                    break
                run.append(a)
            g = self.size(run)
            if run and self.splits_evenly(d, g):
                self.pad_for(d, g, f"reduce_scatter needs dim {d} divisible by {g}")
                self.to_reduce = [a for a in self.to_reduce if a not in run]
                self.partial = [a for a in self.partial if a not in run]
                self.dims[d] = self.dims[d] + tuple(run)
                args = (d, self.reduce_op, tuple(run), g)
                self.emit("reduce_scatter", args, run, f"partial {self.reduce_op} -> dim {d}")
                return True
        return False

    def _all_reduce(self) -> bool:
        if not self.to_reduce:
            return False
        axes = tuple(self.to_reduce)
        self.partial = [a for a in self.partial if a not in axes]
        self.to_reduce = []
        op = self.reduce_op
        self.emit("all_reduce", (op, axes, self.size(axes)), axes, f"partial {op} -> full value")
        return True

    def _all_to_all(self) -> bool:
        for d, cur in enumerate(self.dims):
            for m in range(len(cur), 0, -1):
                run = cur[len(cur) - m :]
                for e, want in enumerate(self.dst.dim_axes):
                    if e == d or not self.is_prefix(e):
                        continue
                    if want[len(self.dims[e]) : len(self.dims[e]) + m] != run:
                        continue
                    g, rest = self.size(run), cur[: len(cur) - m]
                    k = self.size(rest)
                    if not self.splits_evenly(e, g):
                        continue
                    if k > 1 and g * self.local[d] != ceil_div(self.shape[d], k):
                        continue
                    self.pad_for(e, g, f"all_to_all needs dim {e} divisible by {g}")
                    self.dims[d], self.dims[e] = rest, self.dims[e] + run
                    self.emit("all_to_all", (e, d, run, g), run, f"move dim {d} -> dim {e}")
                    self.trim(d)
                    return True
        return False

    def _all_gather(self) -> bool:
        for d in reversed(range(len(self.dims))):
            cur, want = self.dims[d], self.dst.dim_axes[d]
            keep = 0
            while keep < min(len(cur), len(want)) and cur[keep] == want[keep]:
                keep += 1
            if keep == len(cur):
                continue
            k = self.size(cur[:keep])
            if k > 1 and self.size(cur[keep:]) * self.local[d] != ceil_div(self.shape[d], k):
                keep = 0  # the gathered tiles would not line up: gather the dim whole
            self._gather(d, keep, "to the target sharding")
            return True
        return False

    def _gather(self, d: int, keep: int, why: str) -> None:
        axes = self.dims[d][keep:]
        self.dims[d] = self.dims[d][:keep]
        self.emit("all_gather", (d, axes, self.size(axes)), axes, f"gather dim {d} {why}")
        self.trim(d)

    def _realign(self) -> bool:
        for d, want in enumerate(self.dst.dim_axes):
            if self.dims[d] and self.dims[d] != want:
                self._gather(d, 0, "whole to re-align uneven tiles")
                return True
        return False

    def _make_partial(self) -> None:
        new = [a for a in self.dst.partial if a not in self.partial]
        if new:
            self.partial = [a for a in self.mesh.axis_names if a in self.partial or a in new]
            self.reduce_op = self.dst.reduce_op
            args = (self.dst.reduce_op, tuple(new))
            self.emit("make_partial", args, new, "replicated -> partial (local)")

    def run(self) -> list[ReshardStep]:
        transitions = (
            self._permute,
            self._shard_slice,
            self._reduce_scatter,
            self._all_reduce,
            self._all_to_all,
            self._all_gather,
            self._realign,
        )
        target = [tuple(d) for d in self.dst.dim_axes]
        for _ in range(8 * (len(self.shape) + self.mesh.ndim) + 8):
            if self.dims == target and not self.to_reduce:
                break
            if not any(t() for t in transitions):
                raise InternalError(
                    f"reshard planner stuck at dims {self.dims} -> {target}: no transition "
                    f"applies. {InternalError.REPORT}"
                )
        self._make_partial()
        if self.was_replicated and self.dst.sharded_axes and self.steps:
            self.steps = [
                replace(s, reason=f"{FULL_REMAT}: {s.reason}") if s.is_collective else s
                for s in self.steps
            ]
        return self.steps


def plan_reshard(src: Sharding, dst: Sharding, shape: Sequence[int]) -> list[ReshardStep]:
    """The steps that take a value of global ``shape`` from ``src`` to ``dst``.

    Example (T03, ``Mesh.create((2, 4), ("x", "y"))``): ``[16, 32]`` from ``P('y', None)`` to
    ``P(None, 'y')`` is one ``all_to_all`` (split dim 1, concat dim 0) over ``y``:
    ``[4, 32] -> [16, 8]``.
    """
    shape = tuple(int(n) for n in shape)
    if src.mesh != dst.mesh:
        raise ShardingError(
            f"Cannot reshard a value of shape {shape} from {src.mesh!r} to {dst.mesh!r}: a "
            f"reshard moves data within one mesh. Annotate both ends on the same Mesh."
        )
    src.check_shape(shape)
    dst.check_shape(shape)
    src, dst = _without_unit_axes(src), _without_unit_axes(dst)
    if src == dst:
        return []
    return list(_cheapest_plan(src, dst, shape))


def _without_unit_axes(s: Sharding) -> Sharding:
    """``s`` without the mesh axes of size 1: splitting a dim over one device, or holding a
    partial value over one device, lays out no byte differently, so a reshard between
    shardings that differ only there moves nothing (it would be a collective over one device;
    on a real mesh, a call on a one-rank group)."""
    unit = {a for a, n in zip(s.mesh.axis_names, s.mesh.shape, strict=True) if n == 1}
    if not unit or not (unit & {*s.sharded_axes, *s.partial}):
        return s
    dims = tuple(tuple(a for a in d if a not in unit) for d in s.dim_axes)
    partial = tuple(a for a in s.partial if a not in unit)
    return Sharding(s.mesh, dims, partial, s.reduce_op)


@functools.lru_cache(maxsize=4096)
def _cheapest_plan(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple[ReshardStep, ...]:
    """The plan of :func:`plan_reshard` (memoised: a program reshards the same shapes the same
    way once per layer; the steps are frozen, so sharing them is safe)."""
    steps = _Planner(src, dst, shape).run()
    pieces = plan_permute_pieces(src, dst, shape)
    count = [sum(s.is_collective for s in plan) for plan in (pieces or [], steps)]
    same = pieces and math.prod(pieces[-1].out_local_shape) == math.prod(pieces[0].in_local_shape)
    if pieces and same and count[0] <= count[1] and _bytes_hint(pieces) < _bytes_hint(steps):
        return tuple(pieces)
    return tuple(steps)


def plan_permute_pieces(
    src: Sharding, dst: Sharding, shape: Sequence[int]
) -> list[ReshardStep] | None:
    """The piecewise collective_permute plan (whether or not it is the cheapest), or None when
    it does not apply (see :mod:`partita.partition.permute_pieces`)."""
    raw = permute_pieces.plan_pieces(src, dst, tuple(int(n) for n in shape))
    return None if raw is None else [ReshardStep(*r) for r in raw]


def _bytes_hint(steps: Sequence[ReshardStep]) -> int:
    """Elements per device over all collective steps (the Plan's convention); for tests."""
    return sum(
        math.prod(s.in_local_shape if s.kind == "reduce_scatter" else s.out_local_shape)
        for s in steps
        if s.is_collective
    )
