"""Where a step's local CPU goes, ATen op by ATen op, against the unsharded step's same op.

Runs the GPT step of ``bench_distributed.py`` as ``--config``: ``2-D`` (partita, ``(2, 2)``
data x model on 4 Gloo processes), ``fsdp`` (partita, ``(4,)``) or ``unsharded`` (eager torch,
one process, the whole batch, ``torch.optim.AdamW``). Every process runs one thread
(``OMP_NUM_THREADS=1``). After 3 warm-ups, ``--steps`` steps run with partita's mesh-op ranges
clocked (``runtime.breakdown.clocked_ranges``: a collective's launch and wait, their copies
and Gloo calls, as one number) under a dispatch mode that reads the thread's CPU clock
(``time.thread_time``) around every other top-level ATen op (below autograd: the unsharded
step's backward ops are counted as the ops they run). The per-op CPU per step is summed over
the ranks, so a row compares directly with the unsharded step's: together the ranks do the
same FLOPs. Printed: the step's thread CPU, the collectives' ranges, then each op (its
overload) with its calls and CPU per step, and with ``--shapes`` the ``--top`` most expensive
(op, input shapes) pairs. The clock costs some microseconds per op outside the ops it times.
``python bench/rank_ops.py --config 2-D`` (then ``--config unsharded``, and compare).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_distributed as bd
from rank_nodes import rank_result


def _shapes(args: Any) -> str:
    import torch

    return ",".join(
        "x".join(map(str, a.shape)) if isinstance(a, torch.Tensor) else "-"
        for a in args
        if isinstance(a, torch.Tensor) or isinstance(a, (list, tuple))
    )


def _range_kind(name: str) -> str:
    """``partita.wait all_gather_bucket[data] 1536 B ...`` -> ``wait all_gather_bucket[data]``."""
    words = name.removeprefix("partita.").split(" ")
    return " ".join(words[:2]) if words[0] == "wait" else words[0]


def worker(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd.profiler import record_function

    import partita.distributed as pd
    from partita import Mesh
    from partita.runtime import ranges
    from partita.runtime.breakdown import OpClock, RangeClock, _ClockedRange, _mesh_range

    by_range: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    clocks: list[Any] = []  # the ranges' clock: the open range's kind

    class Named(_ClockedRange):
        def __enter__(self) -> Any:
            self._clock.names.append(_range_kind(self.name))
            return super().__enter__()

    class ByName(RangeClock):
        """The mesh ops' ranges' thread CPU by kind (the outermost range's)."""

        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __call__(self, name: str, args: str | None = None) -> Any:
            return Named(self, name, args) if _mesh_range(name) else record_function(name, args)

        def stop(self) -> None:
            before = self.seconds
            super().stop()
            if self._open == 0:
                row = by_range[self.names[0]]
                row[0] += self.seconds - before
                row[1] += 1
                self.names.clear()

    @contextmanager
    def clocked_ranges() -> Iterator[ByName]:  # runtime.breakdown.clocked_ranges, by kind
        clock = ByName()
        clocks[:] = [clock]
        torch.autograd.profiler._set_is_profiler_enabled(True)
        ranges.record_function = clock  # type: ignore[assignment]
        try:
            yield clock
        finally:
            ranges.record_function = record_function
            torch.autograd.profiler._set_is_profiler_enabled(False)

    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    shapes: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])

    class PerOp(OpClock):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.namespace == "profiler":
                return self._range(func, args, kwargs or {})
            start = time.thread_time()
            out = func(*args, **(kwargs or {}))
            cpu = time.thread_time() - start
            if self._in_mesh:  # inside a mesh op's range (already in its clock): apart
                where = clocks[0].names[0] if clocks and clocks[0].names else "a mesh op"
                name = f"(in {where}) {func}"
                ops[name][0] += cpu
                ops[name][1] += 1
            else:
                name = str(func)
                ops[name][0] += cpu
                ops[name][1] += 1
                if ns.shapes:
                    key = f"{name} {_shapes(args)}"
                    shapes[key][0] += cpu
                    shapes[key][1] += 1
            return out

    bd.CFG = bd.gpt_config(ns.layers)
    pd.initialize()
    if ns.config == "unsharded":
        one = bd.bench_unsharded_step()
    else:
        shape, axes = ((2, 2), ("data", "model")) if ns.config == "2-D" else ((4,), ("data",))
        one = bd.PartitaStep(Mesh.create(shape, axes)).one
    for _ in range(3):
        one()
    dist.barrier()
    start = time.thread_time()
    with clocked_ranges() as in_ranges, PerOp():
        for _ in range(ns.steps):
            one()
    step = (time.thread_time() - start) / ns.steps
    gathered: list[Any] = [None] * dist.get_world_size()
    local = (step, in_ranges.seconds / ns.steps, dict(ops), dict(shapes), dict(by_range))
    dist.all_gather_object(gathered, local)
    if dist.get_rank() != 0:
        return
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    total_shapes: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    total_ranges: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for _, _, o, s, rg in gathered:
        for src, dst in ((o, total), (s, total_shapes), (rg, total_ranges)):
            for k, (cpu, n) in src.items():
                dst[k][0] += cpu / ns.steps * 1e3
                dst[k][1] += n / ns.steps
    print("RESULT " + json.dumps({
        "step_ms": [g[0] * 1e3 for g in gathered],
        "ranges_ms": [g[1] * 1e3 for g in gathered],
        "ops": sorted(total.items(), key=lambda kv: -kv[1][0]),
        "ranges": sorted(total_ranges.items(), key=lambda kv: -kv[1][0]),
        "shapes": sorted(total_shapes.items(), key=lambda kv: -kv[1][0])[: ns.top],
        "torch": torch.__version__,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=["2-D", "fsdp", "unsharded"], default="2-D")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--shapes", action="store_true", help="also by (op, input shapes)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    argv = [__file__, "--worker", "--config", ns.config, "--layers", str(ns.layers)]
    argv += ["--steps", str(ns.steps), "--top", str(ns.top)] + (["--shapes"] if ns.shapes else [])
    world = 1 if ns.config == "unsharded" else 4
    r = rank_result(argv, world)
    if ns.json:
        Path(ns.json).write_text(json.dumps(r))
    step, in_ranges = sum(r["step_ms"]), sum(r["ranges_ms"])
    in_ops = sum(cpu for name, (cpu, _) in r["ops"] if not name.startswith("(in "))
    print(f"# {ns.config} GPT {ns.layers} layers, {world} process(es), {ns.steps} steps, "
          f"torch {r['torch']}; ms per step summed over the ranks")  # fmt: skip
    print(
        f"step thread {step:.1f} ms (per rank {', '.join(f'{s:.1f}' for s in r['step_ms'])}); "
        f"mesh-op ranges {in_ranges:.1f}; ops {in_ops:.1f}; rest {step - in_ranges - in_ops:.1f}"
    )
    print(f"{'ms/step':>8} {'calls':>7}  mesh op range (launch, or wait)")
    for name, (cpu, n) in r["ranges"]:
        print(f"{cpu:8.2f} {n:7.1f}  {name}")
    print(f"{'ms/step':>8} {'calls':>7}  op")
    for name, (cpu, n) in r["ops"]:
        print(f"{cpu:8.2f} {n:7.1f}  {name}")
    if r["shapes"]:
        print("by (op, input shapes):")
        for name, (cpu, n) in r["shapes"]:
            print(f"{cpu:8.2f} {n:7.1f}  {name}")


if __name__ == "__main__":
    main()
