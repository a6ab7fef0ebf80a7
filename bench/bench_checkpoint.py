"""Sharded DCP checkpoints (``partita.checkpoint``) beside ``torch.save`` of the gathered state.

Run: ``.venv/bin/python bench/bench_checkpoint.py [--repeat 5] [--plan fsdp]`` (it starts its own
4 Gloo worker processes on 127.0.0.1 through ``partita.runtime.launch.spawn`` and prints rank 0's
report).

The state: the GPT of ``bench/bench_distributed.py`` (4 layers, width 256, 8 heads, vocabulary
512, sequence 128) in a ``partita.train_step`` with AdamW on a (4,) mesh (``--plan fsdp``, the
default) after one training step: parameters, both Adam moments, the step counter and the RNG
state. For each method, the median over ``--repeat`` runs (after one warm-up) of the slowest
rank's wall time, and the bytes each rank wrote:

* ``partita.checkpoint.save`` / ``load``: every rank writes and reads only its own shards;
* ``torch.save(step.state_dict())`` on rank 0: ``state_dict()`` gathers every tensor to full
  size on every rank first; loading is ``torch.load`` on every rank plus
  ``step.load_state_dict`` (which re-shards the full tensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import partita.checkpoint as ckpt
import partita.distributed as pd
from partita import Mesh
from partita.models import GPT, GPTConfig
from partita.runtime.launch import spawn
from partita.training import train_step

CFG = GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=512, seq_len=128)
BATCH = 16


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """The median over ``repeat`` runs (after a warm-up) of the slowest rank's seconds."""
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        times.append(float(mine))
    return statistics.median(times)


def _bytes_per_rank(written: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([written], dtype=torch.int64))
    return [int(t) for t in out]


def worker(repeat: int, plan: str, root: Path) -> None:
    pd.initialize()
    rank = pd.process_index()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))

    mesh = Mesh.create((4,), ("data",))
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=plan)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
    step((ids, torch.roll(ids, -1, 1)))  # the state now lives in the 4 processes

    dcp_path = root / "dcp"
    save_s = _timed(lambda: ckpt.save(step, dcp_path), repeat)
    dcp_bytes = sum(p.stat().st_size for p in dcp_path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        dcp_bytes += (dcp_path / ".metadata").stat().st_size
    load_s = _timed(lambda: ckpt.load(step, dcp_path), repeat)

    pt_path = root / "full.pt"

    def torch_save() -> None:
        sd = step.state_dict()  # gathers: a collective on every rank
        if rank == 0:
            torch.save(sd, pt_path)

    def torch_load() -> None:
        step.load_state_dict(torch.load(pt_path, weights_only=True))

    pt_save_s = _timed(torch_save, repeat)
    pt_bytes = pt_path.stat().st_size if rank == 0 else 0
    pt_load_s = _timed(torch_load, repeat)
    dcp_per_rank, pt_per_rank = _bytes_per_rank(dcp_bytes), _bytes_per_rank(pt_bytes)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
        print(f"# GPT {n / 1e6:.2f} M params, AdamW, plan {plan!r} on {mesh!r}, 4 Gloo ranks, "
              f"median of {repeat} (slowest rank)")  # fmt: skip
        print(f"{'method':<34}{'save s':>8}{'load s':>8}  MiB written per rank")
        print(f"{'partita.checkpoint (DCP, sharded)':<34}{save_s:8.3f}{load_s:8.3f}  "
              f"{[mb(b) for b in dcp_per_rank]}")  # fmt: skip
        print(f"{'torch.save(gathered state_dict)':<34}{pt_save_s:8.3f}{pt_load_s:8.3f}  "
              f"{[mb(b) for b in pt_per_rank]}")  # fmt: skip
    pd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--plan", default="fsdp")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the directory, in the workers
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.repeat, ns.plan, Path(ns.worker))
        return
    print(f"$ {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        argv = [__file__, "--repeat", str(ns.repeat), "--plan", ns.plan, "--worker", str(root)]
        results = spawn(argv, 4, timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    print(results[0].stdout, end="")


if __name__ == "__main__":
    main()
