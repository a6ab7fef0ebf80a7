"""The bubble of ``partita.pipeline`` on 4 Gloo processes: measured idle fraction of a stage
against ``(S - 1) / (M + S - 1)`` for M = 4, 8, 16 micro-batches.

Run: ``.venv/bin/python bench/bench_pipeline.py [--microbatches 4 8 16] [--repeat 5] [--flops]``
(starts 4 worker processes on 127.0.0.1 through ``partita.runtime.launch.spawn``, mesh
``(stage=4,)``; rank 0 prints the table).

The program: 8 identical pre-norm MLP blocks (LayerNorm, Linear d -> 4d, GELU, Linear 4d -> d,
residual; ``--width`` d) as a GPipe pipeline, 2 blocks per stage, ``remat=True``; one step is
the forward and the gradient of ``mean(y ** 2)`` with respect to every weight (no optimizer,
no embedding: the pipeline is nearly all of the step). Every micro-batch has the same size
(``--rows`` x ``--seq`` tokens), so the global batch grows with M and a stage's real work is M
times one micro-batch's.

What is measured, per rank, after 2 warm-ups; in each of ``--repeat`` repetitions the three
runs below go back to back, each started by a barrier so the 4 ranks begin together, each
timed by the wall clock and by the process's CPU time:

* ``step``: the wall time of one step of the partitioned program on the DistributedMesh.
* ``busy``: the time the same rank takes to do its stage's real work alone: its 2 blocks,
  forward under ``torch.utils.checkpoint`` then backward (recompute and gradients), on M
  micro-batches one after another, in eager torch, all 4 ranks at once (so they share the 2
  cores as during the step). This is the work the rank must do for its M micro-batches; it is
  measured outside the pipeline because inside it every rank computes on *every* iteration
  (SPMD: in the bubble a stage runs its blocks on a slot holding no micro-batch, and the result
  is dropped), so no rank ever waits and there is no idle gap to time.
* ``alone``: the same real work as a partita program on the same 4 processes: a shard_map
  over the stage axis in which every stage runs its checkpointed blocks on its M micro-batches
  and nothing else (no permute, no bubble); the same executor, ops and remat as the pipeline.
* ``idle = 1 - busy / step`` and ``1 - alone / step``: the share of the step not spent on real
  work. Besides the bubble's wasted iterations it holds what else the step does: the permutes
  (between the stages, and those that bring stage 0 its input and hand each stage its results:
  the pipeline's input and output are split over the stages by micro-batch), and, against
  ``busy``, partita's executor against eager torch for the same ops. The loss after the
  pipeline runs on the stage's ``M / S`` micro-batches of the output (the output is split
  over the stages); ``alone``'s too, on ``M / S`` of its stage's ``M`` results, the others
  only summed (one read each) so that their gradients flow. (Before the output was split,
  the step's loss ran on all ``M`` on every stage, and so did ``alone``'s.)

Which real work: ``alone`` is the stage's work as the step does it (the same traced ops on the
same executor, no autograd or checkpoint machinery at run time), so ``1 - alone / step`` is the
share of the step not spent on the work of its micro-batches, the issue's idle fraction, and it
cannot go below the bubble's share but for noise. ``busy`` is the same work in eager torch,
which costs more CPU per micro-batch than the traced program (about 5% at M = 16): against it
that difference is credited to the step, and a rank's ``1 - busy / step`` can come out below
``(S - 1) / (M + S - 1)``. Both are printed.

Each idle fraction is the median over the repetitions of its per-repetition value, averaged
over the ranks. The wall clock is what a user sees but counts the time other jobs on the
machine take the cores; the CPU time counts only this process's own work (a stage never waits
in the bubble, it computes, so both see the bubble).

The machine is shared (2 cores, other jobs): numbers are noisy; they are medians of one run.

``--flops`` instead counts, in one process and without timing anything (so independent of the
machine's load), the floating-point operations of the pipelined step's per-device program (the
Plan's ``local_program``, ``partita.cost.flops.node_flops`` per node, lowered on the LocalMesh)
against a stage's real work (its 2 checkpointed blocks, forward and backward, on M
micro-batches in eager torch, under ``torch.utils.flop_counter.FlopCounterMode``) times
``(M + S - 1) / M``, the bubble's share. Matmul FLOPs are compared like for like (the ops
torch's counter knows); the other ops (elementwise: where, add, gelu, layer norm, ...) are
counted as elements written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.cost.flops import node_flops
from partita.runtime.launch import spawn

LAYERS = 8
STAGES = 4


class Block(nn.Module):
    """A pre-norm MLP block, ``x + W2 gelu(W1 ln(x))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """``fn()``'s wall time and this process's CPU time, after a barrier of the 4 ranks."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def pipeline_step(
    m: int, mesh: Mesh, width: int
) -> tuple[list[Block], Any, Any, dict[str, torch.Tensor]]:
    """The blocks, the pipeline, the jitted step (GPipe over ``stage``, ``m`` micro-batches:
    the loss and the gradient of every stacked weight) and its stacked weights."""
    torch.manual_seed(0)
    layers = [Block(width) for _ in range(LAYERS)]
    pipe = partita.pipeline(layers, mesh=mesh, microbatches=m, batch_axes=())
    weights = {n: p.detach() for n, p in pipe.stack.named_parameters()}

    def step_fn(w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = {k: v.requires_grad_() for k, v in w.items()}
        y = torch.func.functional_call(pipe, {f"stack.{k}": v for k, v in w.items()}, (x,))
        loss = y.square().mean()
        return (loss, *torch.autograd.grad(loss, list(w.values())))

    jitted = partita.jit(step_fn, mesh=mesh, in_specs=({n: P("stage") for n in weights}, P()))
    return layers, pipe, jitted, weights


def stage_work(
    layers: list[Block], rank: int, m: int, ns: argparse.Namespace, g: torch.Generator
) -> Callable[[], None]:
    """This rank's real work in eager torch: its stage's blocks, forward under
    ``torch.utils.checkpoint`` then backward, on ``m`` micro-batches one after another."""
    per = LAYERS // STAGES
    mine = nn.Sequential(*layers[rank * per : (rank + 1) * per])  # this stage's blocks
    micro = [torch.randn(ns.rows, ns.seq, ns.width, generator=g) for _ in range(m)]

    def real_work() -> None:
        for xm in micro:
            xm = xm.requires_grad_()
            y = checkpoint(mine, xm, use_reentrant=False)
            y.backward(torch.ones_like(y))

    return real_work


def measure(m: int, mesh: Mesh, rank: int, ns: argparse.Namespace) -> dict[str, float]:
    """This rank's median step time and busy time (see the module's doc) for ``m``."""
    layers, pipe, jitted, weights = pipeline_step(m, mesh, ns.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * ns.rows, ns.seq, ns.width, generator=g)
    for _ in range(2):
        jitted(weights, x)

    real_work = stage_work(layers, rank, m, ns, g)
    real_work()
    runs = {
        "step": lambda: jitted(weights, x),
        "busy": real_work,
        "alone": _stage_alone(pipe, mesh, m, weights, x),
    }
    # The three back to back in every repetition, so that a change of the machine's load hits
    # all three; each idle fraction is the median of its per-repetition values.
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(ns.repeat):
        for k, fn in runs.items():
            samples[k].append(_timed(fn))
    out = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    out |= {f"{k}_cpu": statistics.median(c for _, c in v) for k, v in samples.items()}
    for k in ("busy", "alone"):
        for i, clock in enumerate(("wall", "cpu")):
            out[f"idle_{k}_{clock}"] = statistics.median(
                1 - b[i] / s[i] for b, s in zip(samples[k], samples["step"], strict=True)
            )
    return out


def _stage_alone(
    pipe: partita.Pipeline, mesh: Mesh, m: int, weights: dict[str, torch.Tensor], x: torch.Tensor
):
    """A partita program in which every stage does its real work and nothing else: its
    blocks, checkpointed, on its M micro-batches, no permute (the same executor, ops and
    remat as the pipeline), and the loss on M / S micro-batches' results, as the step."""
    names, per = pipe.names, LAYERS // STAGES

    def body(w: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        def run(h: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
            for j in range(per):
                p = dict(zip(names, flat[j * len(names) : (j + 1) * len(names)], strict=True))
                h = torch.func.functional_call(pipe.stack, p, (h,))
            return h

        flat = [w[n][j] for j in range(per) for n in names]
        ys = [checkpoint(run, xs[:, i], *flat, use_reentrant=False) for i in range(m)]
        return torch.stack(ys, 1)

    region = partita.shard_map(
        body, mesh=mesh, in_specs=({n: P("stage") for n in names}, P()), out_specs=P("stage")
    )

    def fn(w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = {k: v.requires_grad_() for k, v in w.items()}
        y = region(w, x.reshape(x.shape[0] // m, m, *x.shape[1:]))
        # the step's loss runs on its stage's M / S micro-batches of the output: so does
        # this one; the other results are only summed (one read each), for their gradients
        g = m // STAGES
        loss = y[:, :g].square().mean() + y[:, g:].sum()
        return (loss, *torch.autograd.grad(loss, list(w.values())))

    jitted = partita.jit(fn, mesh=mesh, in_specs=({n: P("stage") for n in names}, P()))
    for _ in range(2):
        jitted(weights, x)
    return lambda: jitted(weights, x)


def flops(m: int, ns: argparse.Namespace) -> tuple[int, int, int]:
    """``(matmul FLOPs, other elements)`` per device of the pipelined step on the LocalMesh,
    and the matmul FLOPs of one stage's real work on ``m`` micro-batches in eager torch."""
    layers, _, jitted, weights = pipeline_step(m, Mesh.create((STAGES,), ("stage",)), ns.width)
    plan = jitted.lower(weights, torch.randn(m * ns.rows, ns.seq, ns.width))
    values = plan._local_values()
    matmul = other = 0
    for node in plan.local_program.graph.nodes:
        n = node_flops(node, values)
        if getattr(node.target, "overloadpacket", None) in flop_registry:
            matmul += n
        else:
            other += n
    mine = nn.Sequential(*layers[: LAYERS // STAGES])
    with FlopCounterMode(display=False) as counter:
        for _ in range(m):
            xm = torch.randn(ns.rows, ns.seq, ns.width, requires_grad=True)
            y = checkpoint(mine, xm, use_reentrant=False)
            y.backward(torch.ones_like(y))
    return matmul, other, counter.get_total_flops()


def report_flops(ns: argparse.Namespace) -> None:
    print("# " + " ".join([".venv/bin/python", "bench/bench_pipeline.py", *sys.argv[1:]]))
    print(
        f"# per-device program of the pipelined step (LocalMesh, mesh (stage={STAGES},)) "
        f"against one stage's real work (eager, checkpointed), micro-batch {ns.rows} x "
        f"{ns.seq} tokens, width {ns.width}; MFLOP"
    )
    print(
        f"{'M':>3} {'(M+S-1)/M':>10} {'real matmul':>12} {'step matmul':>12} "
        f"{'step/real':>10} {'step other (elements)':>22}"
    )
    for m in ns.microbatches:
        matmul, other, real = flops(m, ns)
        print(
            f"{m:>3} {(m + STAGES - 1) / m:>10.4f} {real / 1e6:>12.1f} {matmul / 1e6:>12.1f} "
            f"{matmul / real:>10.4f} {other / 1e6:>22.2f}"
        )


def worker(ns: argparse.Namespace) -> None:
    pd.initialize()
    mesh = Mesh.create((STAGES,), ("stage",))
    rows = {m: measure(m, mesh, pd.process_index(), ns) for m in ns.microbatches}
    gathered: list[dict[int, dict[str, float]] | None] = [None] * pd.process_count()
    dist.all_gather_object(gathered, rows)
    if pd.is_main_process():
        print(json.dumps({str(r): g for r, g in enumerate(gathered)}))


def report(per_rank: dict[str, dict[str, dict[str, float]]], ns: argparse.Namespace) -> None:
    print(
        f"# mesh (stage={STAGES},), {LAYERS} MLP blocks of width {ns.width}, GPipe, remat, "
        f"micro-batch {ns.rows} x {ns.seq} tokens; {ns.repeat} repetitions per rank; "
        f"idle = 1 - real work / step, median over repetitions, mean over the 4 ranks; "
        f"step s, busy s, alone s: median wall time of the 4 ranks; step cpu, alone cpu: "
        f"median CPU seconds, mean of the 4 ranks; load average {os.getloadavg()[0]:.1f} at the end"
    )
    cols = [("idle_busy_wall", "busy wall"), ("idle_alone_wall", "alone wall")]
    cols += [("idle_busy_cpu", "busy cpu"), ("idle_alone_cpu", "alone cpu")]
    print(
        f"{'M':>3} {'(S-1)/(M+S-1)':>14} {'step s':>7} {'busy s':>7} {'alone s':>8} "
        f"{'step cpu':>9} {'alone cpu':>9}  "
        + " ".join(f"{label:>10}" for _, label in cols)
        + f" {'busy cpu - theory':>19} {'alone cpu - theory':>19}"
    )
    ranks = sorted(per_rank, key=int)
    for m in ns.microbatches:
        theory = (STAGES - 1) / (m + STAGES - 1)
        rows = [per_rank[r][str(m)] for r in ranks]
        times = [statistics.median(row[k] for row in rows) for k in ("step", "busy", "alone")]
        cpu = [statistics.fmean(row[f"{k}_cpu"] for row in rows) for k in ("step", "alone")]
        idle = [statistics.fmean(row[key] for row in rows) for key, _ in cols]
        print(
            f"{m:>3} {theory:>14.3f} {times[0]:>7.3f} {times[1]:>7.3f} {times[2]:>8.3f} "
            f"{cpu[0]:>9.4f} {cpu[1]:>9.4f}  "
            + " ".join(f"{i:>10.3f}" for i in idle)
            + f" {idle[2] - theory:>+19.3f} {idle[3] - theory:>+19.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--flops", action="store_true", help="count FLOPs, time nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.flops:
        report_flops(ns)
        return
    if ns.worker:
        worker(ns)
        return
    report(run_ranks(Path(__file__), "{"), ns)


def run_ranks(script: Path, marker: str) -> Any:
    """Run ``script --worker`` (with this command's arguments) on ``STAGES`` Gloo processes,
    print the command that reproduces it, and return rank 0's JSON line (the first that
    starts with ``marker``); a failed rank prints every rank's output and exits 1."""
    argv = [str(script.resolve()), "--worker", *sys.argv[1:]]
    results = spawn(argv, STAGES, timeout=1800)
    if any(r.returncode for r in results):
        for r in results:
            print(f"--- rank {r.rank}: {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        raise SystemExit(1)
    line = next(ln for ln in results[0].stdout.splitlines() if ln.startswith(marker))
    print("# " + " ".join([".venv/bin/python", f"bench/{script.name}", *sys.argv[1:]]))
    return json.loads(line)


if __name__ == "__main__":
    main()
