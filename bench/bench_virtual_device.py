"""The virtual device's step time beside ``partita.train_step`` on the same GPT and mesh.

Run: ``.venv/bin/python bench/bench_virtual_device.py [--layers 2] [--d-model 64] [--steps 10]``

Both train the same GPT with AdamW and the ``"fsdp+tp"`` preset on a 2x4 LocalMesh, batch
``P("data", None)``. ``train_step`` traces its step once; the virtual device records every op
of every step (forward, backward, AdamW) and syncs. Rows, each the median over the steps after
the first two (compilation, the LocalMesh's second-run specialisation), all in one process:

- ``train_step``: the whole step (``float(step(batch))``).
- the virtual-device loop with the fast path off (every step recorded in full: shape inference
  per op, the structural key hashed at the sync) and on (a step that repeats its predecessor
  op by op takes its results from it and its program without hashing), reading the loss every
  step; ``record`` is the loop's Python until ``partita.sync()``, ``sync+run`` the rest (the
  cache lookup, the run, ``loss.item()``);
- the fast path without reading the loss every step (a step runs in a background thread while
  the next one records).

Wall-clock and process CPU time are both printed: other work on the machine inflates the first.
The goal the design is measured against: recording and lookup add at most 10% to the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.virtual import recording

Times = dict[str, list[float]]


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


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def bench_train_step(cfg: GPTConfig, mesh: Mesh, data: list) -> Times:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = partita.train_step(
        model, loss_fn, opt, mesh=mesh, shard="fsdp+tp", batch_spec=P("data", None)
    )
    out: Times = {"step": [], "step_cpu": []}
    for batch in data:
        wall, cpu = _clocks()
        float(step(batch))
        out["step"].append(time.perf_counter() - wall)
        out["step_cpu"].append(time.process_time() - cpu)
    return out


def bench_virtual(
    cfg: GPTConfig, mesh: Mesh, data: list, *, fast_path: bool, read_loss: bool = True
) -> Times:
    recording.FAST_PATH = fast_path
    recording.forget_guides()
    dev = partita.use_spmd(mesh)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    for name, spec in partita.presets.param_specs("fsdp+tp", model, mesh).items():
        partita.mark_sharding(model.get_parameter(name), mesh, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: Times = {k: [] for k in ("step", "step_cpu", "record", "record_cpu")}
    partita.metrics(reset=True)
    for xb, yb in data:
        wall, cpu = _clocks()
        x, y = xb.to(dev), yb.to(dev)
        partita.mark_sharding(x, mesh, P("data", None))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["record"].append(time.perf_counter() - wall)
        out["record_cpu"].append(time.process_time() - cpu)
        partita.sync()
        if read_loss:
            loss.item()  # waits for this step's run
        out["step"].append(time.perf_counter() - wall)
        out["step_cpu"].append(time.process_time() - cpu)
    partita.virtual.step.wait_in_flight()
    m = partita.metrics()
    out["ops"] = [m.ops_recorded / m.syncs]
    out["compiles"] = [m.compiles]
    out["fast"] = [m.fast_path_hits]
    recording.FAST_PATH = True
    return out


def _row(name: str, t: Times, base: Times | None) -> str:
    med = {k: statistics.median(v[2:]) * 1e3 for k, v in t.items() if len(v) > 2}
    text = f"{name:<34} {med['step']:7.1f} {med['step_cpu']:7.1f}"
    if "record" in med:
        run, run_cpu = med["step"] - med["record"], med["step_cpu"] - med["record_cpu"]
        text += f" {med['record']:7.1f} {med['record_cpu']:7.1f} {run:7.1f} {run_cpu:7.1f}"
    else:
        text += " " * 32
    if base is not None:
        ref = {k: statistics.median(base[k][2:]) * 1e3 for k in ("step", "step_cpu")}
        text += f"  {(med['step'] / ref['step'] - 1) * 100:+5.0f}%"
        text += f" {(med['step_cpu'] / ref['step_cpu'] - 1) * 100:+5.0f}%"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print("$ .venv/bin/python " + " ".join(sys.argv))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = GPTConfig(
        n_layer=args.layers, n_head=4, d_model=args.d_model, vocab_size=256, seq_len=32,
        bias=False,
    )  # fmt: skip
    mesh = Mesh.create((2, 4), ("data", "model"))
    data = batches(args.steps + 2, args.batch, cfg)
    ts = bench_train_step(cfg, mesh, data)
    full = bench_virtual(cfg, mesh, data, fast_path=False)
    fast = bench_virtual(cfg, mesh, data, fast_path=True)
    overlapped = bench_virtual(cfg, mesh, data, fast_path=True, read_loss=False)
    print(
        f"GPT layers={args.layers} d_model={args.d_model} batch={args.batch}, mesh 2x4, "
        f"{fast['ops'][0]:.0f} ops recorded per step; medians of {args.steps} steps, ms"
    )
    print(f"{'':<34} {'step':>15} {'record':>15} {'sync+run':>15}  {'vs train_step':>12}")
    print(f"{'':<34}" + f" {'wall':>7} {'cpu':>7}" * 3 + f"  {'wall':>6} {'cpu':>5}")
    print(_row("train_step", ts, None))
    print(_row("virtual loop, fast path off", full, ts))
    print(_row("virtual loop, fast path", fast, ts))
    print(_row("fast path, loss not read per step", overlapped, ts))
    print(
        f"compiles: {full['compiles'][0]}, {fast['compiles'][0]}, {overlapped['compiles'][0]}; "
        f"fast-path steps: {fast['fast'][0]} and {overlapped['fast'][0]} of {len(data)} "
        f"(goal: at most +10% over train_step)"
    )


if __name__ == "__main__":
    main()
