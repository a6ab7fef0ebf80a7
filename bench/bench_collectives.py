"""Fit the ``cpu-gloo`` hardware profile of ``partita.cost``: time Gloo collectives, matmuls,
memory copies and tiny ops on 4 processes of this machine, fit the alpha-beta model, print it.

Run: ``.venv/bin/python bench/bench_collectives.py [--repeat 15] [--world 4] [--write fit.json]``
(``--ops``: the local-op terms alone; ``--pairs``: groups of 2 against the profile;
``--scales``: the collectives over all processes alone, against the profile;
``--overlap-only``: ``overlap_efficiency`` alone)

Each of ``--world`` processes (127.0.0.1, ``OMP_NUM_THREADS=1``, started by
``partita.runtime.launch.spawn``, as the distributed tests and benches run) times, all at once:

* all_gather, all_reduce, reduce_scatter and all_to_all over the whole group (reduce_scatter as
  the runtime runs it, ``runtime.dist_ops``: on Gloo an all_to_all and the local sum), for
  reported sizes (the Plan's convention: output bytes, input bytes for reduce_scatter) from 4
  KiB to 16 MiB, the median of ``--repeat`` calls after a barrier (max over ranks);
* the matmuls of GPT-S's layers at their per-device sizes, forward and backward (FLOP/s per
  process while every process computes, over windows of ~0.3 s);
* GPT-S's memory-bound workloads (``op_workloads.py``: its AdamW update at 1, 1/2, 1/4 and
  1/8 of its parameters, a layer's activations' elementwise ops and their backwards at 256,
  512 and 1024 rows, bias-sized updates), traced to aten ops, and the runtime's own copies
  around GPT-S's bucketed collectives (``op_workloads.copy_workloads``: packing and unpacking
  by ``runtime.dist_ops`` with Gloo stubbed out), run on all processes at once, in turn:
  ``op_overhead``, ``memory_bandwidth`` and the cache term fitted to the model's own count of
  their ops and bytes (``op_workloads.fit_ops``), ``copy_bandwidth`` to the copies' count
  (``op_workloads.fit_copies``);
* elementwise ops (add, mul, gelu, exp) of GPT-S's activation sizes repeated on the same few
  tensors (in cache: printed for comparison, no longer the profile's bandwidth);
* a tiny ``add`` (``launch``, the floor of one op, all processes at once);
* the wait a collective call adds when it interrupts compute (``call_overhead``): rounds of
  GPT-S matmuls each followed by a 4-byte all_reduce, against the same rounds without it and
  the all_reduces alone; the same after ~0.3 ms of short ops gives ``call_window``
  (:func:`call_window`).

The collective times are fitted by least squares to ``ring_steps(kind, n) * latency +
wire_bytes(kind, bytes, n) / bandwidth``, the model of ``partita.cost.model``, then each kind
gets the median ratio of its measured times to that fit (``collective_scale``); the table shows
each measurement beside the fitted model's, and the last lines are the profile to paste into
``PROFILES["cpu-gloo"]`` in ``src/partita/cost/model.py`` (``--write FILE`` also writes them
as JSON, which ``bench_estimate.py --profile FILE`` estimates with). The processes share the
machine's cores, so the fitted numbers are what one process of a 4-process job gets, not what
one core can do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from partita.cost.model import KINDS, PROFILES, op_time, ring_steps, wire_bytes
from partita.runtime import dist_ops
from partita.runtime.comm import group_of

SIZES = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 16 << 20]
TIMED = [k for k in KINDS if k != "collective_permute"]


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _collective(kind: str, nbytes: int, n: int, group=None):
    numel = nbytes // 4
    if kind == "all_gather":
        out = torch.empty(numel)
        x = torch.ones(numel // n)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if kind == "reduce_scatter":  # as the runtime runs it (on Gloo an all_to_all and a sum)
        x = torch.ones(numel)
        g = group_of(group or dist.group.WORLD)
        return lambda: dist_ops.run(dist_ops.reduce_scatter(g, x, 0, "sum", ["fit"], ""))
    if kind == "all_reduce":
        x = torch.ones(numel)
        return lambda: dist.all_reduce(x, group=group)
    x = torch.ones(numel)
    out = torch.empty(numel)
    return lambda: dist.all_to_all_single(out, x, group=group)


#: (rows, inner, cols) of GPT-S's matmuls on one device of a 4-way batch split: 4 x 128 rows,
#: width 256; qkv, attention projection, MLP up and down, the head (vocabulary 512).
GPT_MATMULS = [
    (512, 256, 768),
    (512, 256, 256),
    (512, 256, 1024),
    (512, 1024, 256),
    (512, 256, 512),
]


def _gpt_matmuls() -> list[tuple[object, float]]:
    """``(call, flops)`` of each forward matmul and its two backward ones."""
    calls: list[tuple[object, float]] = []
    for m, k, n in GPT_MATMULS:
        a, b, g = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
        flops = 2.0 * m * k * n
        calls += [
            (lambda a=a, b=b: torch.mm(a, b), flops),
            (lambda g=g, b=b: torch.mm(g, b.t()), flops),
            (lambda a=a, g=g: torch.mm(a.t(), g), flops),
        ]
    return calls


def _gpt_elementwise() -> list[tuple[object, float]]:
    """``(call, bytes read and written)`` of elementwise ops of GPT-S's sizes (an MLP
    activation of 512 x 1024, a residual of 512 x 256): what the roofline's memory term is."""
    calls: list[tuple[object, float]] = []
    for shape in ((512, 1024), (512, 256), (4, 8, 128, 128)):
        x, y = torch.randn(shape), torch.randn(shape)
        nbytes = x.numel() * 4.0
        calls += [
            (lambda x=x, y=y: torch.add(x, y), 3 * nbytes),
            (lambda x=x, y=y: torch.mul(x, y), 3 * nbytes),
            (lambda x=x: torch.nn.functional.gelu(x), 2 * nbytes),
            (lambda x=x: torch.exp(x), 2 * nbytes),
        ]
    return calls


