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
reduce_scatter         ``reduce_scatter_single``, chunks sent in mesh member order
all_to_all             ``all_to_all_single`` (Gloo supports it on CPU since torch 2.x; checked
                       with torch 2.13)
collective_permute     ``batch_isend_irecv``; a device that receives nothing gets zeros
axis_index             this rank's coordinate (no communication)
shard_slice            this rank's tile of a replicated value (no communication)
=====================  =====================================================================

Groups. For every non-empty set of mesh axes and every group ``Mesh.groups(axes)`` of more than
one device, every rank calls ``new_group`` in the same order when the DistributedMesh is built
(``new_group`` is collective over the world). A torch group orders its members by global rank;
a partita group orders them major-first by the op's ``mesh_axes``; the functions here reorder
chunks between the two, so ``all_gather(x, 0, ["model", "data"])`` concatenates in the order
the partitioner expects.

Values. A :class:`DistributedShardedTensor` is a ShardedTensor whose storage holds only this
process's shard (``addressable_data``: ``[1, *local_shape]``); ``.full()`` (and printing)
gathers the global value from every process, so it is a collective: every process must call it
(a replicated value is read locally, without communication).

Safety. Before a compiled program first runs, the ranks compare a sha256 of it (the per-device
graph's nodes, input and output shardings and shapes) and raise
:class:`~partita.errors.PlanMismatchError` naming the ranks and the first op that differs. A
failing collective (a peer died, or the collective timeout of the process group passed) raises
:class:`~partita.errors.DistributedError` naming the node, the op, the group and this rank.

This module does not start processes or join them (``runtime.launch`` does) and has no
sharding logic.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.collectives import MESH_OPS
from partita.errors import DistributedError, PlanMismatchError
from partita.layout import index_ranges, local_shape, shard_tensor, unshard_tensor
from partita.mesh import Mesh
from partita.spec import Sharding
from partita.tensor import Shard, ShardedTensor

__all__ = ["DistributedMesh", "DistributedShardedTensor", "distributed_executor"]

ops = torch.ops.partita


# torch 2.13 renamed the tensor forms (the old names warn); older versions have only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _ceil_div(n: int, k: int) -> int:
    return -(-n // k)


@dataclass(frozen=True)
class _Group:
    """This rank's group over some mesh axes."""

    pg: Any  # ProcessGroup
    members: tuple[int, ...]  # device ids (= ranks), partita order (major-first by mesh_axes)
    torch_order: tuple[int, ...]  # the same ranks in the torch group's order
    index: int  # this rank's index in ``members``

    @property
    def to_torch(self) -> list[int]:
        """``to_torch[t]`` = the partita member index of torch group rank ``t``."""
        return [self.members.index(r) for r in self.torch_order]

    @property
    def same_order(self) -> bool:
        return self.members == self.torch_order


class DistributedMesh:
    """One process per device: this process is mesh device ``torch.distributed.get_rank()``.

    Args:
        mesh: a mesh whose device ids are exactly the ranks ``0 .. world_size - 1``.

    Built by ``partita.jit`` when ``torch.distributed`` is initialised
    (``partita.distributed.initialize()``); build one yourself only to run a per-device graph
    by hand with :meth:`run`.

    Example (under ``torchrun --nproc-per-node=4``):
        >>> partita.distributed.initialize()
        >>> mesh = Mesh.create((2, 2), ("data", "model"))
        >>> step = partita.jit(fn, mesh=mesh, in_specs=...)   # runs on a DistributedMesh
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
        self._groups: dict[tuple[str, ...], _Group | None] = {}
        self._pgs: dict[frozenset[str], dict[int, Any]] = {}
        # Every rank creates every group in the same order (new_group is collective).
        names = mesh.axis_names
        for k in range(1, len(names) + 1):
            for subset in itertools.combinations(names, k):
                pgs: dict[int, Any] = {}
                for members in mesh.groups(subset):
                    if len(members) == 1:
                        continue
                    pg = dist.new_group(sorted(members))
                    if self.rank in members:
                        pgs[self.rank] = pg
                self._pgs[frozenset(subset)] = pgs
        self._bound: weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule] = (
            weakref.WeakKeyDictionary()
        )
        self._verified: weakref.WeakKeyDictionary[fx.GraphModule, str] = weakref.WeakKeyDictionary()
        self._impls: dict[Any, Callable[..., Tensor]] = {
            ops.all_gather.default: self.all_gather,
            ops.all_reduce.default: self.all_reduce,
            ops.reduce_scatter.default: self.reduce_scatter,
            ops.all_to_all.default: self.all_to_all,
            ops.collective_permute.default: self.collective_permute,
            ops.axis_index.default: self.axis_index,
            ops.shard_slice.default: self.shard_slice,
        }

    def __repr__(self) -> str:
        return f"DistributedMesh({self.mesh!r}, rank={self.rank})"

    # --- groups ------------------------------------------------------------------------------

    def group(self, mesh_axes: Sequence[str]) -> _Group | None:
        """This rank's group over ``mesh_axes`` (None when the group is this device alone)."""
        key = tuple(self.mesh.axis_name(a) for a in mesh_axes)
        if key not in self._groups:
            pg = self._pgs[frozenset(key)].get(self.rank) if key else None
            if pg is None:
                self._groups[key] = None
            else:
                (members,) = [g for g in self.mesh.groups(key) if self.rank in g]
                torch_order = tuple(dist.get_process_group_ranks(pg))
                self._groups[key] = _Group(
                    pg, tuple(members), torch_order, members.index(self.rank)
                )
        return self._groups[key]

    # --- the mesh ops on local tensors -------------------------------------------------------

    def all_gather(
        self, x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int, node: str = ""
    ) -> Tensor:
        g = self.group(mesh_axes)
        if g is None:
            return x
        parts = _gather_flat(x, len(g.members), g.pg, node, "all_gather", mesh_axes, g)
        if not g.same_order:  # torch order -> partita member order
            where = [g.torch_order.index(m) for m in g.members]
            parts = parts[torch.tensor(where, device=x.device)]
        shape = list(x.shape)
        shape[dim] *= len(g.members)
        return parts.movedim(0, dim).reshape(shape)

    def all_reduce(
        self, x: Tensor, reduce_op: str, mesh_axes: Sequence[str], group_size: int, node: str = ""
    ) -> Tensor:
        g = self.group(mesh_axes)
        if g is None:
            return x.clone()
        out = x.contiguous().clone()
        _call(node, "all_reduce", mesh_axes, g,
              lambda: dist.all_reduce(out, op=_torch_op(reduce_op), group=g.pg))  # fmt: skip
        return _finish_avg(out, reduce_op, len(g.members))

    def reduce_scatter(
        self,
        x: Tensor,
        dim: int,
        reduce_op: str,
        mesh_axes: Sequence[str],
        group_size: int,
        node: str = "",
    ) -> Tensor:
        g = self.group(mesh_axes)
        if g is None:
            return x.clone()
        n = len(g.members)
        _check_divisible("reduce_scatter", node, x, dim, n)
        chunks = x.movedim(dim, 0).reshape(n, x.shape[dim] // n, *_without(x.shape, dim))
        if not g.same_order:  # torch group rank t receives the chunk of its partita member
            chunks = chunks[torch.tensor(g.to_torch, device=x.device)]
        flat = chunks.reshape(-1, *chunks.shape[2:]).contiguous()
        out = x.new_empty(chunks.shape[1:])
        _call(node, "reduce_scatter", mesh_axes, g,
              lambda: _REDUCE_SCATTER(out, flat, op=_torch_op(reduce_op),
                                                 group=g.pg))  # fmt: skip
        return _finish_avg(out, reduce_op, n).movedim(0, dim).contiguous()

    def all_to_all(
        self,
        x: Tensor,
        split_dim: int,
        concat_dim: int,
        mesh_axes: Sequence[str],
        group_size: int,
        node: str = "",
    ) -> Tensor:
        g = self.group(mesh_axes)
        if g is None:
            return x.clone()
        n = len(g.members)
        _check_divisible("all_to_all", node, x, split_dim, n)
        chunks = list(x.chunk(n, dim=split_dim))  # chunk j goes to partita member j
        send = torch.stack([chunks[j] for j in g.to_torch]).contiguous()
        recv = torch.empty_like(send)
        _call(node, "all_to_all", mesh_axes, g,
              lambda: dist.all_to_all_single(recv, send, group=g.pg))  # fmt: skip
        received = [recv[g.torch_order.index(m)] for m in g.members]  # in sender order
        return torch.cat(received, dim=concat_dim)

    def collective_permute(
        self, x: Tensor, pairs: Sequence[int], mesh_axes: Sequence[str], node: str = ""
    ) -> Tensor:
        srcs, dsts = [int(p) for p in pairs[0::2]], [int(p) for p in pairs[1::2]]
        send_to = dsts[srcs.index(self.rank)] if self.rank in srcs else None
        recv_from = srcs[dsts.index(self.rank)] if self.rank in dsts else None
        if recv_from == self.rank:
            return x.clone()
        out = torch.zeros_like(x)
        p2p = []
        if send_to is not None and send_to != self.rank:
            p2p.append(dist.P2POp(dist.isend, x.contiguous(), send_to))
        if recv_from is not None:
            p2p.append(dist.P2POp(dist.irecv, out, recv_from))
        if p2p:

            def run() -> None:
                for work in dist.batch_isend_irecv(p2p):
                    work.wait()

            _call(node, "collective_permute", mesh_axes, None, run, peers=pairs)
        return out

    def axis_index(self, like: Tensor, mesh_axes: Sequence[str], node: str = "") -> Tensor:
        return torch.tensor(self._coordinate(mesh_axes), dtype=torch.int64, device=like.device)

    def shard_slice(
        self, x: Tensor, dim: int, mesh_axes: Sequence[str], group_size: int, node: str = ""
    ) -> Tensor:
        g = self.mesh.axes_size(mesh_axes)
        chunk = _ceil_div(x.shape[dim], g)
        if chunk * g != x.shape[dim]:
            pad = [0, 0] * (x.dim() - dim - 1) + [0, chunk * g - x.shape[dim]]
            x = torch.nn.functional.pad(x, pad)
        return x.narrow(dim, self._coordinate(mesh_axes) * chunk, chunk).contiguous()

    def _coordinate(self, mesh_axes: Sequence[str]) -> int:
        coords = self.mesh.coords(self.rank)
        out = 0
        for a in mesh_axes:
            name = self.mesh.axis_name(a)
            out = out * self.mesh.axis_size(name) + coords[name]
        return out

    # --- running -----------------------------------------------------------------------------

    def bind(self, gm: fx.GraphModule) -> fx.GraphModule:
        """A copy of ``gm`` whose mesh ops call this executor (built once per graph)."""
        bound = self._bound.get(gm)
        if bound is None:
            graph = fx.Graph()
            out = graph.graph_copy(gm.graph, {})
            graph.output(out)
            for node in graph.nodes:
                if node.op == "call_function" and node.target in MESH_OPS:
                    node.target = self._impls[node.target]
                    node.kwargs = {**node.kwargs, "node": node.name}
            bound = self._bound[gm] = fx.GraphModule(gm, graph, class_name="RankProgram")
        return bound

    def run(self, gm: fx.GraphModule, local_inputs: Sequence[Any]) -> list[Any]:
        """Run the per-device program on this rank's local tensors; the flattened outputs."""
        return pytree.tree_leaves(self.bind(gm)(*local_inputs))

    def run_compiled(self, compiled: Any, leaves: Sequence[Any]) -> list[ShardedTensor]:
        """Run a ``partita.jit`` compiled signature: what ``Jitted.__call__`` needs.

        ``leaves`` are the tensor arguments (ShardedTensors or plain tensors holding the global
        value on every process); the results are :class:`DistributedShardedTensor`.
        """
        if compiled.local not in self._verified:
            self._verified[compiled.local] = verify_same_program(compiled, self.mesh)
        inputs = [
            self.local_input(leaf, sharding)
            for leaf, sharding in zip(leaves, compiled.input_shardings, strict=True)
        ]
        outs = self.run(compiled.local, inputs)
        return [
            DistributedShardedTensor.from_local(o, s, shape, self)
            for o, s, shape in zip(
                outs, compiled.output_shardings, compiled.output_shapes, strict=True
            )
        ]

    def local_input(self, leaf: Any, sharding: Sharding) -> Tensor:
        """This rank's shard of an argument under ``sharding``."""
        if isinstance(leaf, ShardedTensor) and leaf.sharding == sharding:
            if isinstance(leaf, DistributedShardedTensor):
                return leaf.addressable_data[0]
            return leaf.stacked[self.position]
        value = leaf.full() if isinstance(leaf, ShardedTensor) else leaf
        return local_shard(value, sharding, self.position)


def local_shard(value: Tensor, sharding: Sharding, position: int) -> Tensor:
    """The padded shard of the global ``value`` that mesh position ``position`` holds."""
    if sharding.partial:
        return shard_tensor(value, sharding)[position]
    if sharding.is_replicated:
        return value
    ranges = index_ranges(sharding, value.shape)[position].tolist()
    piece = value[tuple(slice(a, b) for a, b in ranges)]
    shape = local_shape(sharding, value.shape)
    if tuple(piece.shape) == shape:
        return piece.contiguous()
    out = value.new_zeros(shape)
    out[tuple(slice(0, n) for n in piece.shape)] = piece
    return out


class DistributedShardedTensor(ShardedTensor):
    """A ShardedTensor of which this process holds only its own device's shard.

    ``addressable_data`` is ``[1, *local_shape]`` (this rank's padded shard);
    ``addressable_devices`` the device ids it belongs to. ``full()`` and ``print`` gather the
    global value from every process (a collective: call them on every process; a replicated
    value is read locally). ``local_shards`` lists only the addressable shards.
    """

    __slots__ = ("_devices", "_executor")

    @classmethod
    def from_local(
        cls, local: Tensor, sharding: Sharding, shape: Sequence[int], executor: DistributedMesh
    ) -> DistributedShardedTensor:
        expected = local_shape(sharding, shape)
        if tuple(local.shape) != expected:
            raise DistributedError(
                f"rank {executor.rank} holds a shard of shape {tuple(local.shape)}, but global "
                f"shape {tuple(shape)} under {sharding} needs {expected}."
            )
        out = cls(local.unsqueeze(0), sharding, shape)
        out._devices = (executor.rank,)
        out._executor = executor
        return out

    @property
    def addressable_data(self) -> Tensor:
        """This process's padded shards, ``[len(addressable_devices), *local_shape]``."""
        return self._stacked

    @property
    def addressable_devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def stacked(self) -> Tensor:
        raise DistributedError(
            "This ShardedTensor lives on a DistributedMesh: this process holds only the shard "
            f"of device {self._devices[0]} (.addressable_data), not the stacked storage of "
            "every device. Use .full() for the global value (a collective) or .local_shards."
        )

    def full(self) -> Tensor:
        if self._sharding.is_replicated:  # every device holds the whole value
            return self._stacked[0][tuple(slice(0, n) for n in self._shape)].clone()
        mesh = self.mesh
        local = self._stacked[0].contiguous()
        gathered = _gather_flat(
            local, dist.get_world_size(), None, "", "ShardedTensor.full", mesh.axis_names, None
        )
        stacked = gathered[torch.tensor(mesh.device_ids, device=local.device)]
        return unshard_tensor(stacked, self._sharding, self._shape)

    @property
    def local_shards(self) -> list[Shard]:
        ranges = index_ranges(self._sharding, self._shape).tolist()
        from partita.layout import replica_ids

        replicas = replica_ids(self._sharding).tolist()
        shards = []
        for i, device in enumerate(self._devices):
            p = self.mesh.position(device)
            index = tuple(slice(a, b) for a, b in ranges[p])
            data = self._stacked[i]
            unpadded = data[tuple(slice(0, b - a) for a, b in ranges[p])]
            shards.append(Shard(data, unpadded, device, index, replicas[p]))
        return shards


# --- plan agreement ----------------------------------------------------------------------------


def program_lines(compiled: Any) -> list[str]:
    """What the ranks must agree on, one line per node, then the signature."""
    lines = [node.format_node() for node in compiled.local.graph.nodes]
    lines.append(f"inputs: {[str(s) for s in compiled.input_shardings]}")
    lines.append(f"outputs: {[str(s) for s in compiled.output_shardings]}")
    lines.append(f"output shapes: {compiled.output_shapes}")
    return [line or "" for line in lines]


def program_digest(compiled: Any) -> str:
    return hashlib.sha256("\n".join(program_lines(compiled)).encode()).hexdigest()


def verify_same_program(compiled: Any, mesh: Mesh) -> str:
    """Compare the program's digest across every rank; raise PlanMismatchError if they differ."""
    digest = program_digest(compiled)
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    every = _gather_flat(mine, dist.get_world_size(), None, "", "plan check", mesh.axis_names, None)
    digests = [bytes(row.tolist()).hex() for row in every]
    if len(set(digests)) == 1:
        return digest
    lines: list[Any] = [None] * len(digests)
    dist.all_gather_object(lines, program_lines(compiled))
    by_digest: dict[str, list[int]] = {}
    for rank, d in enumerate(digests):
        by_digest.setdefault(d, []).append(rank)
    groups = sorted(by_digest.values())
    a, b = groups[0][0], groups[1][0]
    first = next(
        (i for i, (x, y) in enumerate(zip(lines[a], lines[b], strict=False)) if x != y),
        min(len(lines[a]), len(lines[b])),
    )

    def line(rank: int) -> str:
        return lines[rank][first].strip() if first < len(lines[rank]) else "<end of program>"

    summary = "; ".join(f"ranks {ranks} have plan {d[:12]}" for d, ranks in by_digest.items())
    raise PlanMismatchError(
        f"The processes compiled different programs for one jit call: {summary}. The first "
        f"difference is at line {first} of the per-device program: rank {a} has "
        f"`{line(a)}`, rank {b} has `{line(b)}`. Running them would deadlock at a collective. "
        f"Every process must run the same code with the same global shapes, dtypes and specs "
        f"(check per-rank branches, per-host batch shapes and versions of partita and torch)."
    )


# --- errors ---------------------------------------------------------------------------------


def _host() -> str:
    return socket.gethostname()


def _call(
    node: str,
    kind: str,
    mesh_axes: Sequence[str],
    group: _Group | None,
    fn: Callable[[], Any],
    peers: Sequence[int] | None = None,
) -> None:
    try:
        fn()
    except (RuntimeError, dist.DistBackendError) as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = f" at node {node!r}" if node else ""
        members = f" with group {list(group.members)}" if group is not None else ""
        if peers is not None:
            members = f" with pairs {list(peers)}"
        raise DistributedError(
            f"{kind}{where} over mesh axes {tuple(mesh_axes)}{members} failed on rank {rank} "
            f"(host {_host()}): {str(e).strip().splitlines()[0] if str(e).strip() else e!r}. "
            f"A peer process has most likely died or stopped (its own log shows why), or it "
            f"was slower than the collective timeout (PARTITA_COLLECTIVE_TIMEOUT seconds). "
            f"The run cannot continue: every process must be restarted."
        ) from e


def _gather_flat(
    x: Tensor,
    n: int,
    pg: Any,
    node: str,
    kind: str,
    mesh_axes: Sequence[str],
    group: _Group | None,
) -> Tensor:
    """``[n, *x.shape]``: every member's ``x`` in torch group order (flat buffers for Gloo)."""
    flat = x.contiguous().reshape(-1)
    out = flat.new_empty(n * flat.numel())
    _call(node, kind, mesh_axes, group,
          lambda: _ALL_GATHER(out, flat, group=pg))  # fmt: skip
    return out.reshape(n, *x.shape)


def _torch_op(reduce_op: str) -> Any:
    table = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,  # divided afterwards, exactly as the simulated mesh does
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    if reduce_op not in table:
        raise ValueError(f"reduce_op must be one of {tuple(table)}, got {reduce_op!r}.")
    return table[reduce_op]


def _finish_avg(total: Tensor, reduce_op: str, n: int) -> Tensor:
    if reduce_op != "avg":
        return total
    if total.is_floating_point() or total.is_complex():
        return total / n
    return torch.div(total, n, rounding_mode="trunc")


def _check_divisible(op: str, node: str, x: Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise DistributedError(
            f"{op} at node {node!r}: dim {dim} of local shape {tuple(x.shape)} is not "
            f"divisible by the group size {n}."
        )


def _without(shape: Sequence[int], dim: int) -> list[int]:
    return [s for i, s in enumerate(shape) if i != dim]


# --- selection by partita.jit ------------------------------------------------------------------

_EXECUTORS: dict[tuple[Mesh, int], DistributedMesh] = {}


def distributed_executor(mesh: Mesh) -> DistributedMesh | None:
    """The DistributedMesh for ``mesh`` when torch.distributed is initialised, else None.

    ``partita.jit`` calls this on every call: the LocalMesh is used in a single process, a
    DistributedMesh (one per mesh and process group, created collectively on first use) under
    torchrun after ``partita.distributed.initialize()``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = (mesh, id(dist.group.WORLD))
    executor = _EXECUTORS.get(key)
    if executor is None:
        executor = _EXECUTORS[key] = DistributedMesh(mesh)
    return executor
