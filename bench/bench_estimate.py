"""The Plan's step-time estimate beside the measured step, GPT-S on 4 Gloo processes.

Run: ``.venv/bin/python bench/bench_estimate.py [--repeat 7] [--only fsdp/(4,) ...]
[--dump ops.json] [--profile fit.json | --fit [fit.json]]``

On a new machine: ``bench_estimate.py --fit`` fits the ``cpu-gloo`` profile here first
(``bench_collectives.fit_profile``, the fit of ``bench_collectives.py --write``; ``--fit
FILE`` also keeps it), then measures the steps and prints, per configuration, the committed
profile's estimate and the fresh fit's beside the measured step, with their ratios.

The step is the one of ``bench/bench_distributed.py``: GPT (4 layers, width 256, 8 heads,
vocabulary 512, sequence 128, global batch 16), cross entropy, AdamW, compiled by
``partita.jit`` with the parameter specs of a preset (``partita.presets.param_specs``) and the
batch split over ``data``. Each configuration (a preset on a mesh) starts its own 4 worker
processes on 127.0.0.1 (``OMP_NUM_THREADS=1``, ``partita.runtime.launch.spawn``); rank 0
lowers the step, asks ``plan.estimate("cpu-gloo")`` and times the median of ``--repeat``
steps after two warm-ups (max over ranks: the slowest rank decides a step). The sweep over the
configurations runs ``--rounds`` times and each row shows the median of its sweeps, so a change
of the machine's load during the run does not favour the configurations that ran first.

The table shows the measured seconds and their spread over the sweeps (max - min), the
estimated seconds (with the runtime's overlap, ``partition.estimate``) and their ratio, the
estimate's compute, its communication (all of it, and the part exposed: not hidden behind
compute), and the estimate without overlap (``no-ovl``). At the end come the measured order and
each estimate's order, whether they agree and the largest ratio either way, and each pair of
configurations whose medians differ by less than their run-to-run spread (an order the
measurement does not decide). The machine is shared (other jobs
take its cores for minutes at a time), so each worker also measures its pace around the timed
steps: GPT-S's matmuls with the 4 processes computing at once, as
``bench_collectives.py`` measures ``peak_flops`` (``GFLOP/s``); ``scaled`` is the estimate
times the profile's ``peak_flops`` over that pace — the estimate of the profile refitted at
the moment of the measurement (compute and Gloo's collectives share the same cores).
``--dump FILE`` also writes each configuration's per-op FLOPs, bytes and op name and its
collective calls (kind, bytes, group size), so a profile can be tried without running the steps
again (``estimate_raw``). ``--profile FILE`` estimates with the figures a
``bench_collectives.py --write FILE`` fit wrote instead of the committed ``cpu-gloo`` (to check
a fresh fit before pasting it). The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import torch.nn.functional as F  # noqa: N812

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.cost import PROFILES, Hardware, Link
from partita.cost.flops import node_bytes, node_flops
from partita.data import make_global, process_slice
from partita.models import GPT, GPTConfig
from partita.presets import default_batch_spec
from partita.presets import param_specs as preset_param_specs
from partita.training import init_opt_state, make_train_step

CFG = GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=512, seq_len=128)
BATCH = 16
#: (preset, mesh shape): the four presets, dp and fsdp also on the 2-D mesh.
CONFIGS: list[tuple[str, tuple[int, ...]]] = [
    ("dp", (4,)),
    ("fsdp", (4,)),
    ("dp", (2, 2)),
    ("fsdp", (2, 2)),
    ("tp", (2, 2)),
    ("fsdp+tp", (2, 2)),
]


def _name(preset: str, shape: tuple[int, ...]) -> str:
    return f"{preset}/{tuple(shape)}".replace(" ", "")


def _mesh(shape: tuple[int, ...]) -> Mesh:
    return Mesh.create(shape, ("data", "model")[: len(shape)])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=torch.Generator())
    return ids, torch.roll(ids, -1, dims=1)


def _median(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _speed(repeat: int) -> float:
    """FLOP/s per process of GPT-S's matmuls with all 4 processes computing, now: what
    ``bench_collectives.py`` fits ``peak_flops`` with, measured beside the steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_collectives import _concurrent, _gpt_matmuls

    flops, seconds = _concurrent(_gpt_matmuls(), max(3, repeat))
    return flops / seconds