def _concurrent(calls: list[tuple[object, float]], repeat: int) -> tuple[float, float]:
    """``(work, seconds)`` of running every call of ``calls`` once, median over ``repeat``
    rounds that all processes start together (max over ranks); a round is repeated until it
    lasts ~0.3 s, so the processes compete for the cores throughout."""
    work = sum(w for _, w in calls)

    def once() -> None:
        for fn, _ in calls:
            fn()  # type: ignore[operator]

    once()
    t = time.perf_counter()
    once()
    times = max(1, int(0.3 / max(time.perf_counter() - t, 1e-6)))

    def rounds() -> None:
        for _ in range(times):
            once()

    return work, _median_time(rounds, repeat) / times


def _call_overhead(repeat: int, calls: int = 20, group=None, before: str = "matmuls") -> float:
    """Seconds a collective call costs beyond its bytes when it interrupts compute, as in a
    step: ``calls`` rounds of ``before`` each followed by a 4-byte all_reduce of the group,
    against the same rounds with no all_reduce and the all_reduces alone (all processes at
    once, the three in turn). While a process computes its peers may hold the cores, so the
    call waits for them. ``before``: ``"matmuls"`` (~5 ms of GPT-S matmuls), ``"short"``
    (~0.3 ms of elementwise ops on a 256 KB tensor, the few ops between a gradient's
    reduction and the next call of a step) or ``"call"`` (a 1 MiB reduce_scatter of the
    group: the all_reduce right behind another call)."""
    mms = _gpt_matmuls()
    one = torch.zeros(1)
    x = torch.randn(64 << 10)
    n = dist.get_world_size(group)
    scatter = _collective("reduce_scatter", 1 << 20, n, group)

    def first() -> None:
        if before == "matmuls":
            for fn, _ in mms[:6]:
                fn()  # type: ignore[operator]
        elif before == "short":
            for _ in range(10):
                x.mul(1.0001).add_(1e-6)
        else:
            scatter()

    def rounds(sync: bool) -> None:
        for _ in range(calls):
            first()
            if sync:
                dist.all_reduce(one, group=group)

    def alone() -> None:
        for _ in range(calls):
            dist.all_reduce(one, group=group)

    rounds(True)
    with_calls, without, tiny = _interleaved(
        [lambda: rounds(True), lambda: rounds(False), alone], repeat
    )
    return max(0.0, with_calls - without - tiny) / calls, without / calls


