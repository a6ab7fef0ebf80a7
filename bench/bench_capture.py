"""Trace time of a GPT training step (forward, backward, AdamW) at several depths.

Run: ``.venv/bin/python bench/bench_capture.py [--layers 4 8 12] [--repeat 3]``

Prints, per depth, the number of graph nodes and the median trace seconds. Tracing is in fake
mode: the model's real parameters exist (they are the example inputs) but no activation is
computed. This script measures capture only, not propagation or partitioning.

``--check-reuse`` times nothing: it compiles the step at each depth under FSDP on ``(8,)`` and
2-D on ``(2, 4)``, once with every block traced (``PARTITA_SCAN_LAYERS=0``) and once with the
default reuse of repeated blocks, and checks that the traced, propagated and per-device programs
and the Plans are equal up to node names (nodes renamed by position before propagation). It
prints one line per strategy and exits non-zero on a difference.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from partita import Mesh, P
from partita.capture import trace
from partita.models import GPT, GPTConfig
from partita.partition import partition
from partita.propagate import propagate
from partita.training import init_opt_state, make_train_step

WIDTH, HEADS, VOCAB, SEQ, BATCH = 768, 12, 8192, 128, 8


def gpt_step(n_layer: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The benchmarked program: ``(step, (params, buffers, opt_state, (ids, targets)))``."""
    cfg = GPTConfig(n_layer=n_layer, n_head=HEADS, d_model=WIDTH, vocab_size=VOCAB, seq_len=SEQ)
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    step = make_train_step(model, loss_fn, "adamw")
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return step, (params, {}, init_opt_state(params, "adamw"), (ids, ids))


def _fingerprint(n_layer: int, strategy: str, reuse: bool) -> list[list[str]]:
    """The program at each stage as text, nodes named by position (see ``--check-reuse``)."""
    os.environ["PARTITA_SCAN_LAYERS"] = "1" if reuse else "0"
    torch.manual_seed(0)
    step, args = gpt_step(n_layer)
    params = args[0]
    if strategy == "fsdp":
        mesh = Mesh.create((8,), ("data",))
        specs = {k: P("data") if v.shape[0] % 8 == 0 else P() for k, v in params.items()}
    else:  # Megatron column / row parallel on "model", the batch on "data"
        mesh = Mesh.create((2, 4), ("data", "model"))
        column = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
        row = ("attn.proj.weight", "mlp.proj.weight")
        specs = {
            k: P("model") if k.endswith(column) else P(None, "model") if k.endswith(row) else P()
            for k in params
        }
    in_specs = (specs, {}, {"step": P(), "exp_avg": specs, "exp_avg_sq": specs}, (P("data"),) * 2)
    gm = trace(step, args, in_specs=in_specs, mesh=mesh).graph_module
    for i, node in enumerate(list(gm.graph.nodes)):
        if node.op != "output":
            node._rename(f"v{i}")

    def text(g: torch.fx.GraphModule, keys: tuple[str, ...]) -> list[str]:
        lines = []
        for n in g.graph.nodes:
            line = f"{n.format_node()} {[repr(n.meta.get(k)) for k in keys]}"
            if "annotation" in n.meta:  # its key counts annotations of the whole process
                line = f"{n.name} = annotate({n.args[0]}) {n.meta['annotation']!r}"
            lines.append(re.sub(r" at 0x[0-9a-f]+", "", line))  # object addresses
        return lines

    traced = text(gm, ("source",))
    propagate(gm, mesh)
    propagated = text(gm, ("sharding", "factor_axes"))
    local, plan = partition(gm, mesh)
    plan_text = [repr(plan.shardings), repr(plan.collectives), repr(plan.buckets), plan.summary()]
    code = re.sub(r" at 0x[0-9a-f]+", "", local.code)
    return [traced, propagated, [*text(local, ("source",)), code, *plan_text]]


def check_reuse(layers: list[int]) -> bool:
    """Compile with and without reuse of repeated blocks; True when the programs are equal."""
    ok = True
    for n in layers:
        for strategy in ("fsdp", "2d"):
            unrolled = _fingerprint(n, strategy, reuse=False)
            reused = _fingerprint(n, strategy, reuse=True)
            same = [a == b for a, b in zip(unrolled, reused, strict=True)]
            ok = ok and all(same)
            stages = ", ".join(
                f"{stage} {'same' if s else 'DIFFERENT'}"
                for stage, s in zip(
                    ("traced", "propagated", "per-device + Plan"), same, strict=True
                )
            )
            print(f"{n:>3} layers {strategy:>4}: {stages} ({len(unrolled[0])} nodes)", flush=True)
    return ok


def bench(n_layer: int, repeat: int) -> tuple[int, float]:
    step, args = gpt_step(n_layer)
    times, nodes = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        program = trace(step, args)
        times.append(time.perf_counter() - start)
        nodes = len(program.graph.nodes)
    return nodes, statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--check-reuse", action="store_true", help="see the module doc")
    ns = parser.parse_args(argv)
    if ns.check_reuse:
        sys.exit(0 if check_reuse(ns.layers) else 1)
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    print(f"# GPT d_model={WIDTH} heads={HEADS} vocab={VOCAB} seq={SEQ} batch={BATCH}, AdamW; "
          f"torch {torch.__version__}; median of {ns.repeat}")  # fmt: skip
    print(f"{'layers':>6} {'params (M)':>10} {'nodes':>7} {'trace s':>8}")
    for n in ns.layers:
        nodes, seconds = bench(n, ns.repeat)
        n_params = 12 * n * WIDTH**2 + 2 * VOCAB * WIDTH + SEQ * WIDTH
        print(f"{n:>6} {n_params / 1e6:>10.1f} {nodes:>7} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
