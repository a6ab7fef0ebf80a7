"""Expert parallelism against FSDP on the same GShard mixture of experts: bytes, time, memory.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_moe.py [--repeat 5] [--runs 3] [--experts 8]
[--gloo]``

The step: Linear -> ``partita.models.GShardMoE`` (width 64, expert hidden 256, ``--experts``,
top-2, capacity factor 1.25) -> Linear, MSE plus 0.01 x the router's auxiliary loss, AdamW;
a batch of 16 groups of 32 tokens, split over all 8 simulated devices in both rows.

* ``fsdp (8,)``: every parameter split over the 8 devices (``param_specs="fsdp"``), the layer
  without annotation: the expert weights are gathered for the step (all_gather) and their
  gradients reduce-scattered, as FSDP does;
* ``fsdp+ep (2, 4)``: the experts split whole over ``model`` (4) and the rest over ``data``
  (2) (``param_specs="fsdp+ep"``), the layer annotated (``mesh=``): the dispatched tokens go
  to their experts by all-to-all and come back by another (forward and backward).

For each: the Plan's bytes per device per step and its collectives by kind, the expert weight
bytes a device holds (``models.moe.expert_report``), the parameters + optimizer state bytes per
device (``TrainStep.memory()``), the Plan's peak estimate (``Plan.memory().peak``), and the
time of a step on the LocalMesh, wall and process CPU time (``time.process_time``): the median
of ``--repeat`` steps after 2 warm-ups, in each of ``--runs`` runs (the two configs
alternating, each run a new ``train_step``), and the median over the runs. The LocalMesh runs
the 8 devices one after the other in this process, so it measures the work, not a parallel
step; the machine is shared, so the numbers are noisy (the load average is printed). Both steps
are checked equal to each other (the loss, 1e-4).

``--gloo``: the same two steps on 4 Gloo processes (``partita.runtime.launch.spawn``,
``OMP_NUM_THREADS=1`` each): ``fsdp (4,)`` against ``fsdp+ep (2, 2)``, ``--runs`` launches of
each, alternating; the step is rank 0's median over ``--repeat`` steps (wall, and its process
CPU time), the median over the launches; ``maxrss`` is each process's high-water mark (the max
over the ranks and launches); the Plan's peak estimate is per device as on the LocalMesh
(``TrainStep.memory()`` reads every device's storage, so it has no Gloo column).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita import Mesh, P
from partita.models.moe import GShardMoE, expert_report
from partita.partition.plan import format_bytes
from partita.presets import param_specs
from partita.training import train_step

D, H, TOP_K, CF = 64, 256, 2, 1.25
GROUPS, GROUP = 16, 32


class Net(nn.Module):
    def __init__(self, experts: int, mesh: Mesh | None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = GShardMoE(D, H, experts, TOP_K, CF, mesh=mesh)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = self.moe(self.inp(x))
        return self.out(y), aux


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], target) + 0.01 * out[1]


def run(
    name: str,
    mesh: Mesh,
    preset: str,
    annotate: bool,
    experts: int,
    repeat: int,
    local: bool = True,
) -> dict:
    torch.manual_seed(0)
    model = Net(experts, mesh if annotate else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch_spec = P(tuple(mesh.axis_names))
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=preset, batch_spec=batch_spec)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(GROUPS, GROUP, D, generator=g), torch.randn(GROUPS, GROUP, D, generator=g))
    first = float(step(batch))
    step(batch)
    times, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    plan = step.plan
    specs = param_specs(preset, model, mesh)
    (layer,) = expert_report(plan, model, specs, mesh, buffers=step.buffers)
    kinds = collections.Counter(c.kind for c in plan.collectives)
    # TrainStep.memory() reads every device's storage: the LocalMesh only (not on Gloo ranks)
    state = step.memory() if local else {"parameters": (0, 0), "optimizer": (0, 0)}
    return {
        "name": name,
        "loss": first,
        "bytes": plan.bytes_per_device,
        "kinds": dict(sorted(kinds.items())),
        "expert_bytes": layer.weight_bytes_per_device,
        "expert_full": layer.weight_bytes,
        "a2a_bytes": layer.all_to_all_bytes,
        "state": state["parameters"][0] + state["optimizer"][0],
        "peak": plan.memory().peak,
        "step_ms": statistics.median(times) * 1e3,
        "cpu_ms": statistics.median(cpu) * 1e3,
        "imbalance": layer.imbalance,
        "dropped": layer.dropped_tokens,
    }


GLOO = {
    "fsdp (4,)": (((4,), ("data",)), "fsdp", False),
    "fsdp+ep (2, 2)": (((2, 2), ("data", "model")), "fsdp+ep", True),
}
LOCAL = {
    "fsdp (8,)": (((8,), ("data",)), "fsdp", False),
    "fsdp+ep (2, 4)": (((2, 4), ("data", "model")), "fsdp+ep", True),
}
#: what differs between the runs of one config: the times (median over runs), the high-water mark
TIMES = ("step_ms", "cpu_ms")


def worker(args: argparse.Namespace) -> None:
    import partita.distributed as pd

    pd.initialize()
    (shape, names), preset, annotate = GLOO[args.worker]
    mesh = Mesh.create(shape, names)
    row = run(args.worker, mesh, preset, annotate, args.experts, args.repeat, local=False)
    row["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(row), flush=True)


def launch(name: str, args: argparse.Namespace) -> dict:
    """One launch of 4 Gloo processes for config ``name``: rank 0's row, maxrss over ranks."""
    from partita.runtime.launch import spawn

    argv = [__file__, "--worker", name, "--repeat", str(args.repeat)]
    argv += ["--experts", str(args.experts)]
    results = spawn(argv, 4, timeout=1800)
    outs = [
        json.loads(ln.removeprefix("RESULT "))
        for r in results
        for ln in r.stdout.splitlines()
        if ln.startswith("RESULT ")
    ]
    if any(r.returncode for r in results) or len(outs) != 4:
        bad = next((r for r in results if r.returncode), results[0])
        raise SystemExit(f"{name} failed (rank {bad.rank}): {bad.stderr.strip()[-500:]}")
    row = outs[0]
    row["maxrss"] = max(o["maxrss"] for o in outs)
    return row


