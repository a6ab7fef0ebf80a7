"""The torch.distributed calls of the DistributedMesh, each bounded and each failing typed.

Three jobs, all about talking to torch.distributed safely:

- **groups**: :func:`create_mesh_groups` creates one process group per set of mesh axes and
  per group of devices, every one with the *bounded* collective timeout. ``dist.new_group``
  without ``timeout=`` gives a Gloo group torch's default of 30 minutes whatever the default
  group was created with, so a stalled peer would hold every program collective that long.
- **calls**: :func:`call_collective` runs one collective and turns any failure of it (a peer
  died, a peer is slower than the timeout) into :class:`~partita.errors.DistributedError` that
  names the collective, the fx node, the mesh axes, the group's ranks, this rank and the fix;
- **flat buffers**: :func:`gather_flat` (Gloo gathers flat tensors) and the small arithmetic
  shared by the mesh ops (reduce ops, ``avg``, divisibility).

This module does not know about programs or plans (``runtime.distributed`` and
``runtime.plan_check`` do).
"""

from __future__ import annotations

import datetime
import itertools
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from partita.errors import ArgumentError, DistributedError
from partita.runtime import launch
from partita.values.mesh import Mesh

__all__ = [
    "Group",
    "call_collective",
    "check_divisible",
    "create_check_group",
    "create_mesh_groups",
    "finish_avg",
    "gather_flat",
    "group_of",
    "rank_group",
    "scatter_by_all_to_all",
    "timeout_seconds",
    "torch_reduce_op",
]

# torch 2.13 renamed the tensor forms (the old names warn); older versions have only those.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Group:
    """This rank's group over some mesh axes."""

    pg: Any  # ProcessGroup
    members: tuple[int, ...]  # device ids (= ranks), partita order (major-first by mesh_axes)
    torch_order: tuple[int, ...]  # the same ranks in the torch group's order
    index: int  # this rank's index in ``members``
    #: reduce_scatter as an all_to_all and a local reduction (:func:`scatter_by_all_to_all`)
    scatter_by_all_to_all: bool = False

    @property
    def to_torch(self) -> list[int]:
        """``to_torch[t]`` = the partita member index of torch group rank ``t``."""
        return [self.members.index(r) for r in self.torch_order]

    @property
    def same_order(self) -> bool:
        return self.members == self.torch_order


def scatter_by_all_to_all(pg: Any) -> bool:
    """Whether a reduce_scatter on ``pg`` runs as an all_to_all and a local reduction.

    On Gloo it does: Gloo's reduce_scatter costs as much CPU as an all_reduce of the whole
    input or more, while its all_to_all sends each chunk once, straight to its member
    (4 processes, a 16 MB input: 58 against 29 CPU-ms per call over the ranks, the local
    sum included; ``bench/bench_reduce_scatter.py``). NCCL's reduce_scatter is the better
    call there, so every other backend keeps it.
    """
    return dist.get_backend(pg) == "gloo"


def rank_group(pg: Any, members: Sequence[int], rank: int) -> Group:
    """Rank ``rank``'s :class:`Group` on torch process group ``pg``: ``members`` in partita's
    order, the torch group's order, and how its reduce_scatter runs."""
    torch_order = tuple(dist.get_process_group_ranks(pg))
    return Group(pg, tuple(members), torch_order, list(members).index(rank),
                 scatter_by_all_to_all(pg))  # fmt: skip


def group_of(pg: Any) -> Group:
    """This rank's :class:`Group` for a torch process group, its members in the torch group's
    order (the benches time the runtime's own mesh ops on groups they made)."""
    return rank_group(pg, dist.get_process_group_ranks(pg), dist.get_rank())


def timeout_seconds() -> float:
    """The collective timeout of this run: what ``initialize`` used, else the environment."""
    return launch.active_collective_timeout()


def create_mesh_groups(mesh: Mesh, rank: int) -> dict[frozenset[str], dict[int, Any]]:
    """One bounded process group per set of mesh axes and group of more than one device.

    Every rank must call this in the same order (``new_group`` is collective over the world).
    Returns ``{axes: {rank: pg}}`` with an entry only for the group this rank belongs to.
    """
    timeout = datetime.timedelta(seconds=timeout_seconds())
    out: dict[frozenset[str], dict[int, Any]] = {}
    names = mesh.axis_names
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(names, k):
            pgs: dict[int, Any] = {}
            for members in mesh.groups(subset):
                if len(members) == 1:
                    continue
                pg = dist.new_group(sorted(members), timeout=timeout)
                if rank in members:
                    pgs[rank] = pg
            out[frozenset(subset)] = pgs
    return out