def _raw(plan: Any) -> dict[str, Any]:
    """Per-op (flops, bytes, op name) and per-call (kind, bytes, group size) of ``plan``."""
    vals = plan._local_values()
    ops = []
    for node in plan.local_program.graph.nodes:
        f, b = node_flops(node, vals), node_bytes(node, vals)
        if f or b:
            ops.append((f, b, str(node.target)))
    in_bucket = {i for b in plan.buckets for i in b.members}
    calls = [
        (c.kind, c.bytes, plan.mesh.axes_size(c.mesh_axes))
        for i, c in enumerate(plan.collectives)
        if i not in in_bucket
    ]
    for b in plan.buckets:
        first = plan.collectives[b.members[0]]
        calls.append((b.kind, plan.bucket_bytes(b), plan.mesh.axes_size(first.mesh_axes)))
    return {"ops": ops, "calls": calls}


def _ranges(one: Callable[[], None], steps: int = 3) -> dict[str, float]:
    """Seconds per step this rank spends inside partita's collective ranges, by kind (the
    synchronous call's range or, for a launched one, its launch and its ``partita.wait``
    range: the time the step is stopped for it) and ``step`` (the whole step's range), from
    ``steps`` steps under ``torch.profiler`` (``runtime.ranges``)."""
    import re

    pattern = re.compile(r"^partita\.(?:wait )?(\w+?)(?:_bucket)?\[")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one()
    out: dict[str, float] = {}
    for e in prof.events():
        key = "step" if e.name.startswith("partita.step ") else None
        match = pattern.match(e.name)
        key = match.group(1) if match else key
        if key is not None:
            out[key] = out.get(key, 0.0) + e.cpu_time_total * 1e-6 / steps
        if match:  # each range too, for --dump
            out[e.name] = out.get(e.name, 0.0) + e.cpu_time_total * 1e-6 / steps
    return out


def load_profile(path: Path | None) -> Hardware:
    """``cpu-gloo``, or it with the figures of a ``bench_collectives.py --write`` file."""
    hw = PROFILES["cpu-gloo"]
    if path is None:
        return hw
    fields = json.loads(Path(path).read_text())
    for key in ("intra_host", "inter_host"):
        fields[key] = Link(**fields[key])
    fields["source"] = f"{path}: {fields.get('source', '')}"
    return dataclasses.replace(hw, **fields)


def build(preset: str, shape: tuple[int, ...]) -> tuple[Any, Callable[[], None]]:
    """This rank's Plan of the GPT-S step with ``preset`` on a mesh of ``shape`` (the process
    group initialized) and a function that runs one step on its sharded state."""
    pd.initialize()
    mesh = _mesh(shape)
    torch.manual_seed(0)
    model = GPT(CFG)
    pspecs = preset_param_specs(preset, model, mesh)
    bspec = default_batch_spec(preset, mesh)

    def shard(t: torch.Tensor, spec: Any) -> Any:
        return make_global(
            t[process_slice(t.shape, mesh, spec)].clone(), mesh, spec, global_shape=t.shape
        )

    params = {k: shard(v.detach(), pspecs[k]) for k, v in model.named_parameters()}
    state = init_opt_state({"one": torch.zeros(())})
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = {k: shard(torch.zeros(v.shape), pspecs[k]) for k, v in params.items()}
    state["step"] = shard(state["step"], P())
    for p in model.parameters():  # the step reads the sharded copies only
        p.data = torch.empty(0)
    step = partita.jit(
        make_train_step(model, _loss, "adamw"),
        mesh=mesh,
        in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                  (bspec, bspec)),
    )  # fmt: skip
    ids, targets = _batch()
    rows = process_slice(ids.shape, mesh, bspec)
    batch = tuple(make_global(t[rows], mesh, bspec, global_shape=t.shape) for t in (ids, targets))
    plan = step.lower(params, {}, state, batch)
    box = [params, state]

    def one() -> None:
        _, box[0], _, box[1] = step(box[0], {}, box[1], batch)

    return plan, one


