"""The virtual device's step time beside ``partita.train_step`` on the same GPT and mesh.

Run: ``.venv/bin/python bench/bench_virtual_device.py [--layers 2] [--d-model 64] [--steps 8]``

Both train the same GPT with AdamW and the ``"fsdp+tp"`` preset on a 2x4 LocalMesh, batch
``P("data", None)``. ``train_step`` traces its step once; the virtual device records every op
of every step (forward, backward, AdamW) and syncs. Prints the median seconds per step after the
compilation: the whole step for each, and the virtual device's split into recording (the
loop's Python until ``partita.sync()``), ``sync`` (cache lookup, then the run is submitted to a
background thread), the number of ops recorded per step and the recording cost per op; and the
step time when the loop does not read the loss every step (a step then runs while the next one
records). The goal the design is measured against: recording and lookup add at most 10%.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig


def batches(n: int, batch: int, cfg: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (batch, cfg.seq_len)
    return [
        (
            torch.randint(0, cfg.vocab_size, shape, generator=g),
            torch.randint(0, cfg.vocab_size, shape, generator=g),
        )
        for _ in range(n)
    ]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bench_train_step(cfg: GPTConfig, mesh: Mesh, data: list) -> list[float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = partita.train_step(
        model, loss_fn, opt, mesh=mesh, shard="fsdp+tp", batch_spec=P("data", None)
    )
    times = []
    for batch in data:
        started = time.perf_counter()
        float(step(batch))
        times.append(time.perf_counter() - started)
    return times[2:]  # compile + the LocalMesh's second-run specialisation


def bench_virtual(
    cfg: GPTConfig, mesh: Mesh, data: list, read_loss: bool = True
) -> dict[str, list[float]]:
    dev = partita.use_spmd(mesh)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    presets = partita.presets
    for name, spec in presets.param_specs("fsdp+tp", model, mesh).items():
        partita.mark_sharding(model.get_parameter(name), mesh, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, list[float]] = {"step": [], "record": [], "sync": []}
    partita.metrics(reset=True)
    for xb, yb in data:
        started = time.perf_counter()
        x, y = xb.to(dev), yb.to(dev)
        partita.mark_sharding(x, mesh, P("data", None))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        recorded = time.perf_counter()
        partita.sync()
        synced = time.perf_counter()
        if read_loss:
            loss.item()  # waits for this step's run
        out["step"].append(time.perf_counter() - started)
        out["record"].append(recorded - started)
        out["sync"].append(synced - recorded)
    m = partita.metrics()
    partita.virtual.step.wait_in_flight()
    out["ops"] = [m.ops_recorded / m.syncs]
    out["compiles"] = [m.compiles]
    return {k: v[2:] if k in ("step", "record", "sync") else v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = GPTConfig(
        n_layer=args.layers, n_head=4, d_model=args.d_model, vocab_size=256, seq_len=32,
        bias=False,
    )  # fmt: skip
    mesh = Mesh.create((2, 4), ("data", "model"))
    data = batches(args.steps + 2, args.batch, cfg)
    ts = statistics.median(bench_train_step(cfg, mesh, data))
    v = bench_virtual(cfg, mesh, data)
    step, record, sync = (statistics.median(v[k]) for k in ("step", "record", "sync"))
    # Not reading the loss every step lets step k run while step k+1 records.
    overlapped = statistics.median(bench_virtual(cfg, mesh, data, read_loss=False)["step"])
    ops = v["ops"][0]
    print(f"GPT layers={args.layers} d_model={args.d_model} batch={args.batch}, mesh 2x4")
    print(f"train_step            {ts * 1e3:8.1f} ms/step")
    print(f"virtual device        {step * 1e3:8.1f} ms/step  (compiles: {v['compiles'][0]})")
    print(f"  recording           {record * 1e3:8.1f} ms  ({ops:.0f} ops, "
          f"{record / ops * 1e6:.0f} us/op)")  # fmt: skip
    print(
        f"  sync (lookup)       {sync * 1e3:8.1f} ms  (the rest: loss.item() waiting for the run)"
    )
    print(f"  without loss.item() every step (runs overlap recording): {overlapped * 1e3:.1f} ms")
    print(f"overhead vs train_step: {(step / ts - 1) * 100:+.0f}% reading the loss every step, ")
    print(
        f"                        {(overlapped / ts - 1) * 100:+.0f}% without (goal: at most +10%)"
    )


if __name__ == "__main__":
    main()