def call_window(long: tuple[float, float], short: tuple[float, float]) -> float:
    """``call_window`` of the profile from two ``(overhead, compute before)`` measurements of
    :func:`_call_overhead`: after ~5 ms of matmuls (the whole ``call_overhead``) and after
    ~0.3 ms of short ops. The model's overhead grows linearly with the compute since the
    previous call up to ``call_overhead`` at ``call_window`` seconds, so the window is where
    the line through the short measurement reaches the long one (at most the long compute)."""
    full, compute_long = long
    part, compute_short = short
    if full <= 0:
        return 0.0
    if part <= 0:
        return compute_long
    return min(compute_long, compute_short * full / part)


#: A collective whose time is almost all its call's overhead (``overhead_efficiency``).
TINY = 4 << 10

#: (kind, reported bytes) of the collectives the overlap fit launches beside compute: the
#: sizes of GPT-S's FSDP buckets (one layer's parameters, ~3.5 MiB) and a smaller one.
OVERLAP_CALLS = [
    (kind, size)
    for size in (4 << 20, 1 << 20)
    for kind in ("all_gather", "reduce_scatter", "all_reduce")
] + [("all_reduce", TINY), ("reduce_scatter", TINY)]


class _Started:
    """A runtime mesh op launched (``runtime.dist_ops``), finished by :meth:`wait`."""

    def __init__(self, op) -> None:
        self.op = op

    def wait(self) -> None:
        dist_ops.run(self.op)


