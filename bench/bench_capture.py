"""Trace time of a GPT training step (forward, backward, AdamW) at several depths.

Run: ``.venv/bin/python bench/bench_capture.py [--layers 4 8 12] [--repeat 3]``

Prints, per depth, the number of graph nodes and the median trace seconds. Tracing is in fake
mode: the model's real parameters exist (they are the example inputs) but no activation is
computed. This script measures capture only, not propagation or partitioning.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from partita.capture import trace
from partita.models import GPT, GPTConfig
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
    ns = parser.parse_args(argv)
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
