"""partita.jit end to end: a GPT training step on 8 simulated devices vs the unsharded step.

Run: ``.venv/bin/python bench/bench_partition.py [--strategy fsdp 2d] [--repeat 5]``

For each strategy (FSDP on ``Mesh (8,) data``; 2-D on ``Mesh (2, 4) data x model``: Megatron
tensor parallelism on ``model`` plus the batch on ``data``) this prints

* the compile time split into its stages, timed by calling them directly as ``partita.jit``
  does: ``partita.capture.trace``, ``partita.propagate.propagate``,
  ``partita.partition.partition``;
* the median wall time (after one warm-up) of the sharded step on LocalMesh, as a ratio to the
  same step run unsharded in plain PyTorch in this process: once from plain tensors
  (``jitted(*args)``, which also scatters the inputs and wraps the outputs) and once from
  inputs that are already ShardedTensors (a training loop keeps its state sharded); the
  median process CPU time beside it (two threads busy count twice; it varies less than wall
  time with other processes' load);
* the collectives of one step by kind with per-device bytes (``plan.summary()``), against the
  floor of one all-gather plus one reduce-scatter of the parameters (FSDP);
* the largest difference of any result from the unsharded step;
* the floor: each row's CPU per step over the unsharded step's, and where that CPU goes
  (``partita.runtime.breakdown.measure``: thread CPU in collectives, local compute,
  copies/layout, the rest of the step's thread (``other``: Python, dispatch) and the other
  threads, from ``--breakdown-repeat`` plain steps and 2 instrumented ones; idle is wall time
  less the step's thread's CPU).

Reference points from issue #4: PyTorch's DTensor simulator runs this step at 6.2x unsharded;
per device and FSDP step XLA (8 fake CPU devices) moves 36 MB and PyTorch FSDP2 30 MB. Goals:
at most 1.5x unsharded, compile under 2 s, bytes at the floor.

``--profile`` adds a cProfile of the compile and of one sharded step (top functions by
cumulative time); ``--compile-only`` stops after the compile (and its profile).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from bench_local import median_times  # bench/ is on sys.path
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
from partita.capture import trace
from partita.models import GPT, GPTConfig
from partita.partition import partition
from partita.propagate import propagate
from partita.runtime.breakdown import measure
from partita.training import init_opt_state, make_train_step

Tensors = dict[str, torch.Tensor]

COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


def param_specs(params: Tensors, strategy: str, n_data: int) -> dict[str, P]:
    """FSDP: dim 0 over ``data`` where it divides; 2-D: Megatron column/row on ``model``."""
    specs = {}
    for name, p in params.items():
        spec = P()
        if strategy == "fsdp" and p.shape[0] % n_data == 0:
            spec = P("data")
        elif strategy == "2d" and name.endswith(COLUMN):
            spec = P("model")
        elif strategy == "2d" and name.endswith(ROW):
            spec = P(None, "model")
        specs[name] = spec
    return specs


def vector_step_counter(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with ``opt_state["step"]`` as a shape-[1] tensor instead of a 0-d one.

    Works around the annotation rule failing on 0-d inputs (``partita.jit`` annotates every
    tensor input; ``rules/annotate.py`` builds the einsum text `` -> `` for rank 0).
    """

    def wrapped(params: Tensors, buffers: Tensors, state: dict[str, Any], batch: Any) -> Any:
        loss, new_params, new_buffers, new_state = step(
            params, buffers, {**state, "step": state["step"].reshape(())}, batch
        )
        return loss, new_params, new_buffers, {**new_state, "step": new_state["step"].reshape(1)}

    return wrapped


def max_diff(got: Any, want: Any) -> float:
    worst = 0.0
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        g = g.full() if isinstance(g, partita.ShardedTensor) else g
        if w.numel():
            worst = max(worst, (g.double() - w.double()).abs().max().item())
    return worst


