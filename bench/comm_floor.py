"""The communication floor of a partita step: its collectives replayed alone, no compute.

:func:`plan_calls` lists the torch.distributed calls one run of a Plan makes on this rank, in
program order: each collective in no bucket (``plan.collectives``), each bucket as one call of
its members' summed bytes (``plan.buckets``, as ``partition.estimate.collective_calls`` counts
them), with its kind, per-device bytes (XLA's convention: the output of an all_gather,
all_reduce or all_to_all, the input of a reduce_scatter), dtype and this rank's device group.
:func:`replay` runs them on the same processes with preallocated buffers, each launched and
waited for at once (the DistributedMesh overlaps them with compute; with no compute there is
nothing to overlap; a reduce_scatter is the runtime's own, ``runtime.dist_ops``: on Gloo an
all_to_all and the local sum), and returns the CPU and wall time of one pass: what the step's
bytes cost the machine through Gloo with nothing else to do. A bucket runs where its first
member is for a gather (the parameters are there before the program starts) and where its last
member is otherwise (its last value is ready then). A collective_permute is replayed as a shift
by one along its group, its bytes each way (the 2-D GPT plan's 8 run over ``model``, groups of
two: an exchange either way; a permute whose pairs leave members out sends more here than it
does).

Used by ``bench_distributed.py``; it never compiles or runs a program.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from partita.runtime import dist_ops
from partita.runtime.comm import group_of

ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Call:
    """One torch.distributed call of a step on this rank: ``kind`` (a bucket's is its
    members'), per-device ``bytes``, ``dtype`` and ``members``, the ranks of its group."""

    kind: str
    bytes: int
    dtype: torch.dtype
    members: tuple[int, ...]


def plan_calls(plan: Any, rank: int) -> list[Call]:
    """The calls of one run of ``plan`` on ``rank``, in program order (module doc)."""
    buckets = {i: b for b in plan.buckets for i in b.members}
    calls = []
    for i, c in enumerate(plan.collectives):
        b = buckets.get(i)
        at = None if b is None else (b.members[0] if b.kind == "all_gather" else b.members[-1])
        if b is not None and at != i:
            continue
        nbytes = c.bytes if b is None else plan.bucket_bytes(b)
        members = next(g for g in c.groups if rank in g)
        calls.append(Call(c.kind, nbytes, c.dtype, tuple(sorted(members))))
    return calls


def make_groups(plan: Any) -> dict[tuple[int, ...], Any]:
    """One process group per device group of the plan's collectives (every rank calls
    ``new_group`` for every group, in the same order); ``{members: group}`` of this rank's."""
    rank, out, seen = dist.get_rank(), {}, set()
    for c in plan.collectives:
        for g in c.groups:
            members = tuple(sorted(g))
            if members in seen or len(members) == 1:
                continue
            seen.add(members)
            pg = dist.new_group(list(members))
            if rank in members:
                out[members] = pg
    return out


def _launcher(call: Call, pg: Any) -> Any:
    """A function that runs ``call`` once on buffers made now, and waits for it."""
    n = len(call.members)
    item = torch.empty((), dtype=call.dtype).element_size()
    numel = call.bytes // item
    big = torch.zeros(numel, dtype=call.dtype)
    if call.kind == "all_gather":
        small = torch.zeros(numel // n, dtype=call.dtype)
        return lambda: ALL_GATHER(big, small, group=pg, async_op=True).wait()
    if call.kind == "reduce_scatter":  # the runtime's own (on Gloo an all_to_all and a sum)
        g = group_of(pg)
        return lambda: dist_ops.run(dist_ops.reduce_scatter(g, big, 0, "sum", ["floor"], ""))
    if call.kind == "all_reduce":
        return lambda: dist.all_reduce(big, group=pg, async_op=True).wait()
    if call.kind == "all_to_all":
        recv = torch.empty_like(big)
        return lambda: dist.all_to_all_single(recv, big, group=pg, async_op=True).wait()
    if call.kind == "collective_permute":
        me = call.members.index(dist.get_rank())
        to, frm = call.members[(me + 1) % n], call.members[(me - 1) % n]
        recv = torch.empty_like(big)

        def shift() -> None:
            ops = [dist.P2POp(dist.isend, big, to, pg), dist.P2POp(dist.irecv, recv, frm, pg)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return shift
    raise ValueError(f"no replay for a {call.kind!r} call")


def replay(plan: Any, repeat: int) -> dict[str, float]:
    """Run the calls of one step of ``plan`` ``repeat`` times after two warm-ups: the median
    CPU seconds per pass summed over the ranks (``cpu``; ``threads``: of it, the processes'
    threads other than the caller's: Gloo's), the median wall time (max over ranks) and the
    calls per pass."""
    groups = make_groups(plan)
    rank = dist.get_rank()
    runs = [_launcher(c, groups[c.members]) for c in plan_calls(plan, rank) if len(c.members) > 1]

    def one() -> None:
        for run in runs:
            run()

    one()
    one()
    cpus, mains, walls = [], [], []
    for _ in range(repeat):
        dist.barrier()
        w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
        one()
        mains.append(time.thread_time() - t)
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    cpu = statistics.median(cpus)
    cpu = torch.tensor([cpu, max(0.0, cpu - statistics.median(mains))])
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    wall = torch.tensor([statistics.median(walls)])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return {"cpu": float(cpu[0]), "threads": float(cpu[1]), "wall": float(wall), "calls": len(runs)}
