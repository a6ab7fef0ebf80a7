"""Compile time and program size of a GPT's loss against its depth: layers unrolled against
layers as one loop (``partita.scan_layers(model.blocks, loop=True)``).

Run: ``.venv/bin/python bench/bench_loops.py [--layers 12 24 48] [--repeat 3]``

For each depth, the same GPT-S (width 256, 4 heads, vocabulary 512, sequence 64, global batch
8) computes its cross-entropy loss under ``partita.jit`` on a 2x4 ``data x model`` mesh, the
batch split over ``data``, compiled two ways: ``unrolled`` (``scan_layers(model.blocks)``:
one block traced, its graph copied once per layer) and ``loop`` (``loop=True``: the chain of
blocks becomes one ``scan`` over the stacked block parameters, the block's graph held once).
Each repeat builds a new model and a new jit, so nothing comes from the compile cache;
``cpu`` is the CPU time (``time.process_time``) of compiling (trace, propagate, partition),
``wall`` its wall time, both medians of ``--repeat``; ``stack`` is the CPU time of the
``scan_layers`` call itself (with ``loop=True`` it stacks each parameter name over the layers
once and makes the layers' parameters views of it; not part of the compile). Node counts are of
the captured program: ``nodes`` every node, ``inputs`` its inputs, ``compute`` the nodes that
are not the program's inputs or their annotations, ``body`` the nodes of the loop's body.
``ratio`` is each depth's ``cpu`` over the first depth's, per mode (after one warm-up
compile per mode at 2 layers). ``loss`` checks that both
programs compute the same loss as eager torch (max abs difference). The machine may be shared:
the load average is printed at the start and the end; CPU time is less noisy than wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig

WIDTH, HEADS, VOCAB, SEQ, BATCH = 256, 4, 512, 64, 8


def compile_once(n_layer: int, mesh: Mesh, loop: bool) -> tuple[dict[str, float], dict[str, int]]:
    """CPU and wall seconds of one fresh compile (and of scan_layers), |loss - eager loss|,
    and the program's node counts."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=HEADS, d_model=WIDTH, vocab_size=VOCAB,
                          seq_len=SEQ))  # fmt: skip
    c0 = time.process_time()
    partita.scan_layers(model.blocks, loop=loop)
    stack = time.process_time() - c0
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())

    step = partita.jit(loss, mesh=mesh, in_specs=(P("data", None),))
    c0, t0 = time.process_time(), time.perf_counter()
    step.lower(ids)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    gm = step._compile((ids,), {})[0].program.graph_module  # the cached compile
    nodes = list(gm.graph.nodes)
    inputs = {n for n in nodes if n.op == "placeholder"}
    annotations = {n for n in nodes if n.op == "call_function" and n.args and n.args[0] in inputs}
    bodies = [m for m in gm.children() if isinstance(m, torch.fx.GraphModule)]
    counts = {
        "nodes": len(nodes),
        "inputs": len(inputs),
        "compute": len(nodes) - len(inputs) - len(annotations),
        "body": sum(len(b.graph.nodes) for b in bodies),
    }
    with torch.no_grad():
        diff = (step(ids).full() - loss(ids)).abs().item()
    return {"cpu": cpu, "wall": wall, "stack": stack, "diff": diff}, counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--repeat", type=int, default=3)
    ns = parser.parse_args(argv)
    mesh = Mesh.create((2, 4), ("data", "model"))
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    print(
        f"# partita.jit(GPT-S loss: d_model={WIDTH} heads={HEADS} vocab={VOCAB} seq={SEQ} "
        f"batch={BATCH}) on {mesh!r}; torch {torch.__version__}; median of {ns.repeat} fresh "
        f"compiles (seconds); load average {os.getloadavg()[0]:.1f} at the start"
    )
    head = ("layers", "mode", "cpu", "ratio", "wall", "stack", "nodes", "inputs", "compute",
            "body", "|loss-eager|")  # fmt: skip
    print(" ".join(f"{h:>6}" for h in head))
    for loop in (False, True):  # warm-up: torch's and partita's first-use costs
        compile_once(2, mesh, loop)
    first: dict[bool, float] = {}
    for n_layer in ns.layers:
        for loop in (False, True):
            runs = [compile_once(n_layer, mesh, loop) for _ in range(ns.repeat)]
            t = {k: statistics.median(r[0][k] for r in runs) for k in ("cpu", "wall", "stack")}
            counts, diff = runs[0][1], max(r[0]["diff"] for r in runs)
            ratio = t["cpu"] / first.setdefault(loop, t["cpu"])
            mode = "loop" if loop else "unrolled"
            row = [n_layer, mode, f"{t['cpu']:.2f}", f"{ratio:.2f}", f"{t['wall']:.2f}",
                   f"{t['stack']:.2f}", counts["nodes"], counts["inputs"], counts["compute"],
                   counts["body"], f"{diff:.2e}"]  # fmt: skip
            print(" ".join(f"{v:>6}" for v in row), flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
