"""Auto-sharding beside every preset, side by side in one run (``partita.auto``, docs/auto.md).

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_auto.py [--cases gpt-s llama ...]
[--meshes 8 2x4 4x2] [--time-limit 30] [--repeat 3] [--no-measure] [--no-bytes] [--meta]``;
``--gloo [--rounds 2]`` measures GPT-S on 4 Gloo processes instead (below); ``--scaling 12 48``
measures only the build and solve seconds of a width-64 GPT step as its layers grow
(``--repeat`` lowerings per size, medians).

**One cell** is a case on a mesh. Its training step is ``partita.train_step(...,
param_specs="auto")`` on a LocalMesh. ``step.lower(batch)`` solves and scores, on its real Plan,
the solver's plan (``auto``; ``auto-2``... when a memory round proposed again) and every preset
that applies to the mesh (``dp``, ``fsdp``; ``tp``, ``fsdp+tp`` on 2-D meshes): modelled step
seconds on the ``cpu-gloo`` profile (``Plan.estimate``), wire bytes per device per step, peak
bytes per device (``Plan.memory()``). ``*`` marks the plan kept. Then each preset is built as
its own ``train_step`` and run: ``measured`` is the median CPU time (``time.process_time``: the
machine is shared) of ``--repeat`` steps after two warm-ups; the auto step's measurement is on
the row of the plan it kept. A preset's own Plan must send exactly the bytes the report scored
(checked and printed). With the bytes objective (``auto_objective="bytes"``, a second solve) the
cell also prints the solver's plan's wire bytes against the best preset's, and whether the
solver's modelled bytes (the report's ``realized_wire_bytes``: its reshards as the partitioner
makes them) equal its Plan's bytes exactly. The solver's line
gives the problem's size, the build and solve seconds, the LP bound and the gap ("LP
integral" when the relaxation was integral). A summary table ends the run. ``--meta`` builds
the models on the meta device (shapes only: GPT-M's state on 8 simulated devices takes over
10 GB) and only lowers them.

Cases (training steps; AdamW, SGD for the CNNs):

* ``gpt-s``: GPT, 4 layers, width 256, 8 heads, vocabulary 512, sequence 128, batch 16;
* ``gpt-m``: GPT, 12 layers, width 768, 12 heads, vocabulary 512, sequence 128, batch 16;
* ``cnn``: SmallCNN (width 16) on 32x32 images, batch 16;
* five ``transformers`` families, the tiny configs of ``tests/test_models.py`` (random weights,
  nothing downloaded; hidden 32, one layer, batch 8): ``llama``, ``gpt2``, ``bert``, ``t5``,
  ``vit`` (``mistral``, ``qwen2``, ``gemma``, ``phi3``, ``mixtral`` also work);
* the cases where presets are weak (run with the bytes objective): ``cnn-b2`` (SmallCNN at
  batch 2), ``vocab`` (a GPT whose head dominates: width 256, vocabulary 32768, 1 layer),
  ``seq4096`` (a 1-layer GPT of width 128 at sequence 4096, batch 1).

**--gloo**: GPT-S on 4 Gloo processes (127.0.0.1, ``partita.runtime.launch.spawn``, each
configuration in its own processes, killed after ``--gloo-timeout`` seconds), on (4,) and
(2, 2), for ``auto`` and each preset: every rank builds the ``train_step`` (under ``auto`` every
rank solves; the ranks must agree on the plan, else the row fails), rank 0 reports the modelled
seconds of its Plan, and the step time is the median wall time of ``--repeat`` steps after two
warm-ups, max over ranks (``bench_estimate``'s helper). Sweeps run ``--rounds`` times, the median
is shown (every other sweep runs in reverse order). The run ends with auto's measured time over
the best preset's per mesh (when auto kept a preset, both rows run one program: the ratio is the
measurement's noise) and the Spearman rank correlation between modelled and measured step
times (``scipy.stats``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.models import GPT, GPTConfig, SmallCNN

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_estimate import _load, _median, spawn_result  # noqa: E402

Built = tuple[torch.nn.Module, Any, Any, torch.optim.Optimizer]
Case = Callable[[], Built]
PRESETS = ("dp", "fsdp", "tp", "fsdp+tp")


def _gpt_loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), t.flatten())


def _gpt(cfg: GPTConfig, batch: int) -> Case:
    def make() -> Built:
        torch.manual_seed(0)
        model = GPT(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
        data = (ids, torch.roll(ids, -1, 1))
        return model, _gpt_loss, data, torch.optim.AdamW(model.parameters())

    return make


def _cnn(batch: int, size: int = 32, width: int = 16) -> Case:
    def make() -> Built:
        torch.manual_seed(0)
        model = SmallCNN(in_channels=3, num_classes=10, size=size, width=width).train()
        data = (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))
        return model, F.cross_entropy, data, torch.optim.SGD(model.parameters(), lr=0.1)

    return make


def _library(name: str) -> Case:
    """A tiny ``transformers`` model as the test suite builds it (tests/test_models.py)."""

    def make() -> Built:
        os.environ["HF_HUB_OFFLINE"] = "1"  # never download: built from a config
        sys.path.insert(0, str(HERE.parent / "tests"))
        from test_models import MODELS, build

        model, case = build(name), MODELS[name]
        inputs, targets = case.batches(torch.Generator().manual_seed(0))[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        return model, case.loss, (inputs, targets), opt

    return make


GPT_S = GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=512, seq_len=128)
LIBRARY = ("llama", "gpt2", "bert", "t5", "vit", "mistral", "qwen2", "gemma", "phi3", "mixtral")
CASES: dict[str, Case] = {
    "gpt-s": _gpt(GPT_S, 16),
    "gpt-m": _gpt(GPTConfig(n_layer=12, n_head=12, d_model=768, vocab_size=512, seq_len=128), 16),
    "cnn": _cnn(16),
    **{name: _library(name) for name in LIBRARY},
    "cnn-b2": _cnn(2),
    "vocab": _gpt(GPTConfig(n_layer=1, n_head=4, d_model=256, vocab_size=32768, seq_len=64), 8),
    "seq4096": _gpt(GPTConfig(n_layer=1, n_head=4, d_model=128, vocab_size=256, seq_len=4096), 1),
}
DEFAULT_CASES = ["gpt-s", "gpt-m", "cnn", "llama", "gpt2", "bert", "t5", "vit"]


def _mesh(text: str) -> Mesh:
    shape = tuple(int(x) for x in text.split("x"))
    return Mesh.create(shape, ("data",) if len(shape) == 1 else ("data", "model"))


def _step(
    case: str, mesh: Mesh, param_specs: str, meta: bool = False, **options: Any
) -> tuple[Any, Any]:
    """The case's training step and batch (on the meta device: shapes only, for ``lower``)."""
    with torch.device("meta" if meta else "cpu"):
        model, loss, batch, opt = CASES[case]()
    return partita.train_step(
        model, loss, opt, mesh=mesh, param_specs=param_specs, options=options
    ), batch


