"""Each collective call of a GPT-S step on 4 Gloo processes, timed, beside the estimate's call.

Run: ``.venv/bin/python bench/bench_calls.py fsdp/(4,) [dp/(4,) ...] [--steps 5] [--sync]``
or ``... --copies ROUNDS [--profile fit.json]`` (the runtime's copies alone, below)

The step is ``bench/bench_estimate.py``'s (GPT-S, AdamW, a preset on 4 processes). Each
configuration starts 4 worker processes; after two warm-ups every rank profiles ``--steps``
steps and reads partita's ranges (``runtime.ranges``: a collective's launch and its
``partita.wait``, or the whole call when it runs where it stands). Per call, in launch order,
the table gives: the measured start of its launch after the step's start (rank 0), the
compute before it (from the end of the previous call's launch range to this launch, rank 0),
the time inside its wait range (or its whole call under ``--sync``) as the median over steps,
min and max over the 4 ranks, and the runtime's copies for it (``aten::cat``,
``aten::clone`` and ``aten::split_with_sizes_copy`` inside its ranges: packing a bucket,
unpacking a gathered value); and beside it the estimate's call (``partition.estimate``): the
modelled clock at its launch, the compute since the previous launch, its modelled seconds, the
overhead in them (``Hardware.call_seconds``) and its exposed time in the walk; the header gives
the runtime's copies of the step, measured and modelled (``cost.copies``).

``--sync`` runs the step with ``PARTITA_OVERLAP_BYTES=0``: every collective where the
partitioner put it, synchronously, so each range is the call's whole time at its place, the
quantity the estimate prices per call (``plan.estimate(hw, overlap=False)`` adds them). The
profiler records every op, which slows the compute between calls a little. The load average is
printed before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_estimate import _load, build, load_profile, spawn_result

import partita.distributed as pd
from partita.cost.copies import call_copies
from partita.cost.flops import node_bytes, node_flops
from partita.partition.estimate import add_copies, exposed_times, overlap_calls
from partita.runtime import dist_ops


def _step_ranges(one: Any, steps: int) -> list[list[tuple[str, float, float, float]]]:
    """Per profiled step, ``(range name, start after the step's start, seconds, seconds of
    copies)`` of each of partita's collective ranges in it, by start; the copies are the
    ``aten::cat``, ``aten::clone`` and ``aten::split_with_sizes_copy`` calls inside the range
    (the runtime's packing of a call's buffer and unpacking of its result,
    ``runtime.dist_ops``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one()
    every = list(prof.events())
    events = [e for e in every if e.name.startswith("partita.")]
    copies = sorted(
        (e.time_range.start, e.time_range.end, e.thread)
        for e in every
        if e.name in ("aten::cat", "aten::clone", "aten::split_with_sizes_copy")
    )

    def copied(e: Any) -> float:
        a, b = e.time_range.start, e.time_range.end
        return sum(y - x for x, y, t in copies if t == e.thread and a <= x and y <= b) * 1e-6

    starts = [e for e in events if e.name.startswith("partita.step ")]
    out = []
    for s in sorted(starts, key=lambda e: e.time_range.start):
        t0, t1 = s.time_range.start, s.time_range.end
        inside = [
            (
                e.name,
                (e.time_range.start - t0) * 1e-6,
                (e.time_range.end - e.time_range.start) * 1e-6,
                copied(e),
            )
            for e in events
            if not e.name.startswith("partita.step ") and t0 <= e.time_range.start <= t1
        ]
        inside.append(("step", 0.0, (t1 - t0) * 1e-6, 0.0))
        out.append(sorted(inside, key=lambda r: r[1]))
    return out


def _calls(steps: list[list[tuple[str, float, float, float]]]) -> list[dict[str, Any]]:
    """One row per call of the step (medians over ``steps``): its launch's start, the compute
    before it (since the previous launch range ended), the seconds inside its wait range
    (synchronous: the call's own range)."""
    rows: list[dict[str, Any]] = []
    for ranges in steps:
        step = next(r[2] for r in ranges if r[0] == "step")
        launches = [
            r
            for r in ranges
            if r[0] != "step" and not r[0].startswith(("partita.wait ", "partita.axis_index"))
        ]
        waits = {
            r[0].removeprefix("partita.wait "): r
            for r in ranges
            if r[0].startswith("partita.wait ")
        }
        previous_end = 0.0
        for k, (name, start, seconds, copies) in enumerate(launches):
            wait = waits.get(name.removeprefix("partita."))
            row = {
                "name": name.removeprefix("partita.").split(" @")[0],
                "start": start,
                "before": start - previous_end,
                "launch": seconds,
                "wait": wait[2] if wait else seconds,
                "copies": copies + (wait[3] if wait else 0.0),
                "step": step,
            }
            previous_end = start + seconds
            if len(rows) <= k:
                rows.append({key: [v] for key, v in row.items()})
            else:
                for key, v in row.items():
                    rows[k][key].append(v)
    return [
        {k: (v[0] if k == "name" else statistics.median(v)) for k, v in row.items()} for row in rows
    ]


def _model(plan: Any) -> list[dict[str, float]]:
    """The estimate's calls in launch order: clock at the launch (compute only), compute since
    the previous launch, seconds, overhead and exposed seconds (the walk)."""
    hw = load_profile(None)
    vals = plan._local_values()
    nodes = list(plan.local_program.graph.nodes)
    costs = []
    for n in nodes:
        f, b = node_flops(n, vals), node_bytes(n, vals)
        costs.append(hw.op_seconds(f, b) if f or b else 0.0)
    add_copies(plan, hw, nodes, vals, costs)  # as the estimate does
    calls = overlap_calls(plan, hw, nodes, costs)
    walked = exposed_times(
        costs, [c for _, c in calls], hw.overlap_efficiency, hw.overhead_efficiency
    )
    prefix = [0.0, *itertools.accumulate(costs)]
    rows = []
    for (kind, c), t in sorted(zip(calls, walked, strict=True), key=lambda x: x[0][1].issue):
        rows.append({
            "kind": kind,
            "at": prefix[c.issue + 1],
            "before": c.compute_before if c.compute_before is not None else float("nan"),
            "seconds": c.seconds,
            "overhead": c.overhead,
            "exposed": t,
            "copies": sum(hw.copy_seconds(b) for b in _flat(call_copies(nodes[c.at], vals))),
        })  # fmt: skip
    return rows


def _flat(lists: tuple[list[int], list[int]]) -> list[int]:
    return [*lists[0], *lists[1]]


def worker(preset: str, shape: tuple[int, ...], steps: int) -> None:
    plan, one = build(preset, shape)
    one()
    one()
    mine = _calls(_step_ranges(one, steps))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if pd.is_main_process():
        print("RESULT " + json.dumps({"ranks": every, "model": _model(plan)}))


def copies_worker(configs: list[str], rounds: int, profile: Path | None = None) -> None:
    """Every rank at once, the configurations in turn ``rounds`` times: each mesh op of the
    step's per-device program run by ``runtime.dist_ops`` with Gloo stubbed out (its packing
    and unpacking alone, ``op_workloads.gloo_stubbed``) on zeros of its operands, the mean of
    5 runs; rank 0 prints each op's median beside its modelled copies (``cost.copies``, priced
    by ``cpu-gloo`` or the profile of ``profile``)."""
    from bench_estimate import CFG, _batch, _loss
    from op_workloads import gloo_stubbed

    import partita
    from partita.models import GPT
    from partita.runtime import comm
    from partita.values.mesh import Mesh

    pd.initialize()
    hw, committed = load_profile(profile), load_profile(None)
    work = []
    for config in configs:
        preset, shape_text = config.split("/")
        shape = tuple(int(s) for s in shape_text.strip("()").split(",") if s.strip())
        torch.manual_seed(0)
        model = GPT(CFG)
        mesh = Mesh.create(shape, ("data", "model")[: len(shape)])
        opt = torch.optim.AdamW(model.parameters())
        plan = partita.train_step(model, _loss, opt, mesh=mesh, param_specs=preset).lower(_batch())
        vals = plan._local_values()
        for node in plan.local_program.graph.nodes:
            schema = getattr(node.target, "_schema", None)
            kind = schema.name.split("::")[-1] if schema is not None else ""
            if kind not in ("all_gather", "all_gather_bucket", "all_reduce_bucket",
                            "reduce_scatter", "reduce_scatter_bucket", "all_to_all"):  # fmt: skip
                continue
            sizes = _flat(call_copies(node, vals))
            n = int(node.args[-1])
            group = comm.Group(None, tuple(range(n)), tuple(range(n)), 0)
            args = [_zeros(a, vals) for a in node.args[:-1]]
            model_s = [sum(h.copy_seconds(b) for b in sizes) for h in (hw, committed)]
            work.append((config, node.name, kind, group, args, model_s, sum(sizes)))
    times: dict[tuple[str, str], list[float]] = {(w[0], w[1]): [] for w in work}
    for _ in range(rounds):
        for config, name, kind, group, args, _m, _b in work:
            dist.barrier()
            with gloo_stubbed():
                start = time.perf_counter()
                for _ in range(5):
                    dist_ops.run(getattr(dist_ops, kind)(group, *args, name))
                times[config, name].append((time.perf_counter() - start) / 5)
    busy = _busy(work, rounds)
    if pd.is_main_process():
        rows = [
            (c, nm, statistics.median(times[c, nm]), t, m, b)
            for (c, nm, _k, _g, _a, m, b), t in zip(work, busy, strict=True)
        ]
        print("RESULT " + json.dumps(rows))


def _busy(work: list[Any], rounds: int) -> list[float]:
    """Seconds of each op of ``work`` as the fit times its workloads (``bench_collectives``'
    ``_ops``): repeated over ~0.1 s with every rank doing the same, the ops in turn, median
    over ``rounds``, max over ranks; the processes share the cores throughout, as in a step."""
    from bench_collectives import _interleaved, _max_over_ranks, _repeated
    from op_workloads import gloo_stubbed

    fns, reps = [], []
    with gloo_stubbed():
        for _config, name, kind, group, args, _m, _b in work:

            def call(kind: str = kind, group: Any = group, args: Any = args, name: str = name):
                return dist_ops.run(getattr(dist_ops, kind)(group, *args, name))

            call()
            start = time.perf_counter()
            call()
            n = max(1, int(0.1 / max(time.perf_counter() - start, 1e-6)))
            reps.append(int(_max_over_ranks(n)))
            fns.append(_repeated(call, [], reps[-1]))
        seconds = _interleaved(fns, rounds)
    return [t / n for t, n in zip(seconds, reps, strict=True)]


def _zeros(a: Any, vals: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        v = vals[a]
        return torch.zeros(v.shape, dtype=v.dtype).as_strided(v.shape, v.stride())
    if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.fx.Node):
        return [_zeros(x, vals) for x in a]
    return a


def _print_copies(rows: list[list[Any]]) -> None:
    """Each op's copies measured (``burst``: 5 calls right after a barrier, rank 0, shorter
    than a scheduler's slice, so a core of its own; ``busy``: every rank repeating it, as the
    fit measures) beside their modelled time (the profile's; with ``--profile``, the committed
    ``cpu-gloo``'s after it), then the totals per step."""
    totals: dict[str, list[float]] = {}
    for config, name, burst, busy, (model_s, committed), nbytes in rows:
        print(f"  {config:<14} {name:<34} {nbytes / 1e6:6.2f} MB  burst {burst * 1e3:6.2f} ms  "
              f"busy {busy * 1e3:6.2f} ms  modelled {model_s * 1e3:5.2f} ms "
              f"({committed * 1e3:5.2f} committed)")  # fmt: skip
        t = totals.setdefault(config, [0.0] * 5)
        for i, x in enumerate((burst, busy, model_s, committed, nbytes)):
            t[i] += x
    for config, (burst, busy, model_s, committed, nbytes) in totals.items():
        print(f"{config}: the runtime's copies of a step, {nbytes / 1e6:.1f} MB: measured "
              f"{busy * 1e3:.2f} ms busy ({burst * 1e3:.2f} ms in bursts), modelled "
              f"{model_s * 1e3:.2f} ms (committed profile: {committed * 1e3:.2f} ms)")  # fmt: skip


def _print(name: str, result: dict[str, Any]) -> None:
    ranks, model = result["ranks"], result["model"]
    zero = ranks[0]
    step = zero[0]["step"] if zero else 0.0
    print(f"{name}: rank 0's step {step * 1e3:.1f} ms (profiled), {len(zero)} calls measured, "
          f"{len(model)} modelled; the runtime's copies inside the calls' ranges "
          f"{sum(m['copies'] for m in zero) * 1e3:.2f} ms (modelled "
          f"{sum(c['copies'] for c in model) * 1e3:.2f} ms)")  # fmt: skip
    print(f"  {'call (measured)':<44} {'copies':>6} {'start':>7} {'before':>7} "
          f"{'wait/call':>9} {'min':>6} {'max':>6} | {'model':<14} {'at':>7} {'before':>7} "
          f"{'secs':>6} {'ovh':>5} {'exp':>6}")  # fmt: skip
    for k in range(max(len(zero), len(model))):
        m = zero[k] if k < len(zero) else None
        left = " " * 100
        if m is not None:
            waits = [r[k]["wait"] for r in ranks if k < len(r)]
            left = (f"  {m['name'][:44]:<44} {m['copies'] * 1e3:6.2f} {m['start'] * 1e3:7.2f} "
                    f"{m['before'] * 1e3:7.2f} {m['wait'] * 1e3:9.2f} {min(waits) * 1e3:6.2f} "
                    f"{max(waits) * 1e3:6.2f}")  # fmt: skip
        right = ""
        if k < len(model):
            c = model[k]
            right = (f" | {c['kind']:<14} {c['at'] * 1e3:7.2f} {c['before'] * 1e3:7.2f} "
                     f"{c['seconds'] * 1e3:6.2f} {c['overhead'] * 1e3:5.2f} "
                     f"{c['exposed'] * 1e3:6.2f}")  # fmt: skip
        print(left + right)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=["dp/(4,)", "fsdp/(4,)"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sync", action="store_true", help="PARTITA_OVERLAP_BYTES=0")
    parser.add_argument(
        "--copies",
        type=int,
        metavar="ROUNDS",
        help="time the runtime's copies alone (Gloo stubbed out), 4 processes at once",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="with --copies: price the copies by this bench_collectives.py --write file",
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--copies-worker", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.copies_worker:
        copies_worker(ns.configs, ns.copies_worker, ns.profile)
        return
    if ns.worker:
        worker(ns.worker[0], tuple(int(s) for s in ns.worker[1].split("x")), ns.steps)
        return
    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(_load())
    if ns.sync:
        os.environ["PARTITA_OVERLAP_BYTES"] = "0"
    if ns.copies:
        argv = [__file__, *ns.configs, "--copies-worker", str(ns.copies)]
        argv += ["--profile", str(ns.profile.resolve())] if ns.profile else []
        rows = spawn_result(argv, "copies", timeout=1800)
        _print_copies(rows or [])  # type: ignore[arg-type]
        print(_load())
        return
    for config in ns.configs:
        preset, shape = config.split("/")
        dims = "x".join(s for s in shape.strip("()").split(",") if s.strip())
        argv = [__file__, "--worker", preset, dims, "--steps", str(ns.steps)]
        result = spawn_result(argv, config, timeout=1800)
        if result is not None:
            _print(config, result)
    print(_load())


if __name__ == "__main__":
    main()
