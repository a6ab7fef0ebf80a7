"""LocalMesh cost: a data-parallel GPT training step simulated on N devices vs one unsharded step.

Run: ``.venv/bin/python bench/bench_local.py [--devices 8] [--layers 4] [--repeat 5]``

The per-device program is built by hand (no partitioner): the GPT step (forward, backward,
AdamW) traced with the local batch ``batch / devices``, with every gradient averaged by
``partita::all_reduce(g, "avg", ["data"], devices)`` before the update. The parameters and
optimizer state are replicated and passed as stride-0 ``expand`` views, so LocalMesh keeps them
(and, after the all_reduce, the whole update) unbatched. Prints the median seconds of the
unsharded eager step, the unsharded traced graph, LocalMesh.run, and a per-node vmap
interpreter (the simple strategy, for comparison), and checks that LocalMesh's new parameters
equal the unsharded step's. This script does not measure capture or partitioning.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import fx

from partita.capture import trace
from partita.ir.collectives import MESH_OPS, all_reduce
from partita.models import GPT, GPTConfig
from partita.runtime.local import LocalMesh
from partita.training import init_opt_state, make_train_step
from partita.training import optim as steps_module
from partita.values.mesh import Mesh


def median_seconds(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall seconds of each function; runs are interleaved so load drift hits all alike."""
    return {name: wall for name, (wall, _) in median_times(fns, repeat).items()}


def median_times(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, float]]:
    """Median ``(wall, process CPU)`` seconds of each function, runs interleaved (CPU time
    varies less with other processes' load)."""
    for fn in fns.values():
        fn()  # warm-up (and LocalMesh's plan)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
        for name, ts in times.items()
    }


def data_parallel_step(step: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``step`` whose AdamW update sees gradients averaged over the ``data`` mesh axis."""
    adamw = steps_module._adam

    def reduced_adamw(params: Any, grads: dict[str, torch.Tensor], *rest: Any) -> Any:
        grads = {k: all_reduce(g, "avg", ["data"], n) for k, g in grads.items()}
        return adamw(params, grads, *rest)

    def dp_step(*args: Any) -> Any:
        steps_module._adam = reduced_adamw
        try:
            return step(*args)
        finally:
            steps_module._adam = adamw

    return dp_step


def per_node_vmap(mesh: Mesh, gm: fx.GraphModule, inputs: list[torch.Tensor]) -> list[Any]:
    """Strategy (a), for comparison: one torch.vmap call per local node, everything batched."""
    from partita.runtime.stacked import STACKED_IMPLS

    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "output":
            return [env[a] for a in node.args[0]]
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            if node.target in MESH_OPS:
                env[node] = STACKED_IMPLS[node.target](mesh, *args, **kwargs)
                continue
            flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
            dims = [0 if isinstance(a, torch.Tensor) else None for a in flat]
            if not any(d == 0 for d in dims):
                out = node.target(*args, **kwargs)
                env[node] = torch.utils._pytree.tree_map(
                    lambda t: t.expand(mesh.size, *t.shape) if isinstance(t, torch.Tensor) else t,
                    out,
                )
                continue

            def call(*leaves: Any, target: Any = node.target, spec: Any = spec) -> Any:
                a, k = torch.utils._pytree.tree_unflatten(list(leaves), spec)
                return target(*a, **k)

            env[node] = torch.vmap(call, in_dims=tuple(dims))(*flat)
    raise AssertionError("graph without output")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-per-node", action="store_true")
    ns = parser.parse_args(argv)
    # The steady state: every segment runs its flat graph from the second run on (by default
    # the LocalMesh traces once the eager runs cost as much: runtime/flat_trace.py).
    os.environ.setdefault("PARTITA_TRACE_FLAT_AT", "2")
    n = ns.devices
    if ns.batch % n:
        parser.error(f"--batch {ns.batch} must be divisible by --devices {n}")
    torch.manual_seed(0)
    cfg = GPTConfig(ns.layers, ns.heads, ns.width, ns.vocab, ns.seq)
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, ns.vocab), targets.reshape(-1))

    step = make_train_step(model, loss_fn, "adamw")
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = torch.randint(0, ns.vocab, (ns.batch, ns.seq))
    targets = torch.roll(ids, -1, dims=1)
    args = (params, {}, init_opt_state(params), (ids, targets))
    local_b = ns.batch // n
    local_args = (params, {}, init_opt_state(params), (ids[:local_b], targets[:local_b]))

    program = trace(step, args)
    flat = program.flatten_inputs(args)
    local = trace(data_parallel_step(step, n), local_args)
    mesh = Mesh.create((n,), ("data",))
    # Replicated state as stride-0 views; the batch split over the devices.
    stacked = [x.expand(n, *x.shape) for x in local.flatten_inputs(local_args)[:-2]]
    stacked += [ids.reshape(n, local_b, ns.seq), targets.reshape(n, local_b, ns.seq)]
    runner = LocalMesh(mesh)

    fns = {
        "unsharded eager step": lambda: step(*args),
        "unsharded traced graph": lambda: program.graph_module(*flat),
        "LocalMesh.run (segments)": lambda: runner.run(local.graph_module, stacked),
    }
    if not ns.skip_per_node:
        fns["per-node vmap"] = lambda: per_node_vmap(mesh, local.graph_module, stacked)
    seconds = median_seconds(fns, ns.repeat)
    got = runner.run(local.graph_module, stacked)  # after the timed runs: the traced graphs
    want = program.graph_module(*flat)
    worst = max((g[0] - w).abs().max().item() for g, w in zip(got[1:], want[1:], strict=True))
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    print(f"# GPT layers={ns.layers} d_model={ns.width} heads={ns.heads} vocab={ns.vocab} "
          f"seq={ns.seq} batch={ns.batch}, AdamW, data parallel on {mesh!r}; "
          f"{len(local.graph.nodes)} nodes; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {ns.repeat}")  # fmt: skip
    print(f"# max |LocalMesh - unsharded| over new params/state: {worst:.2e}")
    base = seconds["unsharded eager step"]
    for name, t in seconds.items():
        print(f"{name:<28} {t:8.3f} s  ratio {t / base:5.2f}")


if __name__ == "__main__":
    main()