def _cpu_median(step: Any, batch: Any, repeat: int) -> float:
    """Median CPU seconds of one step (after two warm-ups), on the LocalMesh."""
    step(batch)
    step(batch)
    times = []
    for _ in range(repeat):
        start = time.process_time()
        step(batch)
        times.append(time.process_time() - start)
    return statistics.median(times)


def _solver_plan(report: Any) -> Any:
    """The solver's last proposal, scored (None when it proposed nothing)."""
    names = [c.name for c in report.candidates if c.name.startswith("auto")]
    return next((c for c in report.candidates if names and c.name == names[-1]), None)


def cell(case: str, mesh_text: str, ns: argparse.Namespace) -> dict[str, Any]:
    mesh = _mesh(mesh_text)
    limit = {"auto_time_limit": ns.time_limit}
    step, batch = _step(case, mesh, "auto", ns.meta, auto_objective="time", **limit)
    start = time.perf_counter()
    report = step.lower(batch).auto
    row: dict[str, Any] = {"case": case, "mesh": mesh_text, "report": report, "measured": {}}
    row["wall"] = time.perf_counter() - start
    row["same_bytes"] = {}
    for c in report.candidates:
        if c.name in PRESETS:  # the preset as its own step: same Plan bytes, then timed
            pstep, pbatch = _step(case, mesh, c.name, ns.meta)
            row["same_bytes"][c.name] = pstep.lower(pbatch).estimate().wire_bytes == c.wire_bytes
            if ns.measure:
                row["measured"][c.name] = _cpu_median(pstep, pbatch, ns.repeat)
    if ns.measure:
        row["measured"]["train_step auto"] = _cpu_median(step, batch, ns.repeat)
    if ns.bytes:
        bstep, bbatch = _step(case, mesh, "auto", ns.meta, auto_objective="bytes", **limit)
        row["bytes_report"] = bstep.lower(bbatch).auto
    return row


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def show(row: dict[str, Any]) -> dict[str, Any]:
    """Print one cell; return its summary line's figures."""
    r, measured = row["report"], row["measured"]
    print(f"\n== {row['case']} on ({row['mesh'].replace('x', ', ')})", flush=True)
    cert = "LP integral" if r.integral_lp else f"gap {r.gap:.2%}"
    print(
        f"   solver {r.solver}: {r.variables} variables, {r.rows} rows, build "
        f"{r.build_seconds:.2f} s + solve {r.solve_seconds:.2f} s (CPU {r.build_cpu_seconds:.2f}"
        f" + {r.solve_cpu_seconds:.2f} s), {cert}, model objective {r.model_objective:.6g} us, "
        f"LP relaxation {r.lp_objective:.6g} us, bound {r.bound:.6g} us; lower() "
        f"{row['wall']:.1f} s (with the presets' compiles)"
    )
    print(f"   {'plan':<10}{'model ms':>10}{'wire MiB':>10}{'peak MiB':>10}{'CPU ms':>10}")
    for c in sorted(r.candidates, key=lambda c: c.seconds):
        ran = measured.get(c.name, measured.get("train_step auto") if c.name == r.chosen else None)
        ms = f"{ran * 1e3:10.1f}" if ran is not None else f"{'-':>10}"
        mark = "*" if c.name == r.chosen else " "
        print(f" {mark} {c.name:<10}{c.seconds * 1e3:10.2f}{c.wire_bytes / 2**20:10.3f}"
              f"{c.peak / 2**20:10.2f}{ms}")  # fmt: skip
    presets = [c for c in r.candidates if c.name in PRESETS]
    mine = _solver_plan(r)
    out = {"case": row["case"], "mesh": row["mesh"], "cert": cert, "chosen": r.chosen}
    out["solve"] = r.build_seconds + r.solve_seconds
    out["cpu"] = (r.build_cpu_seconds, r.solve_cpu_seconds)
    out["variables"] = r.variables
    best = min(presets, key=lambda c: c.seconds)
    out["time_ratio"] = _ratio(mine.seconds, best.seconds) if mine else float("nan")
    out["kept_ratio"] = _ratio(r.best().seconds, best.seconds)
    same = row["same_bytes"]
    print(f"   each preset's own Plan sends the bytes scored: "
          f"{', '.join(f'{k} {v}' for k, v in same.items())}")  # fmt: skip
    out["bytes_ratio"], out["bytes_exact"], out["bytes_compute"] = float("nan"), "-", float("nan")
    b = row.get("bytes_report")
    if b is not None:
        bmine = _solver_plan(b)
        bpresets = [c for c in b.candidates if c.name in PRESETS]
        bbest = min(c.wire_bytes for c in bpresets)
        if bmine is not None:
            least = min(c.compute for c in bpresets)  # the objective holds compute near this
            out["bytes_compute"] = _ratio(bmine.compute, least)
            out["bytes_ratio"] = _ratio(bmine.wire_bytes, bbest)
            # the report's modelled bytes of the solver's plan: its reshards as the partitioner
            # makes them (auto.realize), the stored-bytes tie-break taken off
            exact = abs(b.realized_wire_bytes - bmine.wire_bytes) <= 0.5
            out["bytes_exact"] = "yes" if exact else "no"
            print(f"   objective bytes: solver's plan {bmine.wire_bytes / 2**20:.3f} MiB "
                  f"(compute {out['bytes_compute']:.2f}x the most parallel preset's), best "
                  f"preset {bbest / 2**20:.3f} MiB; modelled bytes equal the Plan's bytes "
                  f"exactly: {exact} (model {b.realized_wire_bytes:.0f} B, objective "
                  f"{b.model_objective:.0f} B, Plan {bmine.wire_bytes:.0f} B); {b.solver}, "
                  f"{'LP integral' if b.integral_lp else f'gap {b.gap:.2%}'}")  # fmt: skip
    return out