def _async(kind: str, nbytes: int, n: int):
    """Launch ``kind`` of ``nbytes`` with ``async_op=True``; returns its work handle."""
    numel = nbytes // 4
    if kind == "all_gather":
        out, x = torch.empty(numel), torch.ones(numel // n)
        return lambda: dist.all_gather_into_tensor(out, x, async_op=True)
    if kind == "reduce_scatter":  # launched now, waited for and summed at ``wait``
        x, g = torch.ones(numel), group_of(dist.group.WORLD)

        def launch() -> _Started:
            op = dist_ops.reduce_scatter(g, x, 0, "sum", ["fit"], "")
            next(op)
            return _Started(op)

        return launch
    x = torch.ones(numel)
    return lambda: dist.all_reduce(x, async_op=True)


def _overlap_efficiency(repeat: int, n: int) -> list[tuple[str, int, float, float, float]]:
    """``(kind, bytes, compute, synchronous, overlapped)`` seconds for each of
    :data:`OVERLAP_CALLS`: GPT-S matmuls alone, then followed by the collective (as a step
    without overlap runs it), then with the collective launched before them and waited for
    after (as the runtime's overlap schedule runs it), all processes at once. The fraction of
    the collective's time hidden is ``(synchronous - overlapped) / min(compute, synchronous -
    compute)`` (:func:`efficiency`)."""
    mms = _gpt_matmuls()

    def compute() -> None:
        for fn, _ in mms:
            fn()  # type: ignore[operator]

    out = []
    for kind, nbytes in OVERLAP_CALLS:
        call, launch = _collective(kind, nbytes, n), _async(kind, nbytes, n)

        def sync(call=call) -> None:
            compute()
            call()

        def overlapped(launch=launch) -> None:
            work = launch()
            compute()
            work.wait()

        sync()
        overlapped()
        c, t_sync, t_ov = _interleaved([compute, sync, overlapped], repeat)
        out.append((kind, nbytes, c, t_sync, t_ov))
    return out


def _interleaved(fns: list, repeat: int) -> list[float]:
    """The median time of each of ``fns`` over ``repeat`` rounds that run each once, in turn
    (max over ranks): a change of the machine's load hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times, strict=True):
            dist.barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    worst = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def efficiency(rows: list[tuple[str, int, float, float, float]], tiny: bool = False) -> float:
    """The median over ``rows`` of the hidden fraction (:func:`_overlap_efficiency`), in
    [0, 1]: ``overlap_efficiency`` of the profile over the rows of 1 MiB and more; with
    ``tiny``, ``overhead_efficiency`` over the rows of :data:`TINY` bytes (a call that is
    nearly all overhead: its wait for peers)."""
    fractions = [
        (sync - ov) / max(min(c, sync - c), 1e-9)
        for _, size, c, sync, ov in rows
        if (size <= TINY) == tiny
    ]
    if not fractions:
        return float("nan")
    return min(1.0, max(0.0, float(np.median(fractions))))


#: Reported sizes for the timings over groups of 2: GPT-S's tensor-parallel collectives on a
#: (2, 2) mesh are 0.1 - 1.5 MB each, fsdp+tp's layer-norm gradients over ``data`` 1.5 - 2 KB.
PAIR_SIZES = [2 << 10, 64 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]


def _rows(repeat: int, n: int, sizes: list[int], group=None) -> list[tuple[str, int, float]]:
    """``(kind, bytes, seconds)`` of every timed kind at every size over ``group``."""
    rows = []
    for kind in TIMED:
        for size in sizes:
            fn = _collective(kind, size, n, group)
            fn()
            rows.append((kind, size, _median_time(fn, repeat)))
    return rows


def _pairs(repeat: int) -> dict:
    """Every kind over groups of 2 processes, both pairs of a 4-process job at once (as on a
    (2, 2) mesh): ``rows`` of ``(kind, bytes, seconds)`` and the ``call`` overhead."""
    world = dist.get_world_size()
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = groups[dist.get_rank() // 2]
    rows = _rows(repeat, 2, PAIR_SIZES, group)
    call = {b: _call_overhead(repeat, group=group, before=b) for b in ("matmuls", "short", "call")}
    return {"n": 2, "rows": rows, "call": call["matmuls"][0], "calls": call}


def _ops(repeat: int) -> tuple[list[dict], float]:
    """Each memory-bound workload of ``op_workloads`` (GPT-S's optimizer update and layer
    activations, traced to aten ops): the model's ``ops`` / ``bytes`` / ``flops`` of it and
    the measured ``seconds`` of one run with every process running it at once; and the
    FLOP/s of GPT-S's matmuls timed in the same rounds (``peak_flops``: the two rates under
    the same load, so their ratio, which decides how a step's time splits, holds)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from op_workloads import copy_workloads, traced, workloads

    every = [(name, *traced(fn, inputs), inputs) for name, fn, inputs in workloads()]
    every += [(name, run, counts, []) for name, run, counts in copy_workloads()]
    runs, out = [], []
    for name, fn, counts, inputs in every:
        fn(*inputs)
        t = time.perf_counter()
        fn(*inputs)
        times = max(1, int(0.1 / max(time.perf_counter() - t, 1e-6)))
        times = int(_max_over_ranks(times))  # every rank runs as many
        runs.append(_repeated(fn, inputs, times))
        out.append({"name": name, **counts, "times": times})
    mms = _gpt_matmuls()
    mm_flops = sum(f for _, f in mms)

    def matmuls() -> None:
        for fn, _ in mms:
            fn()  # type: ignore[operator]

    # in turn, round after round: a change of the machine's load hits every workload alike
    *seconds, mm_seconds = _interleaved([*runs, matmuls], repeat)
    for row, t in zip(out, seconds, strict=True):
        row["seconds"] = t / row.pop("times")
    return out, mm_flops / mm_seconds


def _repeated(fn, inputs: list, times: int):  # type: ignore[no-untyped-def]
    """A call running ``fn(*inputs)`` ``times`` times, each result dropped before the next
    run (as a step frees a value after its last use: its memory is reused, not fresh)."""

    def run() -> None:
        for _ in range(times):
            fn(*inputs)

    return run


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(
    repeat: int,
    overlap_only: bool = False,
    pairs: bool = False,
    ops: bool = False,
    scales: bool = False,
) -> None:
    from partita import distributed as pd

    pd.initialize()
    n = dist.get_world_size()
    if ops:
        rows, flops = _ops(repeat)
        result = {"n": n, "ops": rows, "flops": flops}
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result))
        dist.destroy_process_group()
        return
    if pairs or scales:
        result = _pairs(repeat) if pairs else {"n": n, "rows": _rows(repeat, n, SIZES)}
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result))
        dist.destroy_process_group()
        return
    if overlap_only:
        ov = _overlap_efficiency(repeat, n)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"n": n, "overlap": ov}))
        dist.destroy_process_group()
        return
    rows = _rows(repeat, n, SIZES)
    # Compute, as a step of GPT-S computes (4 processes on the cores at once): the matmuls
    # of its layers at their per-device sizes (rows = batch 4 x sequence 128), timed over
    # a window of ~0.3 s so that every process computes through all of it.
    mm_flops, mm_time = _concurrent(_gpt_matmuls(), repeat)
    ew_bytes, ew_time = _concurrent(_gpt_elementwise(), repeat)
    tiny = torch.ones(4)
    launch = _concurrent([(lambda: tiny.add(1.0), 0.0)] * 1000, repeat)[1] / 1000
    call, short = _call_overhead(repeat), _call_overhead(repeat, before="short")
    ov = _overlap_efficiency(repeat, n)
    ops, ops_flops = _ops(repeat)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "n": n, "rows": rows, "flops": ops_flops, "flops_alone": mm_flops / mm_time,
            "bandwidth": ew_bytes / ew_time, "launch": launch, "call": call[0], "overlap": ov,
            "window": call_window(call, short), "short": short,
            "ops": ops,
        }))  # fmt: skip
    dist.destroy_process_group()