def top_costs(prof: cProfile.Profile, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def run_strategy(ns: argparse.Namespace, strategy: str, step: Any, args: tuple[Any, ...]) -> None:
    params, buffers, _, _ = args
    if strategy == "fsdp":
        mesh = Mesh.create((8,), ("data",))
    else:
        mesh = Mesh.create((2, 4), ("data", "model"))
    pspecs = param_specs(params, strategy, mesh.shape[0])
    in_specs = (
        pspecs,
        {k: P() for k in buffers},
        {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
        (P("data"), P("data")),
    )
    n_params = sum(p.numel() for p in params.values())
    param_bytes = 4 * n_params

    # Compile, stage by stage, as partita.jit does.
    prof = cProfile.Profile() if ns.profile else None
    if prof:
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    program = trace(step, args, in_specs=in_specs, mesh=mesh)
    t1, c1 = time.perf_counter(), time.process_time()
    propagate(program.graph_module, mesh)
    t2, c2 = time.perf_counter(), time.process_time()
    _, plan = partition(program.graph_module, mesh)
    t3, c3 = time.perf_counter(), time.process_time()
    if prof:
        prof.disable()

    print(f"\n== {strategy} on {mesh!r}: {len(program.graph.nodes)} nodes, "
          f"{n_params / 1e6:.2f} M parameters = {param_bytes / 1e6:.1f} MB")  # fmt: skip
    print(f"compile {t3 - t0:6.2f} s = trace {t1 - t0:.2f} + propagate {t2 - t1:.2f} "
          f"+ partition {t3 - t2:.2f}   (goal < 2 s)")  # fmt: skip
    print(f"   CPU {c3 - c0:6.2f} s = trace {c1 - c0:.2f} + propagate {c2 - c1:.2f} "
          f"+ partition {c3 - c2:.2f}   (process time: varies less under load)")  # fmt: skip
    print("collectives per step (per device):")
    print("  " + plan.summary().replace("\n", "\n  "))
    floor = 2 * param_bytes * (mesh.size - 1) / mesh.size
    print(f"bytes per device per step: {plan.bytes_per_device / 1e6:.1f} MB; FSDP floor "
          f"(all-gather + reduce-scatter of the parameters) {floor / 1e6:.1f} MB; "
          f"XLA 36 MB, FSDP2 30 MB")  # fmt: skip
    sys.stdout.flush()
    if ns.compile_only:
        if prof:
            print("-- cProfile of the compile (top 40, cumulative) --")
            print(top_costs(prof, 40))
        return
    jitted = partita.jit(step, mesh=mesh, in_specs=in_specs)
    want = step(*args)
    got = jitted(*args)  # compiles (again) and warms up
    leaves, tree = pytree.tree_flatten(args)
    spec_leaves = pytree.tree_leaves(in_specs, is_leaf=lambda x: isinstance(x, P))
    sharded = pytree.tree_unflatten(
        [partita.mark_sharding(x, mesh, s) for x, s in zip(leaves, spec_leaves, strict=True)],
        tree,
    )
    seconds = median_times(
        {
            "unsharded": lambda: step(*args),
            "sharded, plain inputs": lambda: jitted(*args),
            "sharded, ShardedTensor inputs": lambda: jitted(*sharded),
        },
        ns.repeat,
    )
    base, base_cpu = seconds["unsharded"]
    goal = 1.1 if strategy == "fsdp" else 1.2  # issue 11
    for name, (t, cpu) in seconds.items():
        print(f"{name:<31} {t:7.3f} s   ratio {t / base:5.2f}   (goal <= {goal}; DTensor 6.2)"
              f"   CPU {cpu:6.3f} s, ratio {cpu / base_cpu:5.2f}")  # fmt: skip
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    floor = measure(lambda: step(*args), ns.breakdown_repeat)
    print(f"floor and breakdown (median of {ns.breakdown_repeat} steps; 2 profiled):")
    print(f"  {'unsharded':<29} {floor.row(floor.cpu)}")
    split = measure(lambda: jitted(*sharded), ns.breakdown_repeat)
    print(f"  {'sharded, ShardedTensor inputs':<29} {split.row(floor.cpu)}")
    print(f"warnings: {len(plan.warnings)}; max |sharded - unsharded| over all results: "
          f"{max_diff(got, want):.2e}")  # fmt: skip
    if prof:
        print("-- cProfile of the compile (top 25, cumulative) --")
        print(top_costs(prof, 25))
        prof = cProfile.Profile()
        prof.enable()
        jitted(*sharded)
        prof.disable()
        print("-- cProfile of one sharded step (ShardedTensor inputs; top 25, cumulative) --")
        print(top_costs(prof, 25))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", default=["fsdp", "2d"], choices=["fsdp", "2d"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--breakdown-repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--compile-only", action="store_true", help="time (and profile) the compile only"
    )
    ns = parser.parse_args(argv)
    # The steady state of a training loop: every segment runs its traced flat graph from the
    # second call on (by default the LocalMesh traces once the eager runs cost as much as
    # the trace, which for the small segments is some dozens of calls: runtime/flat_trace.py).
    os.environ.setdefault("PARTITA_TRACE_FLAT_AT", "2")

    torch.manual_seed(0)
    cfg = GPTConfig(ns.layers, ns.heads, ns.width, ns.vocab, ns.seq)
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, ns.vocab), targets.reshape(-1))

    step = vector_step_counter(make_train_step(model, loss_fn, "adamw"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    state["step"] = state["step"].reshape(1)
    ids = torch.randint(0, ns.vocab, (ns.batch, ns.seq))
    args = (params, {}, state, (ids, torch.roll(ids, -1, dims=1)))

    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"# GPT layers={ns.layers} d_model={ns.width} heads={ns.heads} vocab={ns.vocab} "
          f"seq={ns.seq} batch={ns.batch}, AdamW; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {ns.repeat} after a warm-up")  # fmt: skip
    t0 = time.perf_counter()
    importlib.import_module("torch._dynamo")  # make_fx's first call would import it

    print(f"# importing torch._dynamo, once per process: {time.perf_counter() - t0:.2f} s "
          f"(not in the compile times below)")  # fmt: skip
    for strategy in ns.strategy:
        run_strategy(ns, strategy, step, args)


if __name__ == "__main__":
    main()