def summary(lines: list[dict[str, Any]]) -> None:
    print("\n== summary: the solver's plan over the best preset (modelled, cpu-gloo)")
    print(f"   {'case':<8}{'mesh':<6}{'time':>7}{'kept':>7}{'bytes':>7}{'compute':>8}  "
          f"{'exact':<6}{'kept plan':<10}{'solve s':>8}{'build CPU':>10}{'solve CPU':>10}"
          f"{'variables':>10}  certificate")  # fmt: skip
    for s in lines:
        print(f"   {s['case']:<8}{s['mesh']:<6}{s['time_ratio']:7.3f}{s['kept_ratio']:7.3f}"
              f"{s['bytes_ratio']:7.3f}{s['bytes_compute']:8.2f}  {s['bytes_exact']:<6}"
              f"{s['chosen']:<10}{s['solve']:8.2f}{s['cpu'][0]:10.2f}{s['cpu'][1]:10.2f}"
              f"{s['variables']:10d}  {s['cert']}")  # fmt: skip
    print(
        "   time: auto's modelled step / best preset's; kept: the plan kept / best preset's "
        "(<= 1 by construction); bytes: auto's wire bytes / best preset's under "
        "auto_objective='bytes' (compute: its modelled compute over the most parallel "
        "preset's); exact: the solver's modelled bytes equal its Plan's; solve s: build and "
        "solve, wall clock; build / solve CPU: the same in CPU seconds (time.process_time)"
    )


