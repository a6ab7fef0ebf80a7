"""The demo GPT step (``python -m partita demo``'s sizes) on 8 simulated devices vs unsharded.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_demo_step.py [2x4] [8]`` (``BD=1``: also
the breakdown). Trains 60 steps with ``partita.train_step`` and with torch.optim side by side,
prints the median process CPU per step of steps 20-60 of each, their ratio, the largest loss
and parameter differences, the CPU per step of the fused graph alone (median of 40 more
calls on the last step's inputs) and its op count (ATen calls; a count does not depend on the
load).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from partita import train_step
from partita.cli.demo import synthetic_batch
from partita.models import GPT, GPTConfig
from partita.runtime import fused_step
from partita.values.mesh import Mesh

MESHES = {
    "2x4": (Mesh.create((2, 4), ("data", "model")), "fsdp+tp"),
    "8": (Mesh.create((8,), ("data",)), "fsdp"),
}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def run(name: str) -> None:
    mesh, preset = MESHES[name]
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=32, seq_len=16, bias=False)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=preset)
    gen = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(gen, 16, 16, 32) for _ in range(60)]

    def ref_step(b: Any) -> float:
        ref_opt.zero_grad()
        loss = loss_fn(ref(b[0]), b[1])
        loss.backward()
        ref_opt.step()
        return loss.item()

    ls, rs, ts, rts = [], [], [], []
    for b in batches:
        c = time.process_time()
        ls.append(float(step(b)))
        ts.append(time.process_time() - c)
        c = time.process_time()
        rs.append(ref_step(b))
        rts.append(time.process_time() - c)
    ref_step(batches[-1])  # the reference takes the extra step too
    graph, ops = _graph_alone(step, batches[-1])  # before full(): it unholds the state
    full = step.full_parameters()
    pd = max((full[k] - v).abs().max().item() for k, v in ref.named_parameters())
    ld = max(abs(a - b) for a, b in zip(ls, rs, strict=True))
    s, r = statistics.median(ts[20:]), statistics.median(rts[20:])
    print(
        f"{name} {preset}: partita {1e3 * s:.2f} ms CPU/step, unsharded {1e3 * r:.2f} ms "
        f"({s / r:.2f}x); loss diff {ld:.2e} param diff {pd:.2e}; fused graph alone "
        f"{1e3 * graph:.2f} ms, {ops} ops; load {os.getloadavg()[0]:.1f}"
    )
    if os.environ.get("BD"):
        from partita.runtime.breakdown import measure

        print(measure(lambda: step(batches[-1]), repeat=21))


def _graph_alone(step: Any, batch: Any) -> tuple[float, int]:
    """The fused graph's CPU per call on one step's inputs and its ATen op count."""
    seen: list[tuple[Any, list[Any]]] = []
    real = fused_step._Traced.__call__

    def spy(self: Any, values: Any) -> Any:
        seen.append((self, values))
        return real(self, values)

    fused_step._Traced.__call__ = spy  # type: ignore[method-assign]
    try:
        step(batch)
    finally:
        fused_step._Traced.__call__ = real  # type: ignore[method-assign]
    if not seen:
        return float("nan"), 0
    traced, values = seen[-1]
    times = []
    for _ in range(40):
        c = time.process_time()
        real(traced, values)
        times.append(time.process_time() - c)
    nodes = traced.gm.graph.nodes
    ops = sum(n.op == "call_function" and "aten" in str(n.target) for n in nodes)
    return statistics.median(times), ops


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(MESHES):
        run(name)
