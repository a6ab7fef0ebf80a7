"""An LSTM language model's collectives and step time against its sequence length (issue 32).

Run: ``.venv/bin/python bench/bench_lstm.py [--plans dp fsdp tp fsdp+tp] [--seqs 8 16 32]
[--repeat 5]``

The model: embedding 64, ``nn.LSTM`` hidden 88, linear head, vocabulary 100 (69.5 K parameters),
trained with ``partita.train_step`` (AdamW) on an 8-device LocalMesh (``(2, 4)`` for fsdp+tp),
batch 16. For each plan and sequence length it prints the Plan's collectives per step (records
and calls: a bucket is one call), the all_reduce/reduce_scatter among them, the Plan's bytes
per device, and the median wall and process-CPU seconds of a step after the first (CPU time
varies less with other processes' load). A recurrent loop's per-step contributions to a weight
gradient are added as partial sums and reduced once (``propagate.linear``); with the stacked
per-step outputs, the split moved to time for the input projection and the FSDP lookup following
its ids (docs/propagation.md), the collectives are the same at every length (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita import Mesh
from partita.training import train_step

BATCH, VOCAB = 16, 100


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = nn.LSTM(64, 88, batch_first=True)
        self.out = nn.Linear(88, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def mesh_for(plan: str) -> Mesh:
    if plan == "fsdp+tp":
        return Mesh.create((2, 4), ("data", "model"))
    return Mesh.create((8,), ("model",) if plan == "tp" else ("data",))


def measure(plan: str, seq: int, repeat: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = LSTMLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = train_step(model, loss_fn, opt, mesh=mesh_for(plan), param_specs=plan)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    batch = (ids, torch.roll(ids, -1, 1))
    step(batch)  # compiles
    walls, cpus = [], []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        step(batch)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    p = step.plan
    assert p is not None
    return {
        "records": len(p.collectives),
        "calls": sum(p.call_counts().values()),
        "reductions": sum(1 for c in p.collectives if c.kind in ("all_reduce", "reduce_scatter")),
        "kib": p.bytes_per_device / 1024,
        "wall_ms": 1e3 * statistics.median(walls),
        "cpu_ms": 1e3 * statistics.median(cpus),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", default=["dp", "fsdp", "tp", "fsdp+tp"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print("command:", " ".join([os.path.relpath(sys.executable), *sys.argv]))
    print(f"load average: {os.getloadavg()[0]:.1f}; torch threads: {torch.get_num_threads()}")
    print(
        f"{'plan':<8} {'seq':>4} {'records':>8} {'calls':>6} {'reduce':>7} {'KiB/dev':>9} "
        f"{'wall ms':>9} {'cpu ms':>9}"
    )
    for plan in args.plans:
        for seq in args.seqs:
            r = measure(plan, seq, args.repeat)
            print(
                f"{plan:<8} {seq:>4} {r['records']:>8} {r['calls']:>6} {r['reductions']:>7} "
                f"{r['kib']:>9.1f} {r['wall_ms']:>9.1f} {r['cpu_ms']:>9.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
