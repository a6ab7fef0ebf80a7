"""The collective-permutes of the DistributedMesh on 4 Gloo processes: how they are issued,
what they cost in CPU, and what that does to the pipeline's idle fraction.

Run: ``.venv/bin/python bench/bench_permute.py [--microbatches 4 8 16] [--repeat 5]``
(4 worker processes on 127.0.0.1 through ``partita.runtime.launch.spawn``; rank 0 prints).

Two parts, side by side in one run:

* ``--chain`` (the issue patterns alone): ``--iters`` times, every rank multiplies
  ``--work`` 256x256 matrices, then rank ``r`` sends ``--kb`` KB to ``r + 1`` and receives from
  ``r - 1`` (the pipeline's forward shift), issued in three ways: ``batched`` (one
  ``batch_isend_irecv`` of the isend and the irecv, then wait for both: how the executor
  issued every permute before), ``direct`` (``ProcessGroup.send``/``recv``, the receive posted
  first) and ``posted`` (every receive of the run posted at its start, as
  ``runtime.permute`` does within ``overlap_bytes``). Per permute and per rank: the CPU of the
  whole process inside the permute, the part of it not on the main thread (Gloo's event-loop
  thread), and the wall time.
* the default (the pipeline): the GPipe step of ``bench/bench_pipeline.py`` (mesh
  ``(stage=4,)``, 8 MLP blocks of width 256, remat, micro-batches of 4 x 32 tokens), its permutes
  issued ``batched`` (the old way, ``batch_isend_irecv`` at each permute) or ``posted`` (the
  executor's way now), alternating within each repetition, and between them the stage's real
  work in eager torch (``busy``, as ``bench_pipeline.py`` measures it). Per rank: the step's
  CPU time (every thread of the process), the main thread's, the CPU inside the permutes and
  their count, the CPU inside the other collectives (the all_reduces over the stages, at
  their launch and wait), the main thread's CPU outside the run of the rank's program (the per-call
  checks, inputs, outputs and ``jit``'s lookup); ``idle = 1 - busy CPU / step CPU`` against
  ``(S - 1) / (M + S - 1)``.

``--dispatch`` (one process, no timing of communication): the CPU per op of an fx program of
2000 tiny ``aten.add`` (the floor a rank pays per op, as its program's generated code calls
each op in turn; eager torch pays the same dispatch) and the op count of the pipelined step.

CPU time is the process's (``time.process_time``: every thread, Gloo's included) or the main
thread's (``time.thread_time``); both count only this process's own work, so they depend
less on the machine's load than the wall clock, which is also printed. Medians over the
repetitions, then the mean over the 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_pipeline import STAGES, pipeline_step, run_ranks, stage_work

import partita.distributed as pd
from partita import Mesh
from partita.runtime import permute as permute_mod
from partita.runtime.distributed import DistributedMesh

TAG = permute_mod.TAG


class Clock:
    """CPU (process, main thread) and wall time spent inside the permutes."""

    def __init__(self) -> None:
        self.cpu = self.main = self.wall = 0.0
        self.count = 0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            c, t, w = time.process_time(), time.thread_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            self.cpu += time.process_time() - c
            self.main += time.thread_time() - t
            self.wall += time.perf_counter() - w
            self.count += 1
            return out

        return call

    def reset(self) -> None:
        self.cpu = self.main = self.wall = 0.0
        self.count = 0


CLOCK = Clock()
RUN = Clock()
# every permute the executor binds from now on is timed (node targets are taken at bind time),
# and every run of a rank's program (the rest of a step: checks, inputs, outputs, jit's lookup)
permute_mod.PermuteStream.permute = CLOCK.timed(permute_mod.PermuteStream.permute)  # type: ignore[method-assign]
DistributedMesh.run = RUN.timed(DistributedMesh.run)  # type: ignore[method-assign]
# and the other collectives (the output's and the input gradient's all_reduce over the stages,
# the plan check's all_gather is outside the run), at their launch and their wait
COLL = Clock()
DistributedMesh.start = COLL.timed(DistributedMesh.start)  # type: ignore[method-assign]
DistributedMesh.wait = COLL.timed(DistributedMesh.wait)  # type: ignore[method-assign]


def _streams() -> list[permute_mod.PermuteStream]:
    """The PermuteStreams of every program the DistributedMesh has bound."""
    from partita.runtime.distributed import _EXECUTORS

    out = []
    for _world, ex in _EXECUTORS.values():
        for program in ex._bound.values():
            for node in program.graph.nodes:
                stream = getattr(node.target, "__self__", None)
                if isinstance(stream, permute_mod.PermuteStream) and stream not in out:
                    out.append(stream)
    return out


def _issue(stream: permute_mod.PermuteStream, how: str, budget: int) -> None:
    """``batched``: the old way (``batch_isend_irecv`` at each permute, the path other
    backends take); ``posted``: receives posted ahead within ``budget`` bytes."""
    stream.gloo = how != "batched"
    stream.budget = budget if how == "posted" else 0


def _cpu(fn: Callable[[], object]) -> dict[str, float]:
    dist.barrier()
    CLOCK.reset()
    RUN.reset()
    COLL.reset()
    c, t, w = time.process_time(), time.thread_time(), time.perf_counter()
    fn()
    out = {"cpu": time.process_time() - c, "main": time.thread_time() - t}
    out["wall"] = time.perf_counter() - w
    out.update(perm_cpu=CLOCK.cpu, perm_main=CLOCK.main, perm_wall=CLOCK.wall, perms=CLOCK.count)
    out.update(run_main=RUN.main, coll_cpu=COLL.cpu)
    return out


def measure_step(m: int, mesh: Mesh, rank: int, ns: argparse.Namespace) -> dict[str, Any]:
    layers, _, jitted, weights = pipeline_step(m, mesh, ns.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * ns.rows, ns.seq, ns.width, generator=g)
    for _ in range(2):
        jitted(weights, x)
    streams = [s for s in _streams() if s.routes and len(s.routes) >= m]
    budget = max(s.budget for s in streams)
    real_work = stage_work(layers, rank, m, ns, g)
    real_work()
    samples: dict[str, list[dict[str, float]]] = {"batched": [], "posted": [], "busy": []}
    for how in ("batched", "posted"):  # one warm run each way
        for s in streams:
            _issue(s, how, budget)
        jitted(weights, x)
    for _ in range(ns.repeat):
        for how in ("batched", "posted"):
            for s in streams:
                _issue(s, how, budget)
            samples[how].append(_cpu(lambda: jitted(weights, x)))
        samples["busy"].append(_cpu(real_work))
    for s in streams:
        _issue(s, "posted", budget)
    out: dict[str, Any] = {}
    for how in ("batched", "posted"):
        rows = samples[how]
        out[how] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[how]["idle"] = statistics.median(
            1 - b["cpu"] / r["cpu"] for b, r in zip(samples["busy"], rows, strict=True)
        )
    out["busy"] = statistics.median(r["cpu"] for r in samples["busy"])
    return out


def measure_chain(rank: int, world: int, ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    pg = dist.distributed_c10d._get_default_group()
    x = torch.randn(ns.kb * 256)
    a = torch.randn(256, 256)
    nxt = rank + 1 if rank + 1 < world else None
    prv = rank - 1 if rank > 0 else None

    def batched(_: int) -> torch.Tensor:
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, nxt)] if nxt is not None else []
        ops += [dist.P2POp(dist.irecv, out, prv)] if prv is not None else []
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        return out

    posted: list[tuple[torch.Tensor, Any]] = []

    def direct(i: int) -> torch.Tensor:
        if posted:
            buf, rw = posted[i]
        elif prv is not None:
            buf = torch.empty_like(x)
            rw = pg.recv([buf], prv, TAG)
        sw = pg.send([x], nxt, TAG) if nxt is not None else None
        if prv is not None:
            rw.wait()
        if sw is not None:
            sw.wait()
        return buf if prv is not None else torch.zeros_like(x)

    out: dict[str, dict[str, float]] = {}
    for how in ("batched", "direct", "posted", "batched", "direct", "posted"):
        fn = batched if how == "batched" else direct
        dist.barrier()
        posted.clear()
        if how == "posted" and prv is not None:
            for _ in range(ns.iters):
                b = torch.empty_like(x)
                posted.append((b, pg.recv([b], prv, TAG)))
        clock = Clock()
        timed = clock.timed(fn)
        w0 = time.perf_counter()
        for i in range(ns.iters):
            for _ in range(ns.work):
                a @ a
            timed(i)
        wall = time.perf_counter() - w0
        row = {
            "cpu_ms": clock.cpu / ns.iters * 1e3,
            "gloo_ms": (clock.cpu - clock.main) / ns.iters * 1e3,
            "wall_ms": clock.wall / ns.iters * 1e3,
            "iter_wall_ms": wall / ns.iters * 1e3,
        }
        prev = out.get(how)
        out[how] = row if prev is None else {k: min(prev[k], row[k]) for k in row}
    return out


def dispatch(ns: argparse.Namespace) -> None:
    """The executor's floor per op: an fx program of 2000 ``aten.add`` of 1-element tensors,
    run as a DistributedMesh runs a rank's program (its generated code calls each op), against
    the per-device program of the pipelined step (its ops, LocalMesh-lowered)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = x
    for _ in range(2000):
        y = graph.call_function(torch.ops.aten.add.Tensor, (y, x))
    graph.output(y)
    program = torch.fx.GraphModule(torch.nn.Module(), graph)
    t = torch.ones(1)
    program(t)
    runs = []
    for _ in range(ns.repeat):
        c = time.process_time()
        program(t)
        runs.append((time.process_time() - c) / 2000)
    per_op = statistics.median(runs)
    print(f"# {len(runs)} runs of 2000 aten.add on 1 element; load {os.getloadavg()[0]:.1f}")
    print(f"per op: {per_op * 1e6:.2f} us of CPU (median)")
    for m in ns.microbatches:
        _, _, jitted, weights = pipeline_step(m, Mesh.create((STAGES,), ("stage",)), ns.width)
        plan = jitted.lower(weights, torch.randn(m * ns.rows, ns.seq, ns.width))
        ops = sum(1 for n in plan.local_program.graph.nodes if n.op == "call_function")
        print(f"M={m}: the pipelined step's per-device program has {ops} ops: "
              f"{ops * per_op * 1e3:.1f} ms of that floor per step")  # fmt: skip


