"""Trace time and propagation time, separately, of a GPT training step at several depths.

Run: ``.venv/bin/python bench/bench_propagate.py [--layers 4 8 12] [--repeat 3] [--mesh 2x4]``

The step is forward, backward and AdamW of a GPT (width 768, 12 heads, vocabulary 8192,
sequence 128, batch 8) traced in fake mode; only parameters and the batch are annotated, 2-D:
the batch on 'data', weights FSDP-style on 'data' along dim 0 and Megatron-style on 'model'.
Propagation time should grow no faster than linearly with the number of nodes: the last column
prints microseconds per node. Medians of ``--repeat`` runs; propagation reruns on a fresh trace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from bench_capture import BATCH, HEADS, SEQ, VOCAB, WIDTH, gpt_step  # bench/ is on sys.path

from partita import Mesh, P
from partita.capture import trace
from partita.propagate import propagate


def param_spec(name: str, shape: torch.Size) -> P:
    """2-D: Megatron column/row parallel on 'model', everything else FSDP on 'data'."""
    if name.endswith(("qkv.weight", "fc1.weight", "fc.weight")) and len(shape) == 2:
        return P("model", "data")  # column parallel (nn.Linear weights are [out, in])
    if name.endswith(("proj.weight", "fc2.weight")) and len(shape) == 2:
        return P("data", "model")  # row parallel
    return P("data") if shape[0] % 2 == 0 else P()


def build(n_layer: int) -> tuple[object, tuple[object, ...], object]:
    step, args = gpt_step(n_layer)
    pspecs = {k: param_spec(k, v.shape) for k, v in args[0].items()}
    return step, args, (pspecs, None, None, (P("data"), P("data")))


def bench(n_layer: int, repeat: int, mesh: Mesh) -> tuple[int, float, float, int]:
    step, args, in_specs = build(n_layer)
    t_trace, t_prop = [], []
    nodes = sharded = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        prog = trace(step, args, in_specs=in_specs, mesh=mesh)
        t1 = time.perf_counter()
        propagate(prog.graph_module, mesh)
        t2 = time.perf_counter()
        t_trace.append(t1 - t0)
        t_prop.append(t2 - t1)
        gm = prog.graph_module
        nodes = len(gm.graph.nodes)
        sharded = sum(1 for n in gm.graph.nodes if "sharding" in n.meta)
    return nodes, statistics.median(t_trace), statistics.median(t_prop), sharded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mesh", default="2x4", help="data x model, e.g. 2x4")
    ns = parser.parse_args(argv)
    shape = tuple(int(s) for s in ns.mesh.split("x"))
    mesh = Mesh.create(shape, ("data", "model"))
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    print(
        f"# GPT d_model={WIDTH} heads={HEADS} vocab={VOCAB} seq={SEQ} batch={BATCH}, AdamW, "
        f"{mesh!r}; torch {torch.__version__}; median of {ns.repeat}"
    )
    cols = ("layers", 6), ("nodes", 7), ("sharded", 7), ("trace s", 8), ("propagate s", 11)
    print(" ".join(f"{c:>{w}}" for c, w in cols), f"{'us/node':>8}")
    for n in ns.layers:
        nodes, tt, tp, sharded = bench(n, ns.repeat, mesh)
        print(f"{n:>6} {nodes:>7} {sharded:>7} {tt:>8.2f} {tp:>11.3f} {tp / nodes * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