def fit(rows: list[tuple[str, int, float]], n: int) -> tuple[float, float, dict[str, float]]:
    """``(latency, bandwidth, scale)`` minimising the squared relative error over ``rows``;
    ``scale[kind]`` is the median measured/model ratio of each kind under that fit (Gloo does
    not run every kind as a ring: its reduce_scatter is slower than the ring model says)."""
    steps = np.array([ring_steps(k, n) for k, _, _ in rows], dtype=float)
    wire = np.array([wire_bytes(k, s, n) for k, s, _ in rows], dtype=float)
    t = np.array([r[2] for r in rows])
    # relative error: divide each equation by its measured time
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([steps / t, wire / t], 1), np.ones_like(t))
    alpha, bandwidth = max(float(alpha), 0.0), 1.0 / float(beta)
    model = steps * alpha + wire / bandwidth
    scale = {
        kind: float(
            np.median([ti / mi for (k, _, ti), mi in zip(rows, model, strict=True) if k == kind])
        )
        for kind in dict.fromkeys(k for k, _, _ in rows)
    }
    return alpha, bandwidth, scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument(
        "--overlap-only", action="store_true", help="fit overlap_efficiency alone (faster)"
    )
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="time every kind over groups of 2 (two pairs at once), against the profile",
    )
    parser.add_argument(
        "--scales",
        action="store_true",
        help="time every kind over all processes alone: its scale on the profile's link",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="fit op_overhead and memory_bandwidth alone, on GPT-S's memory-bound workloads",
    )
    parser.add_argument(
        "--write", type=Path, help="also write the fitted profile's figures to this JSON file"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.repeat, ns.overlap_only, ns.pairs, ns.ops, ns.scales)
        return
    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    flags = {
        "--overlap-only": ns.overlap_only,
        "--pairs": ns.pairs,
        "--ops": ns.ops,
        "--scales": ns.scales,
    }
    mode = next((flag for flag, on in flags.items() if on), "")
    r = measure(ns.repeat, ns.world, mode)
    if ns.pairs or ns.scales:
        _print_scales(r)
        if ns.pairs:
            _print_calls(r)
        return
    if ns.ops:
        _print_ops(r["ops"], r["flops"])
        print(f"    peak_flops={r['flops']:.3g},  # GPT-S matmuls in the same rounds")
        print(f"# {_load()}")
        return
    if ns.overlap_only:
        _print_overlap(r)
        return
    report(r, ns.repeat, ns.write)


