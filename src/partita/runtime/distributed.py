"""DistributedMesh: run the per-device program in one process per device, over torch.distributed.

Each process (``torchrun`` rank ``r``) is mesh device ``r``: it holds only its own shard of
every value and runs the per-device ``GraphModule`` that ``partita.partition`` produced on
those *local* tensors with plain torch ops (no vmap, no device dim). Each ``partita::`` mesh op
of the graph is bound, once per graph, to a function of this module that calls
``torch.distributed`` on the process group of the op's mesh axes:

=====================  =====================================================================
mesh op                torch.distributed call (Gloo on CPU, NCCL on CUDA)
=====================  =====================================================================
all_gather             ``all_gather_single`` (flat), chunks put in mesh member order
all_reduce             ``all_reduce`` (``avg`` = sum, then divide, as the simulated mesh does)
reduce_scatter         ``reduce_scatter_single``, chunks in mesh member order; on Gloo
                       ``all_to_all_single`` and a sum in rank order (``comm.rank_group``)
all_to_all             ``all_to_all_single`` (Gloo supports it on CPU since torch 2.x; checked
                       with torch 2.13)
collective_permute     ``send``/``recv`` on Gloo, receives posted ahead at the run's start
                       (``runtime.permute``); ``batch_isend_irecv`` on other backends; a
                       device that receives nothing gets zeros
axis_index             this rank's coordinate (no communication)
shard_slice            this rank's tile of a replicated value (no communication)
=====================  =====================================================================

The four collectives that move tensors (and the fused ``*_bucket`` ops of
``partita.ir.buckets``, one flat buffer per bucket) are generators of
``runtime.dist_ops`` that launch with ``async_op=True`` and finish at their wait; by default
``runtime.overlap`` schedules each launch right after its input exists and each wait just
before the first use (the program's ``overlap_bytes`` option bounds the bytes in flight; 0 runs
them synchronously in program order). A program's first run goes as partitioned and measures its
values, so that the schedule holds each gather under the program's peak. Under
the ``inductor`` option the runs of local ops between them are compiled by Inductor
(``runtime.compiled``), the schedule kept (without the measured hold).
Before binding, a program's view chains are folded and, with the values its first run
recorded, its optimizer's elementwise ops grouped as ``_foreach`` calls (``runtime.rank_calls``)
and what depends only on this rank's coordinates computed once (``runtime.rank_constants``);
the memory freed by the compile and the first run is given back once (``runtime.release``).

Groups. For every non-empty set of mesh axes and every group ``Mesh.groups(axes)`` of more than
one device, every rank calls ``new_group`` in the same order when the DistributedMesh is built
(``new_group`` is collective over the world). A torch group orders its members by global rank;
a partita group orders them major-first by the op's ``mesh_axes``; the functions here reorder
chunks between the two, so ``all_gather(x, 0, ["model", "data"])`` concatenates in the order
the partitioner expects.

Values are :class:`~partita.runtime.dist_tensor.DistributedShardedTensor` (this process's
shard only). Groups are created with the bounded collective timeout and every collective
failure is a :class:`~partita.errors.DistributedError` (``runtime.comm``); before every run of
a compiled program, the ranks check that they all run the same one, input shapes and dtypes
included (one all-gather of an int64, ``runtime.plan_check``), and at its first run that the
inputs replicated over a mesh axis are equal on their replicas. Under a profiler, the step
and each mesh op's launch and wait run in named ranges (``runtime.ranges``).

This module does not start processes or join them (``runtime.launch`` does) and has no
sharding logic.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.errors import DistributedError
from partita.ir.buckets import BUCKET_OPS
from partita.ir.collectives import MESH_OPS
from partita.options import CompileOptions, current
from partita.runtime import dist_ops, ranges
from partita.runtime.comm import (
    Group,
    create_check_group,
    create_mesh_groups,
    rank_group,
)
from partita.runtime.compiled import compile_regions, stats_for
from partita.runtime.control_flow import bind_bodies
from partita.runtime.dist_ops import InFlight, alone
from partita.runtime.dist_tensor import DistributedShardedTensor, local_shard
from partita.runtime.donate import donated_all_reduces
from partita.runtime.overlap import first_run, schedule_overlap
from partita.runtime.permute import bind_permutes
from partita.runtime.plan_check import CallChecks
from partita.runtime.rank_calls import fewer_calls
from partita.runtime.rank_constants import rank_program
from partita.runtime.release import release_freed
from partita.values.layout import ceil_div
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["DistributedMesh", "DistributedShardedTensor", "distributed_executor", "local_shard"]

ops = torch.ops.partita
_BOUND_OPS = frozenset((*MESH_OPS, *BUCKET_OPS))
_Programs = weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule]  # by per-device program
#: The mesh ops that run as launch + wait (``runtime.dist_ops``), so that they can overlap.
ASYNC_OPS = (
    ops.all_gather.default,
    ops.all_reduce.default,
    ops.reduce_scatter.default,
    ops.all_to_all.default,
    *BUCKET_OPS,
)


def _kind(target: Any) -> str:
    return target._schema.name.split("::")[-1]


class DistributedMesh:
    """One process per device: this process is mesh device ``torch.distributed.get_rank()``.

    Args:
        mesh: a mesh whose device ids are exactly the ranks ``0 .. world_size - 1``.

    Built by ``partita.jit`` when ``torch.distributed`` is initialised
    (``partita.distributed.initialize()``); build one yourself only to run a per-device graph
    by hand with :meth:`run`.

    Example (under ``torchrun --nproc-per-node=4``):
        >>> partita.distributed.initialize()  # doctest: +SKIP
        True
        >>> mesh = Mesh.create((2, 2), ("data", "model"))
        >>> step = partita.jit(fn, mesh=mesh, in_specs=...)  # doctest: +SKIP
    """

    def __init__(self, mesh: Mesh) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(
                "DistributedMesh needs torch.distributed to be initialised: call "
                "partita.distributed.initialize() first, under torchrun."
            )
        world = dist.get_world_size()
        if sorted(mesh.device_ids) != list(range(world)):
            raise DistributedError(
                f"{mesh!r} has device ids {list(mesh.device_ids)}, but this run has {world} "
                f"processes (ranks 0..{world - 1}), one per device. Build the mesh over every "
                f"rank, e.g. Mesh.create(shape) with prod(shape) == {world}, or launch "
                f"{mesh.size} processes in total (torchrun --nnodes * --nproc-per-node)."
            )
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.position = mesh.position(self.rank)
        self._groups: dict[tuple[str, ...], Group | None] = {}
        self._coordinates: dict[tuple[str, ...], int] = {}
        # Every rank creates every group in the same order (new_group is collective), each
        # with the bounded collective timeout (runtime.comm says why that matters).
        self._pgs = create_mesh_groups(mesh, self.rank)
        self._check_pg: Any = create_check_group(world)
        self._closed = False
        self._bound: _Programs = weakref.WeakKeyDictionary()
        self._compiled: _Programs = weakref.WeakKeyDictionary()
        self._checks = CallChecks(mesh)  # the plan and replica checks (runtime.plan_check)
        self._device: torch.device | None = None  # of the inputs: this rank's constants' device
        self._impls: dict[Any, Callable[..., Any]] = {
            ops.axis_index.default: self.axis_index,
            ops.shard_slice.default: self.shard_slice,
        }
        for target in ASYNC_OPS:  # the ops of runtime.dist_ops, by name
            self._impls[target] = self._caller(_kind(target))

    def __repr__(self) -> str:
        return f"DistributedMesh({self.mesh!r}, rank={self.rank})"

    # --- groups ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every process group this executor holds (``partita.distributed.shutdown``).

        ``destroy_process_group`` only forgets torch's own references: a group still held
        here would be destroyed during interpreter teardown instead, when Gloo's threads can
        no longer take the GIL, and the process aborts ("terminate called without an active
        exception") after a peer failed. A closed executor cannot run collectives any more.
        """
        self._pgs = {}
        self._groups = {}
        self._check_pg = None
        self._closed = True

    def _require_open(self) -> None:
        if self._closed:
            raise DistributedError(
                f"{self!r} was closed by partita.distributed.shutdown(): its process groups "
                f"are destroyed. Call partita.distributed.initialize() again before running "
                f"a sharded program."
            )

    def group(self, mesh_axes: Sequence[str]) -> Group | None:
        """This rank's group over ``mesh_axes`` (None when the group is this device alone)."""
        self._require_open()
        raw = tuple(mesh_axes)  # as the graph spells them: no name lookups per call
        if raw in self._groups:
            return self._groups[raw]
        key = tuple(self.mesh.axis_name(a) for a in raw)
        if key not in self._groups:
            pg = self._pgs[frozenset(key)].get(self.rank) if key else None
            if pg is None:
                self._groups[key] = None
            else:
                (members,) = [g for g in self.mesh.groups(key) if self.rank in g]
                self._groups[key] = rank_group(pg, members, self.rank)
        self._groups[raw] = self._groups[key]
        return self._groups[key]

    # --- the mesh ops on local tensors -------------------------------------------------------
    # Each communicating op is a generator of ``runtime.dist_ops`` (launch, yield, wait): the
    # methods run it to the end; ``start``/``wait`` split it for the overlap schedule.

    def _caller(self, kind: str) -> Callable[..., Any]:
        def call(*args: Any, node: str = "", donate: bool = False) -> Any:
            return self.call(kind, *args, node=node, donate=donate)

        call.__name__ = call.__qualname__ = kind  # fx names the graph's nodes after it
        return call

    def call(self, kind: str, *args: Any, node: str = "", donate: bool = False) -> Any:
        """Run mesh op ``kind`` to the end (launch and wait) with the graph's arguments."""
        return self.wait(self.start(kind, *args, node=node, donate=donate))

    def start(self, kind: str, *args: Any, node: str = "", donate: bool = False) -> InFlight:
        """Launch mesh op ``kind`` (a name of ``runtime.dist_ops``) with the op's arguments
        (``group_size`` last, as in the graph); :meth:`wait` returns its result. ``donate``:
        the program reads the input of this ``all_reduce`` nowhere else (``runtime.donate``),
        so it is reduced in place instead of in a copy."""
        *rest, _group_size = args
        mesh_axes = rest[-1]
        g = self.group(mesh_axes)
        if g is None:  # this device alone: nothing moves
            return InFlight(None, alone(kind, rest[0]))
        extra = {"donate": True} if donate else {}
        op = getattr(dist_ops, kind)(g, *rest, node, **extra)
        try:
            next(op)  # launched; the local compute may go on
        except StopIteration as stop:
            return InFlight(None, stop.value)
        return InFlight(op, None)

    def wait(self, pending: InFlight) -> Any:
        """The result of a launched mesh op (waits for its bytes)."""
        if pending.op is None:
            return pending.value
        return dist_ops.run(pending.op)

    def axis_index(self, like: Tensor, mesh_axes: Sequence[str], node: str = "") -> Tensor:
        return torch.tensor(self._coordinate(mesh_axes), dtype=torch.int64, device=like.device)

    def shard_slice(
        self, x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int, node: str = ""
    ) -> Tensor:
        g = self.mesh.axes_size(mesh_axes)
        chunk = ceil_div(x.shape[dim], g)
        if chunk * g != x.shape[dim]:
            pad = [0, 0] * (x.dim() - dim - 1) + [0, chunk * g - x.shape[dim]]
            x = torch.nn.functional.pad(x, pad)
        return x.narrow(dim, self._coordinate(mesh_axes) * chunk, chunk).contiguous()

    def _coordinate(self, mesh_axes: Sequence[str]) -> int:
        raw = tuple(mesh_axes)
        if raw not in self._coordinates:
            coords, out = self.mesh.coords(self.rank), 0
            for name in (self.mesh.axis_name(a) for a in raw):
                out = out * self.mesh.axis_size(name) + coords[name]
            self._coordinates[raw] = out
        return self._coordinates[raw]

    # --- running -----------------------------------------------------------------------------

    def bind(self, gm: fx.GraphModule, overlap: int) -> fx.GraphModule:
        """A copy of ``gm`` whose mesh ops call this executor (built once per graph)."""
        bound = self._bound.get(gm)
        if bound is None:
            bound = self._bound[gm] = self._bind(gm, overlap)
        return bound

    def _bind(
        self,
        gm: fx.GraphModule,
        overlap: int,
        sizes: dict[str, int] | None = None,
        donate: bool = True,
        vals: dict[str, Tensor] | None = None,
    ) -> fx.GraphModule:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        # views folded; with the first run's values (vals), the optimizer's ops as _foreach calls
        fewer_calls(graph, gm, vals or {})
        # this rank's coordinates as constants (not for Inductor: donate=False)
        root = rank_program(gm, graph, self._coordinate, self._device) if donate else gm
        donated = donated_all_reduces(graph) if donate else set()
        gloo = dist.get_backend() == "gloo"
        if overlap:
            copies = 2 if gloo else 1  # Gloo gathers via a temporary
            schedule_overlap(graph, ASYNC_OPS, self.start, self.wait, _kind, overlap, sizes, copies)
        bind_permutes(graph, self.rank, overlap, gloo)  # receives posted ahead within overlap
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _BOUND_OPS:
                node.target = self._impls[node.target]
                node.kwargs = {**node.kwargs, "node": node.name}
            if node.op == "call_function" and node.kwargs.get("node") in donated:
                node.kwargs = {**node.kwargs, "donate": True}  # a mesh op or its start
        return bind_bodies(gm, fx.GraphModule(root, graph, class_name="RankProgram"), self._bind)

    def compiled(self, gm: fx.GraphModule, overlap: int) -> fx.GraphModule:
        """:meth:`bind`'s program with its local-op regions compiled by Inductor on first run
        (``runtime.compiled``; the cost is recorded in ``stats_for(gm)``)."""
        program = self._compiled.get(gm)
        if program is None:
            # no donation: a compiled region's outputs are Inductor's buffers
            bound = self._bind(gm, overlap, donate=False)
            program = self._compiled[gm] = compile_regions(bound, stats_for(gm))
        return program

    def run(
        self, gm: fx.GraphModule, local_inputs: Sequence[Any], options: CompileOptions | None = None
    ) -> list[Any]:
        """Run the per-device program on this rank's local tensors; the flattened outputs.
        ``options`` (None: the current ones): ``inductor`` runs its local ops compiled by
        Inductor (:meth:`compiled`), ``overlap_bytes`` bounds the overlap schedule."""
        opts = options or current()
        inductor, overlap = opts.inductor, opts.overlap_bytes
        if self._device is None:
            self._device = next((t.device for t in local_inputs if isinstance(t, Tensor)), None)
        if not inductor and overlap and gm not in self._bound:
            # the first run goes as partitioned, measuring every value for the schedule's hold
            release_freed()  # the compile's garbage, before the first run stacks on it
            vals: dict[str, Tensor] = {}
            outs, sizes = first_run(self._bind(gm, 0), gm, self, local_inputs, vals)
            self._bound[gm] = self._bind(gm, overlap, sizes, vals=vals)
            del vals, sizes
            release_freed()  # and the first run's (runtime.release)
            return pytree.tree_leaves(outs)
        program = self.compiled(gm, overlap) if inductor else self.bind(gm, overlap)
        if ranges.enabled():  # under a profiler: the step and each mesh op in named ranges
            return pytree.tree_leaves(ranges.ranged(program, gm, self)(*local_inputs))
        return pytree.tree_leaves(program(*local_inputs))

    def run_compiled(self, compiled: Any, leaves: Sequence[Any]) -> list[ShardedTensor]:
        """Run a ``partita.jit`` compiled signature: what ``Jitted.__call__`` needs.

        ``leaves`` are the tensor arguments (ShardedTensors or plain tensors holding the global
        value on every process); the results are :class:`DistributedShardedTensor`.
        """
        self._require_open()
        # Before any collective of the program: a mismatch is an error on every rank, and the
        # ranks stay in step (a later matching call runs).
        self._checks.program(compiled, self._check_pg)
        inputs = [
            self.local_input(leaf, sharding)
            for leaf, sharding in zip(leaves, compiled.input_shardings, strict=True)
        ]
        self._checks.replicas(compiled, leaves, inputs, self._check_pg)
        outs = self.run(compiled.local, inputs, compiled.options)
        return [
            DistributedShardedTensor.from_local(o, s, shape, self, computed=True)
            for o, s, shape in zip(
                outs, compiled.output_shardings, compiled.output_shapes, strict=True
            )
        ]

    def local_input(self, leaf: Any, sharding: Sharding) -> Tensor:
        """This rank's shard of an argument under ``sharding``."""
        if isinstance(leaf, ShardedTensor) and leaf.sharding == sharding:
            if isinstance(leaf, DistributedShardedTensor):
                return leaf.addressable_shard
            return leaf.stacked[self.position]
        value = leaf.full() if isinstance(leaf, ShardedTensor) else leaf
        return local_shard(value, sharding, self.position)


# --- selection by partita.jit ------------------------------------------------------------------

_EXECUTORS: dict[Mesh, tuple[Any, DistributedMesh]] = {}


def distributed_executor(mesh: Mesh) -> DistributedMesh | None:
    """The DistributedMesh for ``mesh`` when torch.distributed is initialised, else None.

    ``partita.jit`` calls this on every call: the LocalMesh is used in a single process, a
    DistributedMesh (one per mesh and process group, created collectively on first use) under
    torchrun after ``partita.distributed.initialize()``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD  # held and compared, not its id: a new world can get its address
    found = _EXECUTORS.get(mesh)
    if found is None or found[0] is not world:
        found = _EXECUTORS[mesh] = (world, DistributedMesh(mesh))
    return found[1]


def close_executors() -> None:
    """Close and forget every DistributedMesh, releasing its process groups (see ``close``)."""
    for _, executor in _EXECUTORS.values():
        executor.close()
    _EXECUTORS.clear()
