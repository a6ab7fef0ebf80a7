"""Compiled per-device programs: a GPT FSDP step with ``inductor`` on and off.

Run: ``.venv/bin/python bench/bench_compiled.py [--devices 8] [--gloo 4] [--layers 4]
[--repeat 5]`` (``--gloo 0`` skips the multi-process run; ``--devices 0`` the simulated one).

The step: GPT (``--layers``, width 256, 8 heads, vocabulary 512, sequence 128, global batch 16),
cross entropy, AdamW, parameters and batch ``P("data")`` (FSDP) on a ``(n,)`` mesh, compiled by
``partita.jit`` twice: with ``inductor=False`` and ``True``. Both run in the same
process, their timed steps interleaved so load drift hits both alike:

* simulated: ``--devices`` devices on the LocalMesh in this process;
* Gloo: ``--gloo`` processes on 127.0.0.1 (``partita.runtime.launch.spawn``), one device each;
  a step's time is the max over ranks of each rank's median.

Printed per configuration: the first call's wall time (partita's compile, and for the compiled
one Inductor's compile of every region), partita's compile and Inductor's (``Jitted.stats``),
the number of compiled regions, the median step after two warm-ups, and the largest
difference between the two runs' parameters after the same steps (relative to their largest
magnitude). Inductor caches compiled graphs on disk (``/tmp/torchinductor_$USER``): a first
run on a machine compiles, later ones mostly load; ``--fresh-cache`` points Inductor at a new
empty cache directory to measure the cold cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.data import make_global, process_slice
from partita.models import GPT, GPTConfig
from partita.presets import param_specs
from partita.training import init_opt_state, make_train_step

BATCH = 16


def _config(layers: int) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_head=8, d_model=256, vocab_size=512, seq_len=128)


class Run:
    """One jitted FSDP GPT step and its carried parameters and optimizer state."""

    def __init__(self, mesh: Mesh, cfg: GPTConfig, inductor: bool) -> None:
        torch.manual_seed(0)
        model = GPT(cfg)
        self.params = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.state = init_opt_state(self.params)
        specs = param_specs("fsdp", model, mesh)
        pspecs = {k: specs[k] for k in self.params}

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))

        self.step = partita.jit(
            make_train_step(model, loss, "adamw"),
            mesh=mesh,
            in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                      (P("data"), P("data"))),
            options={"inductor": inductor},
        )  # fmt: skip
        ids = torch.randint(
            0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(0)
        )
        targets = ids.roll(-1, 1)
        if dist.is_initialized():
            rows = process_slice(ids.shape, mesh, P("data"))
            self.batch = tuple(
                make_global(t[rows], mesh, P("data"), global_shape=t.shape) for t in (ids, targets)
            )
        else:
            self.batch = (ids, targets)

    def __call__(self) -> None:
        _, self.params, _, self.state = self.step(self.params, {}, self.state, self.batch)


def _timed(fn: Callable[[], Any]) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _max_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure(mesh: Mesh, layers: int, repeat: int) -> dict[str, dict[str, Any]]:
    """Both runs: first call, compile costs, median step, and their parameter difference."""
    cfg = _config(layers)
    runs = {"plain": Run(mesh, cfg, False), "compiled": Run(mesh, cfg, True)}
    rows: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        first = _timed(run)
        second = _timed(run)  # the LocalMesh traces flat graphs on the second call
        stats = run.step.stats
        rows[name] = {
            "first": _max_over_ranks(first),
            "second": _max_over_ranks(second),
            "partita_compile": _max_over_ranks(stats.partition_seconds),
            "inductor_compile": _max_over_ranks(stats.inductor_seconds),
            "regions": stats.inductor_regions,
            "skipped": len(stats.skipped),
            "why_skipped": sorted({s.split(": ", 1)[-1][:160] for s in stats.skipped}),
        }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            times[name].append(_timed(run))
    for name in runs:
        rows[name]["step"] = _max_over_ranks(statistics.median(times[name]))
    a, b = runs["plain"].params, runs["compiled"].params
    diff = max(float((a[k].full() - b[k].full()).abs().max()) for k in a)
    scale = max(float(a[k].full().abs().max()) for k in a)
    rows["compiled"]["max_abs_diff"] = diff
    rows["compiled"]["max_rel_diff"] = diff / scale
    return rows


def _print(title: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"\n## {title}")
    print(
        f"{'configuration':<10} {'first call':>10} {'partita':>8} {'inductor':>9} {'regions':>7} "
        f"{'step':>8} {'vs plain':>8}"
    )
    base = rows["plain"]["step"]
    for name, r in rows.items():
        print(
            f"{name:<10} {r['first']:9.2f}s {r['partita_compile']:7.2f}s "
            f"{r['inductor_compile']:8.2f}s {int(r['regions']):7d} {r['step']:7.3f}s "
            f"{r['step'] / base:7.2f}x"
        )
    c = rows["compiled"]
    print(
        f"parameters after {c.get('steps', 0):.0f} steps: max |plain - compiled| "
        f"{c['max_abs_diff']:.2e} ({c['max_rel_diff']:.2e} of the largest parameter); "
        f"regions left uncompiled: {int(c['skipped'])}"
    )
    for why in c["why_skipped"]:
        print(f"  uncompiled because: {why}")


def worker(ns: argparse.Namespace) -> None:
    pd.initialize()
    mesh = Mesh.create((dist.get_world_size(),), ("data",))
    rows = measure(mesh, ns.layers, ns.repeat)
    if pd.is_main_process():
        print("RESULT " + json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (0: skip)")
    parser.add_argument("--gloo", type=int, default=4, help="Gloo processes (0: skip)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fresh-cache", action="store_true", help="an empty Inductor cache")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    if ns.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-bench-")
    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(
        f"# GPT {ns.layers} layers, d_model=256, heads=8, vocab=512, seq=128, batch={BATCH}, "
        f"AdamW, FSDP; torch {torch.__version__}, {os.cpu_count()} CPUs; median of "
        f"{ns.repeat} steps after 2 warm-ups; {_load()}"
    )
    steps = 2 + ns.repeat
    if ns.devices:
        rows = measure(Mesh.create((ns.devices,), ("data",)), ns.layers, ns.repeat)
        rows["compiled"]["steps"] = steps
        _print(f"{ns.devices} simulated devices (LocalMesh)", rows)
    if ns.gloo:
        from partita.runtime.launch import spawn

        argv = [__file__, "--worker", "--layers", str(ns.layers), "--repeat", str(ns.repeat)]
        results = spawn(argv, ns.gloo, timeout=3600)
        lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
        if any(r.returncode for r in results) or not lines:
            bad = next((r for r in results if r.returncode), results[0])
            print(f"\n## {ns.gloo} Gloo processes failed (rank {bad.rank}): {bad.stderr[-600:]}")
        else:
            rows = json.loads(lines[-1].removeprefix("RESULT "))
            rows["compiled"]["steps"] = steps
            _print(f"{ns.gloo} Gloo processes (one device each)", rows)
    print(f"# {_load()}")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


if __name__ == "__main__":
    main()