def worker(ns: argparse.Namespace) -> None:
    pd.initialize()
    rank, world = pd.process_index(), pd.process_count()
    if ns.chain:
        result: Any = measure_chain(rank, world, ns)
    else:
        mesh = Mesh.create((STAGES,), ("stage",))
        result = {str(m): measure_step(m, mesh, rank, ns) for m in ns.microbatches}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if pd.is_main_process():
        print(json.dumps(gathered))


def report_chain(ranks: list[dict[str, dict[str, float]]], ns: argparse.Namespace) -> None:
    print(
        f"# chain of {len(ranks)} ranks: {ns.iters} iterations of {ns.work} 256x256 matmuls, "
        f"then {ns.kb} KB from r to r+1; per permute, best of 2 runs per rank; load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    head = f"{'issue':>8} {'rank':>4} {'CPU ms':>7} {'Gloo thr ms':>12} {'wall ms':>8}"
    print(head + f" {'iter ms':>8}")
    for how in ranks[0]:
        for r, row in enumerate(ranks):
            c = row[how]
            print(
                f"{how:>8} {r:>4} {c['cpu_ms']:>7.3f} {c['gloo_ms']:>12.3f} "
                f"{c['wall_ms']:>8.3f} {c['iter_wall_ms']:>8.3f}"
            )
        total = sum(row[how]["cpu_ms"] for row in ranks)
        print(f"{how:>8} {'sum':>4} {total:>7.3f}")


def report_step(ranks: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    print(
        f"# GPipe step of bench_pipeline.py (mesh (stage={STAGES},), micro-batch {ns.rows} x "
        f"{ns.seq} x {ns.width}); {ns.repeat} repetitions, medians per rank; CPU in s per "
        f"step; load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"{'M':>3} {'issue':>8} {'rank':>4} {'step CPU':>9} {'main thr':>9} {'other thr':>10} "
        f"{'in permutes':>12} {'permutes':>9} {'other coll':>11} {'outside run':>12} "
        f"{'busy CPU':>9} "
        f"{'idle CPU':>9} {'theory':>7} {'wall':>7}"
    )
    for m in ns.microbatches:
        theory = (STAGES - 1) / (m + STAGES - 1)
        for how in ("batched", "posted"):
            for r, row in enumerate(ranks):
                c, busy = row[str(m)][how], row[str(m)]["busy"]
                print(
                    f"{m:>3} {how:>8} {r:>4} {c['cpu']:>9.4f} {c['main']:>9.4f} "
                    f"{c['cpu'] - c['main']:>10.4f} {c['perm_cpu']:>12.4f} {c['perms']:>9.0f} "
                    f"{c['coll_cpu']:>11.4f} {c['main'] - c['run_main']:>12.4f} {busy:>9.4f} "
                    f"{c['idle']:>9.3f} "
                    f"{theory:>7.3f} {c['wall']:>7.3f}"
                )
            mean = statistics.fmean(row[str(m)][how]["idle"] for row in ranks)
            perm = statistics.fmean(row[str(m)][how]["perm_cpu"] for row in ranks)
            cpu = statistics.fmean(row[str(m)][how]["cpu"] for row in ranks)
            print(
                f"{m:>3} {how:>8} {'mean':>4} {cpu:>9.4f} {'':>9} {'':>10} {perm:>12.4f} "
                f"{'':>9} {'':>11} {'':>12} {'':>9} {mean:>9.3f} {theory:>7.3f}   idle - theory "
                f"{mean - theory:+.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--chain", action="store_true", help="the issue patterns alone")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--work", type=int, default=6)
    parser.add_argument("--kb", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dispatch", action="store_true", help="per-op floor, one process")
    ns = parser.parse_args()
    if ns.dispatch:
        dispatch(ns)
        return
    if ns.worker:
        worker(ns)
        return
    (report_chain if ns.chain else report_step)(run_ranks(Path(__file__), "["), ns)


if __name__ == "__main__":
    main()