def over_runs(runs: list[dict]) -> dict:
    """One config's runs as one row: the median of each time, its range, the largest maxrss."""
    row = dict(runs[0])
    for key in TIMES:
        values = [r[key] for r in runs]
        row[key] = statistics.median(values)
        row[key + "_range"] = (min(values), max(values))
    if "maxrss" in row:
        row["maxrss"] = max(r["maxrss"] for r in runs)
    return row


def measure(args: argparse.Namespace) -> list[dict]:
    """``--runs`` runs of each config, alternating (so a change of load hits both alike)."""
    configs = GLOO if args.gloo else LOCAL
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.runs):
        for name, ((shape, names), preset, annotate) in configs.items():
            if args.gloo:
                runs[name].append(launch(name, args))
            else:
                mesh = Mesh.create(shape, names)
                runs[name].append(run(name, mesh, preset, annotate, args.experts, args.repeat))
    return [over_runs(r) for r in runs.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs (launches) of each config")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--gloo", action="store_true", help="4 Gloo processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()[0]
    rows = measure(args)
    assert abs(rows[0]["loss"] - rows[1]["loss"]) < 1e-4, rows
    gloo = " --gloo" if args.gloo else ""
    print(f"$ PYTHONPATH=src {sys.executable} bench/bench_moe.py{gloo} --repeat {args.repeat} "
          f"--runs {args.runs} --experts {args.experts}")  # fmt: skip
    where = "4 Gloo processes (rank 0)" if args.gloo else "LocalMesh (8 devices in turn)"
    print(
        f"GShard MoE: width {D}, expert hidden {H}, {args.experts} experts, top-{TOP_K}, "
        f"capacity factor {CF}, {GROUPS} groups x {GROUP} tokens; {where}; step: median of "
        f"{args.repeat} steps per run, median (min-max) of {args.runs} runs; load average "
        f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    mem = f"{'maxrss':>11}" if args.gloo else f"{'params+opt/dev':>16}"
    print(f"{'config':<16}{'bytes/dev/step':>16}{'expert W/dev':>14}{'(of)':>10}{'a2a bytes':>11}"
          f"{mem}{'peak est.':>11}{'step ms':>26}{'CPU ms':>26}  collectives")  # fmt: skip
    for r in rows:
        held = format_bytes(r["maxrss"]) if args.gloo else format_bytes(r["state"])
        times = ""
        for key in TIMES:
            low, high = r[key + "_range"]
            times += f"{f'{r[key]:.1f} ({low:.1f}-{high:.1f})':>26}"
        print(
            f"{r['name']:<16}{format_bytes(r['bytes']):>16}{format_bytes(r['expert_bytes']):>14}"
            f"{format_bytes(r['expert_full']):>10}{format_bytes(r['a2a_bytes']):>11}"
            f"{held:>{11 if args.gloo else 16}}{format_bytes(r['peak']):>11}{times}  {r['kinds']}"
        )
    for r in rows:  # the routing of the last step (the same batch and weights in both)
        print(f"{r['name']}: load imbalance {r['imbalance']:.2f} (max/mean), "
              f"{r['dropped']} of {GROUPS * GROUP * TOP_K} routed rows dropped")  # fmt: skip


if __name__ == "__main__":
    main()