#: (configuration, mesh shape) of the Gloo run: auto and every preset that applies.
GLOO: list[tuple[str, tuple[int, ...]]] = [
    *((name, (4,)) for name in ("auto", "dp", "fsdp")),
    *((name, (2, 2)) for name in ("auto", *PRESETS)),
]


def gloo_worker(name: str, shape: tuple[int, ...], ns: argparse.Namespace) -> None:
    """One rank: build GPT-S's step under ``name``, check the ranks compiled one plan, time it."""
    import torch.distributed as dist

    import partita.distributed as pd

    pd.initialize()
    mesh = Mesh.create(shape, ("data", "model")[: len(shape)])
    step, batch = _step("gpt-s", mesh, name, auto_time_limit=ns.time_limit)
    start = time.perf_counter()
    plan = step.lower(batch)
    lowered = time.perf_counter() - start
    chosen = plan.auto.chosen if plan.auto is not None else name
    mine = (chosen, [(c.kind, c.bytes, tuple(c.mesh_axes)) for c in plan.collectives])
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(x != mine for x in every):  # each rank solved alone: they must agree
        raise SystemExit(f"{name}: the ranks compiled different plans: {[x[0] for x in every]}")
    measured = _median(lambda: step(batch), ns.repeat)
    if pd.is_main_process():
        est = plan.estimate("cpu-gloo")
        row = {"measured": measured, "modelled": est.total, "wire": est.wire_bytes}
        row.update(chosen=chosen, lower=lowered)
        print("RESULT " + json.dumps(row), flush=True)


