"""The step time with the profiler OFF, before and after partita's profiler ranges, same run.

Run: ``.venv/bin/python bench/bench_profiler_ranges.py [--before REV] [--rounds 5]
[--steps 30]``.

Off the profiler, the executors read one flag per step (``runtime.ranges.enabled``) and take
their path without ranges. This bench checks that it costs nothing measurable: ``REV``'s
``src/`` (default: the commit before the ranges, ``b3d27b9``) is extracted with ``git archive``
into a temporary directory, and child processes on it (``before``) and on this tree
(``after``) alternate, ``--rounds`` times each, so both see the same machine load. Each child
times ``--steps`` steps (after 3 warm-ups) and reports their median; the table gives the median
over rounds of those medians (wall time), their ratio, the median of the per-round ratios
(each round runs both back to back) and the ratio of the CPU-time medians (less sensitive to
other processes on a busy machine). A last column (one child) runs ``after`` under
``torch.profiler`` (ranges on), to show what the ranges cost when they are wanted.

Workloads, on the LocalMesh:

* ``gpt-demo``: the ``python -m partita demo`` training step (2-layer GPT, width 32, mesh
  2x4, ``fsdp+tp``: 61 collectives in 27 calls);
* ``tiny``: a jitted ``relu(x @ w).sum(0)`` on a 2x2 mesh (one all_reduce): a step of a few
  hundred microseconds, where a per-step cost would show most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(workload: str, steps: int, profile: bool) -> tuple[float, float]:
    """Median wall and CPU seconds of one step of ``workload`` (in this process, on its
    ``partita``)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    import partita
    from partita import Mesh, P

    torch.manual_seed(0)
    if workload == "tiny":
        mesh = Mesh.create((2, 2), ("data", "model"))
        fn = partita.jit(
            lambda x, w: torch.relu(x @ w).sum(0),
            mesh=mesh, in_specs=(P("data", None), P(None, "model")),
        )  # fmt: skip
        args: tuple = (torch.randn(64, 32), torch.randn(32, 48))

        def run() -> None:
            fn(*args)
    else:
        from partita.models import GPT, GPTConfig

        cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=32, seq_len=16, bias=False)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        step = partita.train_step(
            model, loss_fn, opt, mesh=Mesh.create((2, 4), ("data", "model")),
            param_specs="fsdp+tp",
        )  # fmt: skip
        ids = torch.randint(0, 32, (16, 16))
        batch = (ids, torch.roll(ids, -1, dims=1))

        def run() -> None:
            step(batch)

    for _ in range(3):
        run()
    times: list[float] = []
    cpu_times: list[float] = []
    ctx = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if profile
        else None
    )
    if ctx is not None:
        ctx.__enter__()
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return statistics.median(times), statistics.median(cpu_times)


def measure(src: Path, workload: str, steps: int, profile: bool = False) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--child", workload, "--steps", str(steps)]
    if profile:
        argv.append("--profile")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=600)
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])["median"]
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="b3d27b9", help="the revision without the ranges")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workloads", nargs="+", default=["tiny", "gpt-demo"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps({"median": child(ns.child, ns.steps, ns.profile)}))
        return
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "before.tar"
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", "-o", str(archive), ns.before, "src"], check=True
        )
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        trees = {"before": Path(tmp) / "src", "after": ROOT / "src"}
        print(f"before = {ns.before}, after = this tree; {ns.rounds} rounds x {ns.steps} steps")
        print("| workload | before, off | after, off | after/before | per-round after/before "
              "| CPU after/before | after, profiled |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for workload in ns.workloads:
            got: dict[str, list[tuple[float, float]]] = {"before": [], "after": [], "profiled": []}
            for _ in range(ns.rounds):
                for name, src in trees.items():
                    got[name].append(measure(src, workload, ns.steps))
            got["profiled"].append(measure(trees["after"], workload, ns.steps, profile=True))
            wall = {k: statistics.median(w for w, _ in v) for k, v in got.items()}
            cpu = {k: statistics.median(c for _, c in v) for k, v in got.items()}
            paired = statistics.median(
                a[0] / b[0] for a, b in zip(got["after"], got["before"], strict=True)
            )
            print(
                f"| {workload} | {1e3 * wall['before']:.3f} ms | {1e3 * wall['after']:.3f} ms | "
                f"{wall['after'] / wall['before']:.3f} | {paired:.3f} | "
                f"{cpu['after'] / cpu['before']:.3f} | {1e3 * wall['profiled']:.3f} ms |",
                flush=True,
            )
            rounds = {k: [[round(1e3 * x, 3) for x in r] for r in v] for k, v in got.items()}
            print(f"<!-- {workload} per round (wall ms, CPU ms): {json.dumps(rounds)} -->")


if __name__ == "__main__":
    main()
