"""Minor page faults per step in partita's bucketed collectives, on 4 Gloo processes.

Each of ``runtime.dist_ops``' bucket ops is wrapped to count this rank's minor page faults
(``ru_minflt``) and thread CPU in its launch (before the yield) and at its wait (after it), over
``--steps`` steps of the GPT's FSDP step (``bench_distributed.PartitaStep``) after 3 warm-ups;
rank 0 prints the counts per step, by op kind, and the step's own faults. Page faults count
the fresh memory a step touches, whatever the load: ``python bench/bucket_faults.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_distributed as bd

KINDS = ("all_gather_bucket", "reduce_scatter_bucket", "all_reduce_bucket")
COUNTS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0])


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _wrap() -> None:
    from partita.runtime import dist_ops

    for kind in KINDS:
        original = getattr(dist_ops, kind)

        def wrapped(*a: Any, _o: Any = original, _k: str = kind, **k: Any) -> Any:
            c = COUNTS[_k]
            f, t = _faults(), time.thread_time()
            gen = _o(*a, **k)
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value
            finally:
                c[0] += _faults() - f
                c[1] += time.thread_time() - t
                c[4] += 1
            yield
            f, t = _faults(), time.thread_time()
            try:
                while True:
                    next(gen)
            except StopIteration as stop:
                return stop.value
            finally:
                c[2] += _faults() - f
                c[3] += time.thread_time() - t

        setattr(dist_ops, kind, wrapped)


def worker(ns: argparse.Namespace) -> None:
    import partita.distributed as pd
    from partita import Mesh

    bd.CFG = bd.gpt_config(ns.layers)
    pd.initialize()
    _wrap()
    run = bd.PartitaStep(Mesh.create((4,), ("data",)))
    for _ in range(3):
        run.one()
    COUNTS.clear()
    f0 = _faults()
    for _ in range(ns.steps):
        run.one()
    step = (_faults() - f0) / ns.steps
    row = {k: [v[0] / ns.steps, v[1] * 1e3 / ns.steps, v[2] / ns.steps, v[3] * 1e3 / ns.steps,
               v[4] // ns.steps] for k, v in COUNTS.items()}  # fmt: skip
    row["step"] = [step]
    if pd.is_main_process():
        print("RESULT " + json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    from partita.runtime.launch import spawn

    argv = [__file__, "--worker", "--layers", str(ns.layers), "--steps", str(ns.steps)]
    results = spawn(argv, 4, env=bd.CONFIGS["partita fsdp (4,)"][1], timeout=1800)
    for r in results:
        if r.returncode:
            print(f"rank {r.rank} failed: {r.stderr.strip()[-2000:]}")
    line = next(ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT "))
    row = json.loads(line.removeprefix("RESULT "))
    print("rank 0, per step: kind: calls, minor faults at launch / ms thread CPU, at wait / ms")
    for k, v in row.items():
        if k != "step":
            print(f"  {k}: {v[4]} calls, {v[0]:.0f} / {v[1]:.2f} ms, {v[2]:.0f} / {v[3]:.2f} ms")
    print(f"  whole step: {row['step'][0]:.0f} minor faults")


if __name__ == "__main__":
    main()
