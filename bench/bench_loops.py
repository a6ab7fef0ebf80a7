"""Compile time and program size of a GPT's loss against its depth: layers unrolled against
layers as one loop (``partita.scan_layers(model.blocks, loop=True)``).

Run: ``.venv/bin/python bench/bench_loops.py [--layers 12 24 48] [--repeat 3]``

For each depth, the same GPT-S (width 256, 4 heads, vocabulary 512, sequence 64, global batch
8) computes its cross-entropy loss under ``partita.jit`` on a 2x4 ``data x model`` mesh, the
batch split over ``data``, compiled two ways: ``unrolled`` (``scan_layers(model.blocks)``:
one block traced, its graph copied once per layer) and ``loop`` (``loop=True``: the chain of
blocks becomes one ``scan`` over the stacked block parameters, the block's graph held once).
Each repeat builds a new model and a new jit, so nothing comes from the compile cache;
``compile`` is the wall time of compiling (trace, propagate, partition), median of
``--repeat``. Node counts are of the captured program: ``nodes`` every node, ``compute``
the nodes that are not the program's inputs or their annotations (a layer's parameters are
inputs of the program either way: 12 per block), ``body`` the nodes of the loop's body.
``loss`` checks that both programs compute the same loss as eager torch (max abs difference).
Only the forward is looped (a training step's backward is inlined per layer); the machine is
shared, so times are noisy: compare the columns of one run.
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


def compile_once(n_layer: int, mesh: Mesh, loop: bool) -> tuple[float, dict[str, int], float]:
    """Seconds of one fresh compile, the program's node counts, and |loss - eager loss|."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=HEADS, d_model=WIDTH, vocab_size=VOCAB,
                          seq_len=SEQ))  # fmt: skip
    partita.scan_layers(model.blocks, loop=loop)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())

    step = partita.jit(loss, mesh=mesh, in_specs=(P("data", None),))
    t0 = time.perf_counter()
    step.lower(ids)
    seconds = time.perf_counter() - t0
    gm = step._compile((ids,), {})[0].program.graph_module  # the cached compile
    nodes = list(gm.graph.nodes)
    inputs = {n for n in nodes if n.op == "placeholder"}
    annotations = {n for n in nodes if n.op == "call_function" and n.args and n.args[0] in inputs}
    bodies = [m for m in gm.children() if isinstance(m, torch.fx.GraphModule)]
    counts = {
        "nodes": len(nodes),
        "compute": len(nodes) - len(inputs) - len(annotations),
        "body": sum(len(b.graph.nodes) for b in bodies),
    }
    with torch.no_grad():
        diff = (step(ids).full() - loss(ids)).abs().item()
    return seconds, counts, diff


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
    print(f"{'layers':>6} {'mode':>9} {'compile':>8} {'nodes':>6} {'compute':>8} {'body':>5} "
          f"{'|loss-eager|':>13}")  # fmt: skip
    for n_layer in ns.layers:
        for loop in (False, True):
            runs = [compile_once(n_layer, mesh, loop) for _ in range(ns.repeat)]
            seconds = statistics.median(r[0] for r in runs)
            counts, diff = runs[0][1], max(r[2] for r in runs)
            mode = "loop" if loop else "unrolled"
            print(f"{n_layer:>6} {mode:>9} {seconds:>8.2f} {counts['nodes']:>6} "
                  f"{counts['compute']:>8} {counts['body']:>5} {diff:>13.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
