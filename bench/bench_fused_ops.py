"""Which ops the LocalMesh's fused GPT-S step runs, how many and how much CPU, beside the
unsharded step's.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_fused_ops.py [--strategy fsdp 2d]``

The fused step (``runtime.fused_step``) is one FX graph; the unsharded step traced with
``make_fx`` is another. Each is run node by node under an interpreter that frees every value
at its last reader (as the generated code does) and reads the thread CPU time around each
node: the minimum over ``--repeat`` runs per node, summed per op. Thread CPU time, not the
profiler's wall time: on a loaded machine an op's wall time holds the time it waited for a
core. What the table does not show is the cost between the ops (the allocator's page
faults after a step freed its memory, Python around the graph).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from bench_partition import param_specs, vector_step_counter  # bench/ is on sys.path
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.runtime import fused_step
from partita.training import init_opt_state, make_train_step


def node_times(gm: fx.GraphModule, args: Sequence[Any], repeat: int) -> dict[fx.Node, int]:
    """Per node, the least thread CPU nanoseconds over ``repeat`` runs."""
    last: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        for a in node.all_input_nodes:
            last[a] = node
    dies: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for value, reader in last.items():
        dies[reader].append(value)
    best: dict[fx.Node, int] = {}
    for _ in range(repeat):
        env: dict[fx.Node, Any] = {}
        inputs = iter(args)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
                continue
            if node.op == "output":
                break
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
                continue
            fn_args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            start = time.thread_time_ns()
            env[node] = node.target(*fn_args, **kwargs)  # type: ignore[operator]
            spent = time.thread_time_ns() - start
            best[node] = min(best.get(node, spent), spent)
            for value in dies[node]:
                del env[value]
    return best


def by_op(times: dict[fx.Node, int]) -> dict[str, tuple[int, float]]:
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for node, ns in times.items():
        name = getattr(node.target, "__name__", str(node.target))
        row = table[str(node.target) if name == "default" else name]
        row[0] += 1
        row[1] += ns / 1e6
    return {k: (int(c), t) for k, (c, t) in table.items()}


def run(strategy: str, ns: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(4, 8, 256, 512, 128))

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, 512), targets.reshape(-1))

    step = vector_step_counter(make_train_step(model, loss_fn, "adamw"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    state["step"] = state["step"].reshape(1)
    ids = torch.randint(0, 512, (16, 128))
    args = (params, {}, state, (ids, torch.roll(ids, -1, dims=1)))
    mesh = (
        Mesh.create((8,), ("data",))
        if strategy == "fsdp"
        else Mesh.create((2, 4), ("data", "model"))
    )
    pspecs = param_specs(params, strategy, mesh.shape[0])
    in_specs = (
        pspecs,
        {},
        {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
        (P("data"),) * 2,
    )
    jitted = partita.jit(step, mesh=mesh, in_specs=in_specs)
    leaves, tree = pytree.tree_flatten(args)
    specs = pytree.tree_leaves(in_specs, is_leaf=lambda x: isinstance(x, P))
    sharded = pytree.tree_unflatten(
        [partita.mark_sharding(x, mesh, s) for x, s in zip(leaves, specs, strict=True)], tree
    )
    for _ in range(4):  # traced flat at the second run, fused after that
        jitted(*sharded)
    seen: list[tuple[Any, list[Any]]] = []
    call = fused_step._Traced.__call__

    def spy(self: Any, values: Sequence[Any]) -> Any:
        seen.append((self, list(values)))
        return call(self, values)

    fused_step._Traced.__call__ = spy  # type: ignore[method-assign]
    try:
        jitted(*sharded)
    finally:
        fused_step._Traced.__call__ = call  # type: ignore[method-assign]
    if not seen:
        print(f"{strategy}: the step did not run fused")
        return
    traced, values = seen[-1]
    fused = by_op(node_times(traced.gm, [v for v, _ in values if isinstance(v, Tensor)], ns.repeat))
    plain = make_fx(lambda *xs: step(*pytree.tree_unflatten(list(xs), tree)))(*leaves)
    floor = by_op(node_times(plain, leaves, ns.repeat))
    total_f, total_u = sum(t for _, t in fused.values()), sum(t for _, t in floor.values())
    print(f"\n== {strategy} on {mesh!r}: fused graph {sum(c for c, _ in fused.values())} nodes "
          f"{total_f:.1f} ms, unsharded {sum(c for c, _ in floor.values())} nodes "
          f"{total_u:.1f} ms (thread CPU, least of {ns.repeat} per node)")  # fmt: skip
    print(f"  {'op':<52} {'fused n':>8} {'ms':>8} {'unsharded n':>12} {'ms':>8}")

    def cost(op: str) -> float:
        return max(fused.get(op, (0, 0.0))[1], floor.get(op, (0, 0.0))[1])

    for op in sorted(fused.keys() | floor.keys(), key=cost, reverse=True)[: ns.top]:
        (fc, ft), (uc, ut) = fused.get(op, (0, 0.0)), floor.get(op, (0, 0.0))
        print(f"  {op[:52]:<52} {fc:8d} {ft:8.2f} {uc:12d} {ut:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", default=["fsdp", "2d"], choices=["fsdp", "2d"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    ns = parser.parse_args()
    os.environ.setdefault("PARTITA_TRACE_FLAT_AT", "2")
    print(f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} "
          f"{' '.join(['.venv/bin/python', *sys.argv])}")  # fmt: skip
    for strategy in ns.strategy:
        run(strategy, ns)
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