def measure(repeat: int, world: int = 4, mode: str = "") -> dict:
    """The workers' measurements (rank 0's ``RESULT``): every timing of the fit, or those of
    ``mode`` (``--ops``, ``--pairs``, ``--scales``, ``--overlap-only``) alone; ``world``
    processes of this machine (127.0.0.1, ``OMP_NUM_THREADS=1``) at once. Exits when a worker
    fails."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rank_nodes import rank_result

    one, five, _ = os.getloadavg()
    print(f"# {world} Gloo processes, OMP_NUM_THREADS=1, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, load average {one:.2f} {five:.2f}")  # fmt: skip
    argv = [__file__, "--worker", "--repeat", str(repeat), *([mode] if mode else [])]
    return rank_result(argv, world, timeout=900)


def _print_overlap(r: dict) -> tuple[float, float]:
    """The overlap timings beside their hidden fractions; ``(overlap_efficiency,
    overhead_efficiency)``."""
    print(f"{'beside compute':<15} {'bytes':>9} {'compute':>10} {'then call':>10} "
          f"{'overlapped':>10} {'hidden':>6}")  # fmt: skip
    for kind, size, c, sync, ov in r["overlap"]:
        hidden = (sync - ov) / max(min(c, sync - c), 1e-9)
        print(f"{kind:<15} {size:>9} {c * 1e3:8.2f}ms {sync * 1e3:8.2f}ms {ov * 1e3:8.2f}ms "
              f"{hidden:6.2f}")  # fmt: skip
    eta = efficiency([tuple(x) for x in r["overlap"]])
    print(f"overlap_efficiency (median hidden fraction of 1 and 4 MiB, in [0, 1]): {eta:.2f}")
    eta_call = efficiency([tuple(x) for x in r["overlap"]], tiny=True)
    print(f"overhead_efficiency (the same of {TINY} bytes: a call's wait for peers): "
          f"{eta_call:.2f}")  # fmt: skip
    return eta, eta_call


def fit_profile(repeat: int, world: int = 4, write: Path | None = None) -> dict:
    """Measure and fit every figure of the ``cpu-gloo`` profile on this machine, print the
    fit beside the measurements; its figures as ``--write`` writes them (``write``: also to
    that file). ``bench_estimate.py --fit`` checks the estimate with it."""
    return report(measure(repeat, world), repeat, write)


def report(r: dict, repeat: int, write: Path | None = None) -> dict:
    """Fit the profile to the full run's measurements ``r``, print it; its figures."""
    eta, eta_call = _print_overlap(r)
    rows = [tuple(x) for x in r["rows"]]
    latency, bandwidth, scale = fit(rows, r["n"])
    print(f"{'collective':<15} {'bytes':>9} {'measured':>10} {'model':>10} {'ratio':>6}")
    for kind, size, t in rows:
        ring = ring_steps(kind, r["n"]) * latency + wire_bytes(kind, size, r["n"]) / bandwidth
        model = ring * scale[kind]
        print(f"{kind:<15} {size:>9} {t * 1e3:8.3f}ms {model * 1e3:8.3f}ms {model / t:6.2f}")
    ops = _print_ops(r["ops"], r["flops"])
    print(f"GPT-S matmuls: {r['flops'] / 1e9:.2f} GFLOP/s per process in turn with the "
          f"memory-bound workloads ({r['flops_alone'] / 1e9:.2f} alone, over 0.3 s windows); "
          f"elementwise (the same "
          f"few tensors over and over, in cache): {r['bandwidth'] / 1e9:.2f} GB/s per process; "
          f"one tiny op: {r['launch'] * 1e6:.2f} us")  # fmt: skip
    print(f"a call between compute: {r['call'] * 1e3:.2f} ms more than the call alone; "
          f"after {r['short'][1] * 1e3:.2f} ms of short ops {r['short'][0] * 1e3:.2f} ms "
          f"more: the whole overhead at {r['window'] * 1e3:.2f} ms of compute")  # fmt: skip
    print(f"fit: latency {latency * 1e6:.1f} us per ring step, bandwidth "
          f"{bandwidth / 1e9:.3f} GB/s")  # fmt: skip
    fields = {
        "peak_flops": r["flops"],
        "memory_bandwidth": ops["memory_bandwidth"],
        "intra_host": {"bandwidth": bandwidth, "latency": latency},
        "inter_host": {"bandwidth": bandwidth, "latency": latency},
        "launch": r["launch"],
        "call_overhead": r["call"],
        "call_window": r["window"],
        "collective_scale": scale,
        "overlap_efficiency": eta,
        "overhead_efficiency": eta_call,
        "op_overhead": ops["op_overhead"],
        "cache_bytes": ops["cache_bytes"],
        "cache_bandwidth": ops["cache_bandwidth"],
        "copy_bandwidth": ops["copy_bandwidth"],
    }
    fields = json.loads(json.dumps(fields), parse_float=lambda x: float(f"{float(x):.3g}"))
    fields["cache_bytes"] = int(ops["cache_bytes"])  # a power of 2, exact
    print("profile (paste into PROFILES['cpu-gloo'] in src/partita/cost/model.py):")
    link = fields["intra_host"]
    print(f"    peak_flops={fields['peak_flops']:.3g}, "
          f"memory_bandwidth={fields['memory_bandwidth']:.3g},")  # fmt: skip
    print(f"    intra_host=Link(bandwidth={link['bandwidth']:.3g}, latency={link['latency']:.3g}),")
    print(f"    inter_host=Link(bandwidth={link['bandwidth']:.3g}, latency={link['latency']:.3g}),")
    print(f"    launch={fields['launch']:.3g}, call_overhead={fields['call_overhead']:.3g}, "
          f"call_window={fields['call_window']:.3g},")  # fmt: skip
    print(f"    collective_scale={fields['collective_scale']},")
    print(f"    overlap_efficiency={fields['overlap_efficiency']:.2f}, "
          f"overhead_efficiency={fields['overhead_efficiency']:.2f}, "
          f"op_overhead={fields['op_overhead']:.3g},")  # fmt: skip
    print(f"    cache_bytes={fields['cache_bytes']:.0f}, "
          f"cache_bandwidth={fields['cache_bandwidth']:.3g}, "
          f"copy_bandwidth={fields['copy_bandwidth']:.3g},")  # fmt: skip
    fields["source"] = f"bench_collectives.py --repeat {repeat}, {_load()}"
    if write is not None:
        write.write_text(json.dumps(fields, indent=1))
        print(f"# wrote {write} (bench_estimate.py --profile {write} estimates with it)")
    print(f"# {_load()}")
    return fields


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def _print_ops(rows: list[dict], peak: float) -> dict[str, float]:
    """Each memory-bound workload measured beside the fitted local-op terms
    (``op_workloads.fit_ops``) and beside the ``cpu-gloo`` profile's time of its ops (its own
    ``op_time``); the fitted terms."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from op_workloads import fit_copies, fit_ops

    copies = [w for w in rows if w["name"].startswith("copies/")]
    fitted = fit_ops([w for w in rows if w not in copies])
    fitted["copy_bandwidth"] = fit_copies(copies, fitted["op_overhead"]) if copies else 0.0
    names = ("op_overhead", "cache_bytes", "cache_bandwidth", "memory_bandwidth")
    terms = {k: fitted[k] for k in (*names, "copy_bandwidth")}
    hw = PROFILES["cpu-gloo"]
    new = dataclasses.replace(hw, **terms)
    print(f"{'memory-bound':<15} {'ops':>5} {'MB':>8} {'measured':>10} {'fit':>9} {'ratio':>6} "
          f"{'profile':>9} {'ratio':>6}  GB/s")  # fmt: skip
    for w in rows:
        n = len(w["each"])
        flops = w["flops"] / n  # every op's FLOPs are far below its bytes' time
        copy = w in copies  # priced as the estimate prices the runtime's copies
        model = sum(new.copy_seconds(b) if copy else op_time(flops, b, new) for b in w["each"])
        prof = sum(hw.copy_seconds(b) if copy else op_time(flops, b, hw) for b in w["each"])
        print(f"{w['name']:<15} {w['ops']:5.0f} {w['bytes'] / 1e6:8.1f} "
              f"{w['seconds'] * 1e3:8.2f}ms {model * 1e3:7.2f}ms {model / w['seconds']:6.2f} "
              f"{prof * 1e3:7.2f}ms {prof / w['seconds']:6.2f}  "
              f"{w['bytes'] / w['seconds'] / 1e9:5.2f}")  # fmt: skip
    cache = (
        f"the first {fitted['cache_bytes'] / 2**20:.3g} MiB of an op at "
        f"{fitted['cache_bandwidth'] / 1e9:.3g} GB/s, the rest"
        if fitted["cache_bytes"]
        else "every byte (no cache term)"
    )
    print(f"memory-bound ops: {fitted['op_overhead'] * 1e6:.2f} us per op; {cache} at "
          f"{fitted['memory_bandwidth'] / 1e9:.3g} GB/s (rms relative error {fitted['error']:.2f}; "
          f"one bandwidth for all: {fitted['error_flat']:.2f})")  # fmt: skip
    if copies:  # the copies' own rate against the roofline of the other workloads
        together = fit_ops(rows)
        one = dataclasses.replace(hw, **{k: together[k] for k in names})
        priced = [
            sum(h.copy_seconds(b) for w in copies for b in w["each"])
            for h in (new, dataclasses.replace(new, copy_bandwidth=0.0), one)
        ]
        print(f"the runtime's copies (copies/ rows): measured "
              f"{sum(w['seconds'] for w in copies) * 1e3:.2f} ms; priced at copy_bandwidth "
              f"{fitted['copy_bandwidth'] / 1e9:.3g} GB/s {priced[0] * 1e3:.2f} ms, by the "
              f"other workloads' roofline {priced[1] * 1e3:.2f} ms, by one roofline fitted to "
              f"all rows {priced[2] * 1e3:.2f} ms")  # fmt: skip
    print("local-op terms (paste into PROFILES['cpu-gloo']):")
    print(
        f"    memory_bandwidth={fitted['memory_bandwidth']:.3g}, "
        f"op_overhead={fitted['op_overhead']:.3g},"
    )
    print(
        f"    cache_bytes={fitted['cache_bytes']:.0f}, "
        f"cache_bandwidth={fitted['cache_bandwidth']:.3g}, "
        f"copy_bandwidth={fitted['copy_bandwidth']:.3g},"
    )
    return fitted


def _print_scales(r: dict) -> None:
    """Each timing over groups of ``r["n"]`` beside the ``cpu-gloo`` profile's time for it, and
    the per-kind scale on the profile's link that fits them (median measured/ring ratio)."""
    from partita.cost.model import PROFILES, collective_time

    hw, n = PROFILES["cpu-gloo"], r["n"]
    label = f"groups of {n}"
    print(f"{label:<15} {'bytes':>9} {'measured':>10} {'profile':>10} {'ring':>9} {'ratio':>6}")
    ratios: dict[str, list[float]] = {}
    for kind, size, t in r["rows"]:
        ring = collective_time(kind, size, n, hw.intra_host)
        prof = ring * hw.collective_scale.get(kind, 1.0) + hw.call_overhead
        ratios.setdefault(kind, []).append(t / ring)
        print(f"{kind:<15} {size:>9} {t * 1e3:8.3f}ms {prof * 1e3:8.3f}ms "
              f"{ring * 1e3:7.3f}ms {t / ring:6.2f}")  # fmt: skip
    scale = {k: round(float(np.median(v)), 2) for k, v in ratios.items()}
    print(f"collective_scale over {label} on the profile's link: {scale}")
    print(f"the profile's collective_scale: {hw.collective_scale}")
    print(f"# {_load()}")


def _print_calls(r: dict) -> None:
    """The call overhead over groups of 2 after compute of each kind (``--pairs``)."""
    for before, (extra, compute) in r["calls"].items():
        print(f"a 4-byte all_reduce after {before} ({compute * 1e3:.2f} ms; groups of 2): "
              f"{extra * 1e3:.2f} ms more than alone")  # fmt: skip
    window = call_window(r["calls"]["matmuls"], r["calls"]["short"])
    print(f"the overhead reaches its whole ({r['call'] * 1e3:.2f} ms) at {window * 1e3:.2f} ms "
          f"of compute since the previous call (call_window)")  # fmt: skip


if __name__ == "__main__":
    main()
