"""The cost of the per-call plan check: a 4-Gloo GPT-S training step with it on and off.

Run: ``.venv/bin/python bench/bench_rank_check.py [--pairs 10] [--calls 200]`` (starts 4 worker
processes on 127.0.0.1 through ``partita.runtime.launch.spawn``, ``OMP_NUM_THREADS=1`` each;
rank 0's report is printed).

The step is ``bench_distributed.py``'s ``partita fsdp (4,)`` row: GPT (4 layers, width 256, 8
heads, vocabulary 512, sequence 128, global batch 16), cross entropy, AdamW, parameters and
batch split over ``data``. Before every run of a program the DistributedMesh all-gathers one
int64 per rank (``runtime.plan_check.check_same_program``) unless the option ``check_calls`` is
off. Two measures:

* ``step``: after two warm-ups, ``--pairs`` pairs of steps, one with the check and one without
  (``partita.options.using(check_calls=...)``; the order alternates within each pair, so a
  drift of the machine's load hits both alike). Each step's time is the max over the ranks;
  the medians and their ratio are printed. On a shared 2-core machine the step's own noise is
  larger than the check, so the difference of two medians is only an upper bound.
* ``check alone``: ``--calls`` calls of the check by itself between barriers (the all-gather
  and the Python around it, what a call adds), median over calls, max over ranks; printed as
  a fraction of the step median without the check.

The machine's load average is printed before and after: the numbers are comparable only under
a similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import partita.distributed as pd
from partita import Mesh
from partita.options import using
from partita.runtime.distributed import distributed_executor
from partita.runtime.plan_check import call_digest, check_same_program, run_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_distributed import BATCH, CFG, PartitaStep, _load, param_spec

WORLD = 4


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(ns: argparse.Namespace) -> None:
    pd.initialize()
    mesh = Mesh.create((WORLD,), ("data",))
    run = PartitaStep(mesh, param_spec)
    one = run.one
    one()
    one()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(ns.pairs):
        for check in (True, False) if i % 2 == 0 else (False, True):
            with using(check_calls=check):
                dist.barrier()
                start = time.perf_counter()
                one()
                times[check].append(time.perf_counter() - start)
    on = statistics.median(_max_over_ranks(times[True]))
    off = statistics.median(_max_over_ranks(times[False]))

    compiled = run.step._compile((run.params, {}, run.state, run.batch), {})[0]
    executor = distributed_executor(mesh)
    assert executor is not None
    digest = call_digest(compiled)
    alone = []
    for _ in range(ns.calls):
        dist.barrier()
        start = time.perf_counter()
        if run_options().check_calls:  # what CallChecks.program reads per call
            check_same_program(compiled, digest, mesh, executor._check_pg)
        alone.append(time.perf_counter() - start)
    check = statistics.median(_max_over_ranks(alone))
    if pd.is_main_process():
        row = {"on": on, "off": off, "check": check, "pairs": ns.pairs, "calls": ns.calls}
        print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="pairs of timed steps (on, off)")
    parser.add_argument("--calls", type=int, default=200, help="calls of the check alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    from partita.runtime.launch import spawn

    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"# GPT-S: {CFG.n_layer} layers, d_model={CFG.d_model}, heads={CFG.n_head}, "
          f"vocab={CFG.vocab_size}, seq={CFG.seq_len}, batch={BATCH}, AdamW, fsdp over 4 Gloo "
          f"processes (OMP_NUM_THREADS=1 each), torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(_load())
    argv = [__file__, "--worker", "--pairs", str(ns.pairs), "--calls", str(ns.calls)]
    results = spawn(argv, WORLD, timeout=1800)
    lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
    if any(r.returncode for r in results) or not lines:
        bad = next((r for r in results if r.returncode), results[0])
        print(f"failed (rank {bad.rank}): {bad.stderr.strip()[-1500:]}")
        sys.exit(1)
    r = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"step with the per-call check     {r['on'] * 1e3:9.2f} ms (median of {r['pairs']})")
    print(f"step without it                  {r['off'] * 1e3:9.2f} ms (median of {r['pairs']})")
    print(f"ratio with / without             {r['on'] / r['off']:9.4f}")
    print(f"check alone, per call            {r['check'] * 1e3:9.3f} ms (median of "
          f"{r['calls']}, max over ranks)")  # fmt: skip
    print(f"check alone / step without it    {r['check'] / r['off'] * 100:8.2f} %")
    print(_load())


if __name__ == "__main__":
    main()