def worker(
    preset: str,
    shape: tuple[int, ...],
    repeat: int,
    ranges: bool = False,
    profile: Path | None = None,
) -> None:
    plan, one = build(preset, shape)
    speed = _speed(repeat)  # the machine's pace now, around the timed steps
    measured = _median(one, repeat)
    speed = (speed + _speed(repeat)) / 2
    inside = _ranges(one) if ranges else {}
    if pd.is_main_process():
        hw = load_profile(profile)
        est = plan.estimate(hw)
        row = {
            "committed": plan.estimate(PROFILES["cpu-gloo"]).total,
            "measured": measured,
            "estimate": est.total,
            "no_overlap": plan.estimate(hw, overlap=False).total,
            "compute": est.compute,
            "communication": est.communication,
            "exposed": est.exposed_communication,
            "collectives": dict(est.collectives),
            "flops": est.flops,
            "speed": speed,
            "raw": _raw(plan),
            "ranges": inside,
            "exposed_by_kind": dict(est.exposed or {}),
        }
        print("RESULT " + json.dumps(row))


def spawn_result(argv: list[str], name: str, timeout: float) -> dict[str, Any] | None:
    """Run ``argv`` on 4 Gloo processes (one thread each) and return rank 0's ``RESULT``
    line as a dict; None, and the failing rank's stderr printed, when a rank fails."""
    from partita.runtime.launch import spawn

    results = spawn(argv, 4, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
    if any(r.returncode for r in results) or not lines:
        bad = next((r for r in results if r.returncode), results[0])
        print(f"{name:<16} failed (rank {bad.rank}): {bad.stderr.strip()[-400:]}")
        return None
    return json.loads(lines[-1].removeprefix("RESULT "))


def estimate_raw(raw: dict[str, Any], hw: Hardware) -> float:
    """The estimate without overlap of a dumped configuration on ``hw``: the sums of
    ``partition.estimate.estimate_step(..., overlap=False)`` (4 processes on one host: every
    group on its link; the dump has no schedule to overlap)."""
    compute = sum(hw.op_seconds(f, b) for f, b, *_ in raw["ops"])
    comm = sum(
        hw.collective_seconds(kind, nbytes, Mesh.create((n,), ("g",)), ["g"])
        for kind, nbytes, n in raw["calls"]
        if n > 1
    )
    return compute + comm


def ranks_agree(measured: list[float], estimated: list[float]) -> bool:
    """Whether sorting by ``estimated`` gives the order sorting by ``measured`` gives."""
    order = sorted(range(len(measured)), key=measured.__getitem__)
    return sorted(range(len(estimated)), key=estimated.__getitem__) == order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="sweeps; the median is shown")
    parser.add_argument("--only", nargs="+", help="configurations, e.g. fsdp/(4,) tp/(2,2)")
    parser.add_argument("--dump", type=Path, help="write per-op and per-call data (JSON)")
    parser.add_argument(
        "--ranges",
        action="store_true",
        help="also profile 3 steps: per kind, the time inside its ranges beside its exposed "
        "estimate",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="estimate with cpu-gloo's figures from this bench_collectives.py --write file",
    )
    parser.add_argument(
        "--fit",
        nargs="?",
        const="",  # no FILE: a temporary one (a string: argparse would make Path("") ".")
        metavar="FILE",
        help="fit cpu-gloo on this machine first (bench_collectives.py's fit; FILE: keep it) "
        "and compare the committed profile's estimates with the fresh fit's",
    )
    parser.add_argument("--fit-repeat", type=int, default=9, help="the fit's --repeat")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.fit is not None and not ns.worker:
        ns.profile = _fit(ns.fit, ns.fit_repeat)
    if ns.worker:
        preset, shape = ns.worker[0], tuple(int(s) for s in ns.worker[1].split("x"))
        worker(preset, shape, ns.repeat, ns.ranges, ns.profile)
        return
    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"# GPT layers={CFG.n_layer} d_model={CFG.d_model} heads={CFG.n_head} "
          f"vocab={CFG.vocab_size} seq={CFG.seq_len} batch={BATCH}, AdamW; 4 Gloo processes "
          f"(OMP_NUM_THREADS=1), {os.cpu_count()} CPUs, torch {torch.__version__}; median of "
          f"{ns.repeat} steps after 2 warm-ups (max over ranks), median of {ns.rounds} "
          f"sweeps; estimate: cpu-gloo{f' with {ns.profile}' if ns.profile else ''}")  # fmt: skip
    print(_load())
    print(f"{'configuration':<16} {'measured':>9} {'spread':>7} {'estimate':>9} {'est/meas':>8} "
          f"{'compute':>9} {'comm':>9} {'exposed':>9} {'no-ovl':>9} {'GFLOP/s':>8} "
          f"{'scaled':>9} {'sc/meas':>7}  (each sweep's measurement)")  # fmt: skip
    names, measured, estimated, no_overlap, spread, dump = [], [], [], [], [], {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(ns.rounds):  # whole sweeps in turn: a change of load hits every row alike
        for preset, shape in CONFIGS:
            name = _name(preset, shape)
            if ns.only and name not in ns.only:
                continue
            argv = [__file__, "--worker", preset, "x".join(map(str, shape))]
            argv += ["--ranges"] if ns.ranges else []
            argv += ["--profile", str(ns.profile.resolve())] if ns.profile else []
            result = spawn_result([*argv, "--repeat", str(ns.repeat)], name, timeout=1800)
            if result is not None:
                runs.setdefault(name, []).append(result)
    peak = load_profile(ns.profile).peak_flops
    scaled = []
    for name, rs in runs.items():
        r = dict(rs[0])
        r["measured"] = statistics.median(x["measured"] for x in rs)
        r["speed"] = statistics.median(x["speed"] for x in rs)
        r["rounds"] = [x["measured"] for x in rs]
        r["scaled"] = r["estimate"] * peak / r["speed"]
        names.append(name)
        measured.append(r["measured"])
        estimated.append(r["estimate"])
        no_overlap.append(r["no_overlap"])
        spread.append(max(r["rounds"]) - min(r["rounds"]))
        scaled.append(r["scaled"])
        dump[name] = r
        print(f"{name:<16} {r['measured'] * 1e3:7.1f}ms {spread[-1] * 1e3:5.1f}ms "
              f"{r['estimate'] * 1e3:7.1f}ms "
              f"{r['estimate'] / r['measured']:8.2f} {r['compute'] * 1e3:7.1f}ms "
              f"{r['communication'] * 1e3:7.1f}ms {r['exposed'] * 1e3:7.1f}ms "
              f"{r['no_overlap'] * 1e3:7.1f}ms {r['speed'] / 1e9:8.1f} "
              f"{r['scaled'] * 1e3:7.1f}ms {r['scaled'] / r['measured']:7.2f}  "
              f"({', '.join(f'{x * 1e3:.0f}' for x in r['rounds'])})", flush=True)  # fmt: skip
    print(_load())
    for name in names if ns.ranges else ():
        _print_ranges(name, runs[name])
    if measured:
        print(f"measured order: {' < '.join(_by(names, measured))}")
    labels = (("estimate", estimated), ("no overlap", no_overlap), ("scaled", scaled))
    for label, values in labels if measured else ():
        worst = max(max(e / m, m / e) for m, e in zip(measured, values, strict=True))
        print(f"{label} order: {' < '.join(_by(names, values))}; same order as measured: "
              f"{ranks_agree(measured, values)}; largest ratio either way {worst:.2f}")  # fmt: skip
    for a, b, gap, noise in close_pairs(names, measured, spread):
        print(f"  {a} and {b} differ by {gap * 1e3:.1f} ms, less than the run-to-run spread "
              f"({noise * 1e3:.1f} ms): the measurement does not order them")  # fmt: skip
    if ns.profile and measured:
        _print_both(names, measured, spread, [runs[n][0]["committed"] for n in names], estimated)
    if ns.dump:
        ns.dump.write_text(json.dumps(dump))
        print(f"# wrote {ns.dump}")


def _fit(path: Path | str, repeat: int) -> Path:
    """Fit ``cpu-gloo`` on this machine (``bench_collectives.fit_profile``) into ``path`` (a
    temporary file if ``""``); the file."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_collectives import fit_profile

    path = Path(path or Path(tempfile.mkdtemp(prefix="partita-fit-")) / "fit.json")
    print(f"# fitting cpu-gloo on this machine: bench_collectives.py --repeat {repeat} "
          f"--write {path}")  # fmt: skip
    fit_profile(repeat, write=path)
    return path.resolve()


def _print_both(
    names: list[str],
    measured: list[float],
    spread: list[float],
    committed: list[float],
    fresh: list[float],
) -> None:
    """The committed profile's estimate and the fresh one's beside each measured step, with
    the ratio of the larger to the smaller (the check: each within 1.5x)."""
    print(f"{'configuration':<16} {'measured':>9} {'spread':>7} {'committed':>10} {'ratio':>6} "
          f"{'this fit':>10} {'ratio':>6}   (ratio: the larger over the smaller)")  # fmt: skip
    worst = [0.0, 0.0]
    for i, name in enumerate(names):
        m, cells = measured[i], []
        for j, e in enumerate((committed[i], fresh[i])):
            ratio = max(e / m, m / e)
            worst[j] = max(worst[j], ratio)
            cells.append(f"{e * 1e3:8.1f}ms {ratio:6.2f}")
        print(f"{name:<16} {m * 1e3:7.1f}ms {spread[i] * 1e3:5.1f}ms {cells[0]} {cells[1]}")
    print(f"largest ratio: committed profile {worst[0]:.2f}, this machine's fit {worst[1]:.2f} "
          f"(each within 1.5x: {worst[0] <= 1.5} / {worst[1] <= 1.5})")  # fmt: skip


def _print_ranges(name: str, rs: list[dict[str, Any]]) -> None:
    """One line per configuration: the median over sweeps of rank 0's time per step inside
    each kind's ranges (profiled) beside the estimate's exposed time of that kind."""
    kinds = sorted({k for r in rs for k in r["ranges"] if k != "step" and " " not in k})
    med = {k: statistics.median(r["ranges"].get(k, 0.0) for r in rs) for k in kinds}
    step = statistics.median(r["ranges"].get("step", 0.0) for r in rs)
    est = rs[0]["exposed_by_kind"]
    cells = ", ".join(f"{k} {med[k] * 1e3:.1f} (est {est.get(k, 0.0) * 1e3:.1f})" for k in kinds)
    print(f"  {name:<14} profiled step {step * 1e3:.1f} ms, outside collectives "
          f"{(step - sum(med.values())) * 1e3:.1f} ms (est compute {rs[0]['compute'] * 1e3:.1f}); "
          f"in ranges, ms: {cells}")  # fmt: skip


def close_pairs(
    names: list[str], measured: list[float], spread: list[float]
) -> list[tuple[str, str, float, float]]:
    """``(a, b, gap, spread)`` of each pair of configurations whose medians differ by less
    than the larger of their spreads (max - min over the sweeps): their order is noise."""
    out = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            gap, noise = abs(measured[i] - measured[j]), max(spread[i], spread[j])
            if gap < noise:
                out.append((names[i], names[j], gap, noise))
    return out


def _by(names: list[str], values: list[float]) -> list[str]:
    return [names[i] for i in sorted(range(len(values)), key=values.__getitem__)]


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"# load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


if __name__ == "__main__":
    main()
