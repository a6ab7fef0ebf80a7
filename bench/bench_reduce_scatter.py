"""Gloo's reduce_scatter against the runtime's (an all_to_all and a local sum), call and step.

Run: ``.venv/bin/python bench/bench_reduce_scatter.py [--calls] [--step fsdp|2-D] [--rounds 8]``

``--calls`` (the default): 4 single-thread Gloo processes on 127.0.0.1 time, one kind after
the other in rounds, each call alone after a barrier: Gloo's ``reduce_scatter``, its
``all_reduce``, the runtime's reduce_scatter (``runtime.dist_ops``: ``all_to_all_single`` of the
member-major buffer and the sum of the received rows) and an ``all_gather`` of the same bytes,
over all 4 processes and over two pairs at once (a (2, 2) mesh's ``data`` groups), for inputs
of 64 KB to 16 MB per rank. Printed per call: the CPU of all 4 processes (every thread,
``resource.getrusage``) and the wall time, medians over ``--rounds`` rounds of 5 calls.

``--step fsdp`` or ``--step 2-D``: the GPT step of ``bench_distributed.py`` (4 layers) in the
same 4 processes, alternating every 4 steps between Gloo's reduce_scatter and the runtime's;
for ``2-D`` also between the example's old parameter specs (column-parallel biases whole over
``data``) and its current ones. CPU per step of all threads summed over the ranks, the median
over ``--rounds`` blocks, each variant's blocks in turn (the order reversed every round), so a
change of the machine's load hits every variant alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_nodes import rank_result

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _kinds(pg: Any, g: Any, n: int, numel: int) -> dict[str, Any]:
    """Each timed kind as a call on buffers of ``numel`` floats (the input of a reduce)."""
    import torch
    import torch.distributed as dist

    from partita.runtime import dist_ops
    from partita.runtime.comm import REDUCE_SCATTER

    x, out, full = torch.ones(numel), torch.empty(numel // n), torch.empty(numel)
    return {
        "Gloo reduce_scatter": lambda: REDUCE_SCATTER(out, x, group=pg),
        "all_reduce": lambda: dist.all_reduce(x, group=pg),
        "all_to_all + sum": lambda: dist_ops.run(
            dist_ops.reduce_scatter(g, x, 0, "sum", ["bench"], "")
        ),
        "all_gather": lambda: dist.all_gather_into_tensor(full, out, group=pg),
    }


def _calls(rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from partita.runtime.comm import group_of

    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    rows: dict[str, list[float]] = {}
    for label, pg in (("4 ranks", dist.group.WORLD), ("2 x 2 ranks", pairs[rank // 2])):
        g, n = group_of(pg), dist.get_world_size(pg)
        for size in SIZES:
            kinds = _kinds(pg, g, n, size // 4)
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
            for fn in kinds.values():
                fn()
            for _ in range(rounds):
                for kind, fn in kinds.items():
                    dist.barrier()
                    cpu, wall = _cpu(), time.perf_counter()
                    for _ in range(5):
                        fn()
                    dist.barrier()
                    times[kind].append(((_cpu() - cpu) / 5, (time.perf_counter() - wall) / 5))
            for kind, ts in times.items():
                cpu_ms = torch.tensor([statistics.median(c for c, _ in ts) * 1e3])
                dist.all_reduce(cpu_ms)  # every process's CPU
                wall_ms = statistics.median(w for _, w in ts) * 1e3
                rows[f"{label}|{size}|{kind}"] = [float(cpu_ms), wall_ms]
    return rows


def _step(config: str, rounds: int) -> dict[str, Any]:
    import bench_distributed as bd
    import torch
    import torch.distributed as dist

    from partita import Mesh, P
    from partita.runtime import dist_ops

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_gpt

    native = [False]
    ours = dist_ops._scatter_reduced

    def chosen(node: str, kind: str, axes: Any, g: Any, flat: Any, op: str) -> Any:
        if native[0]:
            g = dataclasses.replace(g, scatter_by_all_to_all=False)
        return ours(node, kind, axes, g, flat, op)

    dist_ops._scatter_reduced = chosen  # type: ignore[assignment]

    def old_spec(name: str, p: torch.Tensor, mesh: Mesh) -> P:
        if name.endswith(train_gpt.COLUMN) and p.ndim == 1:
            return P("model")
        return train_gpt.param_spec(name, p, mesh)

    bd.CFG = bd.gpt_config(4)
    if config == "2-D":
        mesh = Mesh.create((2, 2), ("data", "model"))
        steps = {"old specs": bd.PartitaStep(mesh, old_spec), "specs": bd.PartitaStep(mesh)}
    else:
        steps = {"fsdp": bd.PartitaStep(Mesh.create((4,), ("data",)))}
    variants = [(s, nat) for s in steps for nat in (True, False)]
    for s, nat in variants:
        native[0] = nat
        steps[s].one()
        steps[s].one()
    cpu: dict[str, list[float]] = {}
    for r in range(rounds):
        for s, nat in variants if r % 2 == 0 else variants[::-1]:
            native[0] = nat
            dist.barrier()
            start = _cpu()
            for _ in range(4):
                steps[s].one()
            dist.barrier()
            total = torch.tensor([(_cpu() - start) / 4])
            dist.all_reduce(total)
            name = f"{s}, {'Gloo reduce_scatter' if nat else 'all_to_all + sum'}"
            cpu.setdefault(name, []).append(float(total) * 1e3)
    return cpu


def worker(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import partita.distributed as pd

    pd.initialize()
    torch.set_num_threads(1)
    result = _step(ns.step, ns.rounds) if ns.step else _calls(ns.rounds)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"result": result, "torch": torch.__version__}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true", help="the per-call table (default)")
    parser.add_argument("--step", choices=["fsdp", "2-D"], help="the GPT step, paired")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    argv = [__file__, "--worker", "--rounds", str(ns.rounds)]
    argv += ["--step", ns.step] if ns.step else []
    r = rank_result(argv, 4)
    print(f"# 4 Gloo processes (OMP_NUM_THREADS=1), torch {r['torch']}")
    if ns.step:
        print(f"{'variant':<42} {'CPU/step (ms, all ranks)':>26}   blocks")
        for name, values in r["result"].items():
            blocks = " ".join(f"{v:.0f}" for v in values)
            print(f"{name:<42} {statistics.median(values):26.1f}   {blocks}")
        return
    print(f"{'group':<12} {'input/rank':>10} {'kind':<20} {'CPU/call (ms)':>14} {'wall (ms)':>10}")
    for key, (cpu, wall) in r["result"].items():
        label, size, kind = key.split("|")
        print(f"{label:<12} {int(size) / 2**20:8.3g} MB {kind:<20} {cpu:14.2f} {wall:10.2f}")


if __name__ == "__main__":
    main()
