"""Expert parallelism against FSDP on the same GShard mixture of experts, on the LocalMesh.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_moe.py [--repeat 5] [--experts 8] [--gloo]``

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
device (``TrainStep.memory()``), the Plan's peak estimate, and the median wall time of a step
on the LocalMesh (``--repeat`` steps after 2 warm-ups; the LocalMesh runs the 8 devices one
after the other in this process, so it measures the work, not a parallel step; the machine is
shared, so the numbers are noisy). Both steps are checked equal to each other (the loss, 1e-4).

``--gloo``: the same two steps on 4 Gloo processes (``partita.runtime.launch.spawn``,
``OMP_NUM_THREADS=1`` each): ``fsdp (4,)`` against ``fsdp+ep (2, 2)``; the step is the median
wall time of rank 0 and ``maxrss`` each process's high-water mark (max over the ranks).
"""

from __future__ import annotations

import argparse
import collections
import json
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
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
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
        "imbalance": layer.imbalance,
        "dropped": layer.dropped_tokens,
    }


GLOO = {
    "fsdp (4,)": (((4,), ("data",)), "fsdp", False),
    "fsdp+ep (2, 2)": (((2, 2), ("data", "model")), "fsdp+ep", True),
}


def worker(args: argparse.Namespace) -> None:
    import partita.distributed as pd

    pd.initialize()
    (shape, names), preset, annotate = GLOO[args.worker]
    mesh = Mesh.create(shape, names)
    row = run(args.worker, mesh, preset, annotate, args.experts, args.repeat, local=False)
    row["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(row), flush=True)


def gloo(args: argparse.Namespace) -> list[dict]:
    from partita.runtime.launch import spawn

    rows = []
    for name in GLOO:
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
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--gloo", action="store_true", help="4 Gloo processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.gloo:
        rows = gloo(args)
        print(f"$ PYTHONPATH=src {sys.executable} bench/bench_moe.py --gloo --repeat "
              f"{args.repeat} --experts {args.experts}")  # fmt: skip
        print(f"{'config':<16}{'bytes/dev/step':>16}{'expert W/dev':>14}{'a2a bytes':>11}"
              f"{'maxrss':>11}{'step ms':>10}  collectives")  # fmt: skip
        for r in rows:
            print(f"{r['name']:<16}{format_bytes(r['bytes']):>16}"
                  f"{format_bytes(r['expert_bytes']):>14}{format_bytes(r['a2a_bytes']):>11}"
                  f"{format_bytes(r['maxrss']):>11}{r['step_ms']:>10.1f}"
                  f"  {r['kinds']}")  # fmt: skip
        assert abs(rows[0]["loss"] - rows[1]["loss"]) < 1e-4, rows
        return
    rows = [
        run("fsdp (8,)", Mesh.create((8,), ("data",)), "fsdp", False, args.experts, args.repeat),
        run(
            "fsdp+ep (2, 4)",
            Mesh.create((2, 4), ("data", "model")),
            "fsdp+ep",
            True,
            args.experts,
            args.repeat,
        ),
    ]
    assert abs(rows[0]["loss"] - rows[1]["loss"]) < 1e-4, rows
    print(f"$ PYTHONPATH=src {sys.executable} bench/bench_moe.py --repeat {args.repeat} "
          f"--experts {args.experts}")  # fmt: skip
    print(
        f"GShard MoE: width {D}, expert hidden {H}, {args.experts} experts, top-{TOP_K}, "
        f"capacity factor {CF}, {GROUPS} groups x {GROUP} tokens; LocalMesh, median of "
        f"{args.repeat} steps"
    )
    head = (
        f"{'config':<16}{'bytes/dev/step':>16}{'expert W/dev':>14}{'(of)':>10}"
        f"{'a2a bytes':>11}{'params+opt/dev':>16}{'peak est.':>11}{'step ms':>10}  collectives"
    )
    print(head)
    for r in rows:
        print(
            f"{r['name']:<16}{format_bytes(r['bytes']):>16}{format_bytes(r['expert_bytes']):>14}"
            f"{format_bytes(r['expert_full']):>10}{format_bytes(r['a2a_bytes']):>11}"
            f"{format_bytes(r['state']):>16}{format_bytes(r['peak']):>11}"
            f"{r['step_ms']:>10.1f}  {r['kinds']}"
        )
    for r in rows:  # the routing of the last step (the same batch and weights in both)
        print(f"{r['name']}: load imbalance {r['imbalance']:.2f} (max/mean), "
              f"{r['dropped']} of {GROUPS * GROUP * TOP_K} routed rows dropped")  # fmt: skip


if __name__ == "__main__":
    main()
