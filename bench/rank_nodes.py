"""Where a rank's step goes, node by node: rank 0's thread CPU per step in each kind of node.

Runs the GPT step of ``bench_distributed.py`` (``--mesh 2-D``: ``(2, 2)`` data x model, or
``fsdp``: ``(4,)``) on 4 Gloo processes; after 3 warm-ups, ``--steps`` steps run the bound
rank program (``DistributedMesh._bound``: the program as it runs, collectives as launch and
wait) through an ``fx.Interpreter`` that reads the thread's CPU clock and minor page faults
around every node. Rank 0 prints per step the thread CPU of the whole step and of its nodes,
then each kind of node (its target; a collective's launch and wait by the op they run) with its
count, and the ``--top`` most expensive nodes. The interpreter costs some microseconds per
node outside the nodes it times (``getitem`` and views look dearer than in the generated code),
so compare kinds, not totals, with a step run the usual way:
``python bench/rank_nodes.py --mesh 2-D``.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_distributed as bd

CPU: dict[str, float] = collections.defaultdict(float)
FAULTS: dict[str, int] = collections.defaultdict(int)


def _kind(n: Any) -> str:
    if n.op != "call_function":
        return n.op
    name = str(getattr(n.target, "__name__", n.target))
    if name == "start":
        return f"start:{n.args[0]}"
    if name == "wait":
        return f"wait:{n.args[0].args[0]}"
    return name


def worker(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import fx
    from torch.utils import _pytree as pytree

    import partita.distributed as pd
    from partita import Mesh
    from partita.runtime.distributed import DistributedMesh

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start = time.thread_time()
            out = super().run_node(n)
            CPU[n.name] += time.thread_time() - start
            FAULTS[n.name] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
            return out

    def run_timed(self: DistributedMesh, gm: Any, local_inputs: Any, options: Any = None) -> Any:
        timed = Timed(self._bound[gm])
        timed.extra_traceback = False
        return pytree.tree_leaves(timed.run(*local_inputs))

    bd.CFG = bd.gpt_config(ns.layers)
    pd.initialize()
    shape, axes = ((2, 2), ("data", "model")) if ns.mesh == "2-D" else ((4,), ("data",))
    run = bd.PartitaStep(Mesh.create(shape, axes))
    for _ in range(3):
        run.one()
    (executor,) = _distributed_executors()  # the step's mesh: the only one of this process
    (program,) = executor._bound.values()
    DistributedMesh.run = run_timed  # type: ignore[method-assign]
    start = time.thread_time()
    for _ in range(ns.steps):
        run.one()
    step = (time.thread_time() - start) / ns.steps
    if dist.get_rank() != 0:
        return
    nodes = {n.name: n for n in program.graph.nodes}
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    for name, cpu in CPU.items():
        row = per[_kind(nodes[name])]
        row[0] += cpu / ns.steps * 1e3
        row[1] += FAULTS[name] / ns.steps
        row[2] += 1
    top = sorted(CPU.items(), key=lambda kv: -kv[1])[: ns.top]
    print("RESULT " + json.dumps({
        "step_ms": step * 1e3,
        "nodes_ms": sum(CPU.values()) / ns.steps * 1e3,
        "nodes": len(program.graph.nodes),
        "kinds": sorted(per.items(), key=lambda kv: -kv[1][0]),
        "top": [(k, _kind(nodes[k]), v / ns.steps * 1e3) for k, v in top],
        "torch": torch.__version__,
    }))  # fmt: skip


def _distributed_executors() -> list[Any]:
    from partita.runtime.distributed import _EXECUTORS  # read by a bench

    return [executor for _world, executor in _EXECUTORS.values()]


def rank_result(argv: list[str], world: int, timeout: float = 1800) -> Any:
    """Run ``argv`` (a ``--worker`` command) on ``world`` single-thread Gloo processes and
    return rank 0's last ``RESULT`` JSON line; a failed rank exits with its stderr."""
    from partita.runtime.launch import spawn

    results = spawn(argv, world, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
    if any(r.returncode for r in results) or not lines:
        bad = next((r for r in results if r.returncode), results[0])
        sys.exit(f"failed (rank {bad.rank}): {bad.stderr.strip()[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", choices=["2-D", "fsdp"], default="2-D")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    argv = [__file__, "--worker", "--mesh", ns.mesh, "--layers", str(ns.layers)]
    argv += ["--steps", str(ns.steps), "--top", str(ns.top)]
    r = rank_result(argv, 4)
    print(f"# {ns.mesh} GPT {ns.layers} layers, rank 0, {ns.steps} steps, torch {r['torch']}")
    print(f"thread CPU per step {r['step_ms']:.1f} ms, in the program's {r['nodes']} nodes "
          f"{r['nodes_ms']:.1f} ms")  # fmt: skip
    print(f"{'ms/step':>8} {'faults':>7} {'count':>6}  kind")
    for kind, (ms, faults, count) in r["kinds"]:
        print(f"{ms:8.2f} {faults:7.0f} {count:6d}  {kind}")
    print("most expensive nodes (ms/step):")
    for name, kind, ms in r["top"]:
        print(f"{ms:8.2f}  {name} ({kind})")


if __name__ == "__main__":
    main()
