"""The virtual device's step time beside ``partita.train_step`` on the same GPT and mesh.

Run: ``.venv/bin/python bench/bench_virtual_device.py [--layers 2] [--d-model 64] [--steps 10]``

All train the same GPT with AdamW and the ``"fsdp+tp"`` preset on a 2x4 LocalMesh, batch
``P("data", None)``. ``train_step`` traces its step once; the virtual device records every op
of every step (forward, backward, AdamW) and syncs; ``partita.compile`` records until the step
repeats, then replays it. Rows, each the median over the steps after the first two
(compilation, the LocalMesh's second-run specialisation; three for the compiled step, whose
third call is its last recorded one), all in one process; the first five rows take turns step
by step (interleaved), so load from other work on the machine falls on them alike:

- ``train_step``: the whole step (``float(step(batch))``).
- the virtual-device loop with the fast path off (every step recorded in full: shape inference
  per op, the structural key hashed at the sync) and on (a step that repeats its predecessor
  op by op takes its results from it and its program without hashing), reading the loss every
  step; ``record`` is the loop's Python until ``partita.sync()``, ``sync+run`` the rest (the
  cache lookup, the run, ``loss.item()``);
- the fast path again with ``torch.optim.AdamW(..., capturable=True)`` (its step counters and
  bias corrections are device tensors: the program the compiled step replays);
- the compiled step (``partita.compile``, ``torch.optim.AdamW(..., capturable=True)``; the
  other virtual-device rows keep the default ``capturable=False``, whose bias corrections are
  Python floats, lifted): ``record`` is the call (on a replay: the guards and the submission),
  ``sync+run`` the rest (``loss.item()`` waits for the run);
- the fast path without reading the loss every step (a step runs in a background thread while
  the next one records).

Wall-clock and process CPU time are both printed: other work on the machine inflates the first.
The goal the design is measured against: recording and lookup add at most 10% to the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.virtual import recording
from partita.virtual import state as virtual_state

Times = dict[str, list[float]]
#: Per row, its times (the loops append to it as they step).
TIMES: dict[str, Times] = {}
OVERLAPPED = "fast path, loss not read per step"
COMPILED = "compiled step (partita.compile)"
CAPTURABLE = "fast path, AdamW capturable=True"
#: Steps left out of a row's median (compilation; the compiled step's recorded calls).
SKIP = {COMPILED: 3}


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


def train_step_loop(cfg: GPTConfig, mesh: Mesh, data: list) -> Iterator[None]:
    """``train_step`` over ``data``, one step per ``next()``; times into ``TIMES["train_step"]``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = partita.train_step(
        model, loss_fn, opt, mesh=mesh, param_specs="fsdp+tp", batch_spec=P("data", None)
    )
    out = TIMES.setdefault("train_step", {"step": [], "step_cpu": []})
    for batch in data:
        wall, cpu = _clocks()
        float(step(batch))
        out["step"].append(time.perf_counter() - wall)
        out["step_cpu"].append(time.process_time() - cpu)
        yield


def _own_guide(guide: list[Any]) -> None:
    """Start this loop's next recording from its own last step (the fast path's guide).

    The loops take turns in one process: left alone, each step's guide would be the step the
    previous loop ran, and the loops would throw each other off the fast path. The previous
    loop's ``loss.item()`` may also have opened a recording (an op that runs at once opens
    one) with nothing in it: it starts afresh.
    """
    device = virtual_state.get()
    pending = device.recording
    if pending is not None and not pending.ops:
        recording.reset()
    device.last_guide = guide[0]


def _device_gpt(
    cfg: GPTConfig, mesh: Mesh, capturable: bool
) -> tuple[torch.device, torch.nn.Module, torch.optim.Optimizer]:
    """The GPT on the virtual device with the ``"fsdp+tp"`` preset marked, and its AdamW."""
    dev = partita.use_spmd(mesh)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    for pname, spec in partita.presets.param_specs("fsdp+tp", model, mesh).items():
        partita.mark_sharding(model.get_parameter(pname), mesh, spec)
    return dev, model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)