def create_check_group(world_size: int) -> Any:
    """A bounded group of every rank, used only for plan checks.

    Its own group, so that a plan check of one rank never meets another rank's program
    collective or ``ShardedTensor.full`` on the default group: Gloo aborts the process when the
    two exchange buffers of different sizes; on separate groups both wait, then time out.
    """
    timeout = datetime.timedelta(seconds=timeout_seconds())
    return dist.new_group(list(range(world_size)), timeout=timeout)


def call_collective(
    node: str,
    kind: str,
    mesh_axes: Sequence[str],
    group: Group | None,
    fn: Callable[[], Any],
    peers: Sequence[int] | None = None,
) -> None:
    """Run ``fn`` (one collective); a failure of it becomes a DistributedError."""
    try:
        fn()
    except (RuntimeError, dist.DistBackendError) as e:
        raise _failure(node, kind, mesh_axes, group, peers, e) from e


def _failure(
    node: str,
    kind: str,
    mesh_axes: Sequence[str],
    group: Group | None,
    peers: Sequence[int] | None,
    cause: BaseException,
) -> DistributedError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = f" at node {node!r}" if node else ""
    if peers is not None:
        members = f" with pairs {list(peers)}"
    elif group is not None:
        members = f" with group ranks {list(group.members)}"
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        members = f" with group ranks {list(range(world))} (every process)"
    text = str(cause).strip()
    first = text.splitlines()[0] if text else repr(cause)
    timeout = timeout_seconds()
    if "timed out" in text.lower() or "timeout" in text.lower():
        why = (
            f"A peer of the group did not reach this collective within the collective timeout "
            f"({timeout:g} s, PARTITA_COLLECTIVE_TIMEOUT): it is stalled (a long step of its "
            f"own, a debugger, swapping), or runs a different number of steps or collectives "
            f"(printing or .full() of a sharded value on some processes only, e.g. under "
            f"is_main_process(): use partita.distributed.log, which gathers on every process)."
        )
    else:
        why = (
            "A peer process has most likely died or stopped (its own log shows why), or it "
            f"was slower than the collective timeout ({timeout:g} s, PARTITA_COLLECTIVE_TIMEOUT)."
        )
    return DistributedError(
        f"{kind}{where} over mesh axes {tuple(mesh_axes)}{members} failed on rank {rank} "
        f"(host {socket.gethostname()}): {first}. {why} The run cannot continue: every "
        f"process must be restarted; if a peer is legitimately slow, raise "
        f"PARTITA_COLLECTIVE_TIMEOUT (or initialize(collective_timeout=...))."
    )


def gather_flat(
    x: Tensor,
    n: int,
    pg: Any,
    node: str,
    kind: str,
    mesh_axes: Sequence[str],
    group: Group | None,
) -> Tensor:
    """``[n, *x.shape]``: every member's ``x`` in torch group order (flat buffers for Gloo)."""
    flat = x.contiguous().reshape(-1)
    out = flat.new_empty(n * flat.numel())
    call_collective(node, kind, mesh_axes, group,
                    lambda: ALL_GATHER(out, flat, group=pg))  # fmt: skip
    return out.reshape(n, *x.shape)


def torch_reduce_op(reduce_op: str) -> Any:
    table = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,  # divided afterwards, exactly as the simulated mesh does
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    if reduce_op not in table:
        raise ArgumentError(f"reduce_op must be one of {tuple(table)}, got {reduce_op!r}.")
    return table[reduce_op]


def finish_avg(total: Tensor, reduce_op: str, n: int) -> Tensor:
    if reduce_op != "avg":
        return total
    if total.is_floating_point() or total.is_complex():
        return total / n
    return torch.div(total, n, rounding_mode="trunc")


def check_divisible(op: str, node: str, x: Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise DistributedError(
            f"{op} at node {node!r}: dim {dim} of local shape {tuple(x.shape)} is not "
            f"divisible by the group size {n}, so it cannot be cut into one chunk per member. "
            f"The partitioner pads every shard it sends to a multiple of the group size, so "
            f"this is a partita bug: report it with the plan (step.lower(*args).explain())."
        )