def gloo(ns: argparse.Namespace) -> None:
    """GPT-S on 4 Gloo processes: auto beside every preset, measured and modelled."""
    from scipy.stats import spearmanr

    print(f"# GPT-S (4 layers, width 256, vocabulary 512, sequence 128, batch 16), AdamW; 4 Gloo "
          f"processes (OMP_NUM_THREADS=1) per configuration, {os.cpu_count()} CPUs; median of "
          f"{ns.repeat} steps after 2 warm-ups (max over ranks), median of {ns.rounds} sweeps; "
          f"modelled: Plan.estimate('cpu-gloo')")  # fmt: skip
    print(_load(), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for sweep in range(ns.rounds):  # whole sweeps, every other one reversed: a change of
        for name, shape in GLOO[:: -1 if sweep % 2 else 1]:  # load hits every row alike
            key = f"{name}/{shape}".replace(" ", "")
            argv = [__file__, "--gloo-worker", name, "x".join(map(str, shape)),
                    "--repeat", str(ns.repeat), "--time-limit", str(ns.time_limit)]  # fmt: skip
            result = spawn_result(argv, key, timeout=ns.gloo_timeout)
            if result is None:
                continue
            runs.setdefault(key, []).append(result)
            print(f"#   {key}: {runs[key][-1]}", flush=True)
    print(_load())
    print(f"{'configuration':<16}{'measured':>11}{'modelled':>11}{'wire MiB':>10}  kept plan  "
          f"(each sweep's measurement)")  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for key, rs in runs.items():
        r = dict(rs[0], measured=statistics.median(x["measured"] for x in rs))
        rows[key] = r
        each = ", ".join(f"{x['measured'] * 1e3:.0f}" for x in rs)
        print(f"{key:<16}{r['measured'] * 1e3:9.1f}ms{r['modelled'] * 1e3:9.1f}ms"
              f"{r['wire'] / 2**20:10.2f}  {r['chosen']:<10} ({each})")  # fmt: skip
    for shape in ("(4,)", "(2,2)"):
        auto = rows.get(f"auto/{shape}")
        presets = [r["measured"] for k, r in rows.items() if k.endswith(shape) and "auto" not in k]
        if auto and presets:
            kept = auto["chosen"]
            same = f"(auto kept {kept}: the same program)" if kept != "auto" else ""
            print(f"measured auto / best preset on {shape}: {auto['measured'] / min(presets):.3f} "
                  f"(goal <= 1.05) {same}")  # fmt: skip
    if len(rows) >= 3:
        measured = [r["measured"] for r in rows.values()]
        modelled = [r["modelled"] for r in rows.values()]
        rho = spearmanr(modelled, measured).statistic
        print(f"Spearman rank correlation, modelled vs measured over {len(rows)} configurations "
              f"(auto and the presets, both meshes): {rho:.3f} (goal >= 0.8)")  # fmt: skip


def scaling(layers: list[int], mesh_text: str, time_limit: float, repeat: int = 1) -> None:
    """Build and solve seconds of a GPT step (width 64) as the layers grow: the step is
    ``partita.jit(make_train_step(...), auto=True)`` (its baselines: replicated and batch).
    ``build CPU`` is the CPU time (``time.process_time``) of the solver's build (the
    propagation state, the space, the clusters, the matrices: ``search._Solver``), ``solve
    CPU`` that of pricing the presets' choices and solving; with ``--repeat`` above 1, each
    size is lowered that many times (alternating sizes) and the medians are shown."""
    mesh = _mesh(mesh_text)
    print(f"\n== solve time as layers grow, GPT width 64 on ({mesh_text.replace('x', ', ')})")
    print(f"   {'layers':>6}{'variables':>11}{'build s':>9}{'solve s':>9}{'build CPU':>10}"
          f"{'solve CPU':>10}{'build+solve CPU':>16}  certificate")  # fmt: skip
    runs: dict[int, list[Any]] = {n: [] for n in layers}
    for _ in range(repeat):
        for n in layers:
            runs[n].append(_scaling_run(n, mesh, time_limit))
    for n in layers:
        rs = runs[n]
        build = statistics.median(r.build_seconds for r in rs)
        solve = statistics.median(r.solve_seconds for r in rs)
        build_cpu = statistics.median(r.build_cpu_seconds for r in rs)
        solve_cpu = statistics.median(r.solve_cpu_seconds for r in rs)
        both = statistics.median(r.build_cpu_seconds + r.solve_cpu_seconds for r in rs)
        r = rs[-1]
        cert = "LP integral" if r.integral_lp else f"gap {r.gap:.2%}"
        print(f"   {n:>6}{r.variables:>11}{build:>9.2f}{solve:>9.2f}{build_cpu:>10.2f}"
              f"{solve_cpu:>10.2f}{both:>16.2f}  {cert}")  # fmt: skip
    print(_load())


def _scaling_run(n: int, mesh: Mesh, time_limit: float) -> Any:
    """One lowering of the ``n``-layer step: its auto report."""
    from partita.training import init_opt_state, make_train_step

    cfg = GPTConfig(n_layer=n, n_head=4, d_model=64, vocab_size=256, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    step = make_train_step(model, _gpt_loss, "adamw")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    args = (params, {}, init_opt_state(params, "adamw"), (ids, torch.roll(ids, -1, 1)))
    jitted = partita.jit(step, mesh=mesh, auto=True, options={"auto_time_limit": time_limit})
    return jitted.lower(*args).auto


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--meshes", nargs="+", default=["8", "2x4", "4x2"])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--no-measure", dest="measure", action="store_false")
    parser.add_argument("--no-bytes", dest="bytes", action="store_false")
    parser.add_argument("--meta", action="store_true", help="meta models: lower only (no run)")
    parser.add_argument("--scaling", nargs="*", type=int, help="layers, e.g. 12 48 (only this)")
    parser.add_argument("--gloo", action="store_true", help="GPT-S on 4 Gloo processes")
    parser.add_argument("--rounds", type=int, default=2, help="Gloo sweeps (median)")
    parser.add_argument("--gloo-timeout", type=float, default=1200.0, help="per configuration")
    parser.add_argument("--gloo-worker", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    # the Plans are the output; a preset's or the solver's involuntary gather is in them
    warnings.filterwarnings("ignore", category=partita.RematerializationWarning)
    if ns.gloo_worker:
        gloo_worker(ns.gloo_worker[0], tuple(int(s) for s in ns.gloo_worker[1].split("x")), ns)
        return
    print("command: PYTHONPATH=src python " + " ".join(sys.argv))
    if ns.gloo:
        gloo(ns)
        return
    if ns.scaling:
        for m in ns.meshes:
            scaling(ns.scaling, m, ns.time_limit, ns.repeat)
        return
    print(_load(), flush=True)
    ns.measure = ns.measure and not ns.meta
    lines = []
    for case in ns.cases:
        for m in ns.meshes:
            try:
                lines.append(show(cell(case, m, ns)))
            except Exception as e:  # one failing cell does not stop the others
                print(f"\n== {case} on {m} failed: {type(e).__name__}: {str(e)[:400]}")
    print(_load())
    summary(lines)


if __name__ == "__main__":
    main()