def _train(
    dev: torch.device,
    mesh: Mesh,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    xb: torch.Tensor,
    yb: torch.Tensor,
) -> torch.Tensor:
    """One unchanged torch training step on the device (the batch split over ``data``)."""
    x, y = xb.to(dev), yb.to(dev)
    partita.mark_sharding(x, mesh, P("data", None))
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def virtual_loop(
    name: str,
    cfg: GPTConfig,
    mesh: Mesh,
    data: list,
    *,
    fast_path: bool,
    read_loss: bool = True,
    capturable: bool = False,
) -> Iterator[None]:
    """The virtual-device loop over ``data``, one step per ``next()``; times into
    ``TIMES[name]``. ``DeviceState.fast_path`` is set before each step (loops interleave)."""
    dev, model, opt = _device_gpt(cfg, mesh, capturable)
    out = TIMES.setdefault(name, {k: [] for k in ("step", "step_cpu", "record", "record_cpu")})
    guide: list[Any] = [None]
    for xb, yb in data:
        virtual_state.get().fast_path = fast_path
        _own_guide(guide)
        wall, cpu = _clocks()
        loss = _train(dev, mesh, model, opt, xb, yb)
        out["record"].append(time.perf_counter() - wall)
        out["record_cpu"].append(time.process_time() - cpu)
        partita.sync()
        guide[0] = virtual_state.get().last_guide
        if read_loss:
            loss.item()  # waits for this step's run
        out["step"].append(time.perf_counter() - wall)
        out["step_cpu"].append(time.process_time() - cpu)
        yield
    partita.virtual.step.wait_in_flight()
    virtual_state.get().fast_path = True


def compiled_loop(cfg: GPTConfig, mesh: Mesh, data: list) -> Iterator[None]:
    """The same step as :func:`virtual_loop` under ``partita.compile``, CPU batches as
    arguments; times into ``TIMES[COMPILED]``."""
    dev, model, opt = _device_gpt(cfg, mesh, capturable=True)

    @partita.compile
    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return _train(dev, mesh, model, opt, xb, yb)

    out = TIMES.setdefault(COMPILED, {k: [] for k in ("step", "step_cpu", "record", "record_cpu")})
    guide: list[Any] = [None]
    for xb, yb in data:
        virtual_state.get().fast_path = True
        _own_guide(guide)
        wall, cpu = _clocks()
        loss = step(xb, yb)
        guide[0] = virtual_state.get().last_guide
        out["record"].append(time.perf_counter() - wall)
        out["record_cpu"].append(time.process_time() - cpu)
        loss.item()
        out["step"].append(time.perf_counter() - wall)
        out["step_cpu"].append(time.process_time() - cpu)
        yield
    partita.virtual.step.wait_in_flight()


def _row(name: str, t: Times, base: Times | None) -> str:
    skip = SKIP.get(name, 2)
    med = {k: statistics.median(v[skip:]) * 1e3 for k, v in t.items() if len(v) > skip}
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
    # train_step's first step runs a backward() before the loops below call use_spmd: the
    # device must be registered before the process's first backward().
    partita.virtual.register_device()
    recording.forget_guides()
    partita.metrics(reset=True)
    # train_step, the three recorded loops and the compiled step take turns, one step each, so
    # the machine's other load falls on all five alike.
    loops = [
        train_step_loop(cfg, mesh, data),
        virtual_loop("virtual loop, fast path off", cfg, mesh, data, fast_path=False),
        virtual_loop("virtual loop, fast path", cfg, mesh, data, fast_path=True),
        virtual_loop(CAPTURABLE, cfg, mesh, data, fast_path=True, capturable=True),
        compiled_loop(cfg, mesh, data),
    ]
    for _ in data:
        for loop in loops:
            next(loop)
    m = partita.metrics()
    ops = m.ops_recorded / m.syncs  # the compiled step's three recorded calls count too
    # Not reading the loss lets a step run while the next one records: alone, after the rest.
    for _ in virtual_loop(OVERLAPPED, cfg, mesh, data, fast_path=True, read_loss=False):
        pass
    after = partita.metrics()
    print(
        f"GPT layers={args.layers} d_model={args.d_model} batch={args.batch}, mesh 2x4, "
        f"{ops:.0f} ops recorded per step; medians of {args.steps} steps, ms; "
        f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}"
    )
    print(f"{'':<34} {'step':>15} {'record':>15} {'sync+run':>15}  {'vs train_step':>12}")
    print(f"{'':<34}" + f" {'wall':>7} {'cpu':>7}" * 3 + f"  {'wall':>6} {'cpu':>5}")
    base = TIMES["train_step"]
    for name, times in TIMES.items():
        print(_row(name, times, None if times is base else base))
    print(
        f"compiles: {after.compiles}; fast-path steps: {after.fast_path_hits} of "
        f"{after.syncs}; compiled-step replays: {after.compiled_step_replays}"
    )
    print(*(f"compiled step {k}: {v}" for k, v in after.compiled_steps.items()), sep="\n")
    cpu = {
        name: statistics.median(TIMES[name]["step_cpu"][SKIP.get(name, 2) :]) * 1e3
        for name in ("train_step", COMPILED)
    }
    print(
        f"goal row: compiled step {cpu[COMPILED]:.1f} ms CPU vs train_step "
        f"{cpu['train_step']:.1f} ms CPU: {(cpu[COMPILED] / cpu['train_step'] - 1) * 100:+.0f}% "
        f"(goal: at most +10%)"
    )


if __name__ == "__main__":
    main()
