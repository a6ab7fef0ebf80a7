"""Auto-sharding beside every preset, side by side in one run (``partita.auto``, docs/auto.md).

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_auto.py [--cases gpt-s cnn ...]
[--meshes 8 2x4 4x2] [--objective time|bytes] [--time-limit 30]``; ``--scaling 12 48``
measures only the build and solve seconds of a width-64 GPT step as its layers grow.

Each case is a training step (``partita.train_step(..., param_specs="auto")``, AdamW for the
GPTs, SGD for the CNN) lowered once on a LocalMesh (nothing runs). For each case and mesh the
table has one row per candidate: the solver's plan (``auto``) and every preset that applies to
the mesh (``dp``, ``fsdp``; ``tp``, ``fsdp+tp`` on 2-D meshes), each scored on its real Plan:
modelled step seconds on the ``cpu-gloo`` profile (``Plan.estimate``), wire bytes per device
per step, and peak memory per device (``Plan.memory()``). The ``*`` marks the plan kept. The
solver's line gives the problem's size, the build and solve seconds, the LP bound and the gap
("LP integral" when the relaxation was integral). Compile and solve times are wall times on a
shared 2-core machine: noisy, one run each.

Cases:

* ``gpt-s``: GPT, 4 layers, width 256, 8 heads, vocabulary 512, sequence 128, batch 16;
* ``gpt-m``: GPT, 12 layers, width 768, 12 heads, vocabulary 512, sequence 128, batch 16;
* ``cnn``: SmallCNN (width 16) on 32x32 images, batch 16;
* the three cases where presets are weak (run with ``--objective bytes``: auto's wire bytes
  against the best preset's): ``cnn-b2`` (SmallCNN at batch 2 on 8 devices), ``vocab``
  (a GPT whose head dominates: width 256, vocabulary 32768, 1 layer), ``seq4096`` (a 1-layer
  GPT of width 128 at sequence 4096, batch 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.models import GPT, GPTConfig, SmallCNN

Case = Callable[[], tuple[torch.nn.Module, Any, Any, torch.optim.Optimizer]]


def _gpt(cfg: GPTConfig, batch: int) -> Case:
    def make() -> tuple[torch.nn.Module, Any, Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(cfg)

        def loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), t.flatten())

        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
        return model, loss, (ids, torch.roll(ids, -1, 1)), torch.optim.AdamW(model.parameters())

    return make


def _cnn(batch: int, size: int = 32, width: int = 16) -> Case:
    def make() -> tuple[torch.nn.Module, Any, Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = SmallCNN(in_channels=3, num_classes=10, size=size, width=width).train()
        data = (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))
        return model, F.cross_entropy, data, torch.optim.SGD(model.parameters(), lr=0.1)

    return make


CASES: dict[str, Case] = {
    "gpt-s": _gpt(GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=512, seq_len=128), 16),
    "gpt-m": _gpt(GPTConfig(n_layer=12, n_head=12, d_model=768, vocab_size=512, seq_len=128), 16),
    "cnn": _cnn(16),
    "cnn-b2": _cnn(2),
    "vocab": _gpt(GPTConfig(n_layer=1, n_head=4, d_model=256, vocab_size=32768, seq_len=64), 8),
    "seq4096": _gpt(GPTConfig(n_layer=1, n_head=4, d_model=128, vocab_size=256, seq_len=4096), 1),
}


def _mesh(text: str) -> Mesh:
    shape = tuple(int(x) for x in text.split("x"))
    return Mesh.create(shape, ("data",) if len(shape) == 1 else ("data", "model"))


def run(case: str, mesh_text: str, objective: str, time_limit: float) -> dict[str, Any]:
    model, loss, batch, opt = CASES[case]()
    mesh = _mesh(mesh_text)
    options = {"auto_objective": objective, "auto_time_limit": time_limit}
    step = partita.train_step(model, loss, opt, mesh=mesh, param_specs="auto", options=options)
    start = time.perf_counter()
    plan = step.lower(batch)
    wall = time.perf_counter() - start
    return {"case": case, "mesh": mesh_text, "report": plan.auto, "wall": wall}


def show(row: dict[str, Any]) -> None:
    r = row["report"]
    print(f"\n== {row['case']} on ({row['mesh'].replace('x', ', ')}) — objective {r.objective}")
    cert = "LP integral" if r.integral_lp else f"gap {r.gap:.2%}"
    print(
        f"   solver {r.solver}: {r.variables} variables, {r.rows} rows, build "
        f"{r.build_seconds:.2f} s + solve {r.solve_seconds:.2f} s, {cert}, model objective "
        f"{r.model_objective:.4g} {'us' if r.objective == 'time' else 'B'}; "
        f"lower() total {row['wall']:.1f} s (with the presets' compiles)"
    )
    print(f"   {'plan':<10}{'model ms':>11}{'wire MiB':>11}{'peak MiB':>11}")
    for c in sorted(r.candidates, key=lambda c: c.seconds):
        mark = "*" if c.name == r.chosen else " "
        print(
            f" {mark} {c.name:<10}{c.seconds * 1e3:11.3f}{c.wire_bytes / 2**20:11.3f}"
            f"{c.peak / 2**20:11.2f}"
        )
    presets = [c for c in r.candidates if not c.name.startswith("auto")]
    if presets:
        best = r.best()
        if r.objective == "bytes":
            ref = min(c.wire_bytes for c in presets)
            ratio = best.wire_bytes / ref if ref else float("nan")
            print(f"   kept/best preset wire bytes: {ratio:.3f}")
        else:
            ratio = best.seconds / min(c.seconds for c in presets)
            print(f"   kept/best preset modelled time: {ratio:.3f}")


def scaling(layers: list[int], mesh_text: str, time_limit: float) -> None:
    """Build and solve seconds of a GPT step (width 64) as the layers grow: the step is
    ``partita.jit(make_train_step(...), auto=True)`` (its baselines: replicated and batch)."""
    from partita.training import init_opt_state, make_train_step

    mesh = _mesh(mesh_text)
    print(f"\n== solve time as layers grow, GPT width 64 on ({mesh_text.replace('x', ', ')})")
    print(f"   {'layers':>6}{'variables':>11}{'build s':>9}{'solve s':>9}  certificate")
    for n in layers:
        cfg = GPTConfig(n_layer=n, n_head=4, d_model=64, vocab_size=256, seq_len=64)
        torch.manual_seed(0)
        model = GPT(cfg)

        def loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), t.flatten())

        step = make_train_step(model, loss, "adamw")
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
        args = (params, {}, init_opt_state(params, "adamw"), (ids, torch.roll(ids, -1, 1)))
        jitted = partita.jit(step, mesh=mesh, auto=True, options={"auto_time_limit": time_limit})
        r = jitted.lower(*args).auto
        cert = "LP integral" if r.integral_lp else f"gap {r.gap:.2%}"
        print(f"   {n:>6}{r.variables:>11}{r.build_seconds:>9.2f}{r.solve_seconds:>9.2f}  {cert}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["gpt-s", "cnn"], choices=list(CASES))
    parser.add_argument("--meshes", nargs="+", default=["8", "2x4", "4x2"])
    parser.add_argument("--objective", default="time", choices=["time", "bytes"])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--scaling", nargs="*", type=int, help="layers, e.g. 12 48 (only this)")
    args = parser.parse_args()
    print("command: PYTHONPATH=src python " + " ".join(sys.argv))
    if args.scaling:
        for m in args.meshes:
            scaling(args.scaling, m, args.time_limit)
        return
    for case in args.cases:
        for m in args.meshes:
            show(run(case, m, args.objective, args.time_limit))


if __name__ == "__main__":
    main()
