"""An AdamW-like update of GPT-S's parameters as a flat graph: ``_foreach`` groups or per op.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_foreach.py [--repeat 25]``

``runtime.flat_foreach`` groups independent elementwise ops of one kind into one
``_foreach`` call. That saves a Python call and a dispatch per op, but it also changes the
order: every parameter's first step, then every parameter's second step, ... so each step
streams all parameters' tensors through memory, where running one parameter's chain after
the other keeps its tensors in the cache. This prints the median thread CPU time of the
same graph (GPT-S's parameter shapes: 4 layers, width 256, vocabulary 512; 3.45 M
parameters) three ways, runs interleaved: every group formed whatever its size, no group,
and the rule partita uses (members up to ``flat_foreach._MAX_BYTES`` group).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from partita.runtime import flat_foreach


def adam_like(*ts: Tensor) -> list[Tensor]:
    """One update per (param, grad, m, v), each the same ops: what an optimizer traces to."""
    out = []
    for p, g, m, v in zip(ts[0::4], ts[1::4], ts[2::4], ts[3::4], strict=True):
        m2 = m * 0.9 + g * 0.1
        v2 = v * 0.999 + (g * g) * 0.001
        out += [p - 0.01 * m2 / (v2.sqrt() + 1e-8), m2, v2]
    return out


def gpt_s_shapes(layers: int = 4, width: int = 256, vocab: int = 512, seq: int = 128) -> list:
    block = [(3 * width, width), (3 * width,), (width, width), (width,)]
    block += [(4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    block += [(width,)] * 4  # two layer norms
    return block * layers + [(vocab, width), (seq, width), (width,), (width,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=25)
    ns = parser.parse_args()
    torch.manual_seed(0)
    args = [torch.rand(s) + 0.1 for s in gpt_s_shapes() for _ in range(4)]
    gm = make_fx(adam_like, tracing_mode="fake")(*args)
    cap = flat_foreach._MAX_BYTES
    variants = {}
    flat_foreach._MAX_BYTES = 1 << 62
    variants["every group"] = copy.deepcopy(gm)
    flat_foreach.foreach_elementwise(variants["every group"])
    flat_foreach._MAX_BYTES = cap
    variants["per op"] = copy.deepcopy(gm)
    variants[f"members <= {cap // 1024} KiB"] = copy.deepcopy(gm)
    flat_foreach.foreach_elementwise(variants[f"members <= {cap // 1024} KiB"])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn(*args)  # warm-up
    for _ in range(ns.repeat):
        for name, fn in variants.items():
            start = time.thread_time()
            fn(*args)
            times[name].append(time.thread_time() - start)
    print(f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} "
          f"{' '.join(['.venv/bin/python', *sys.argv])}")  # fmt: skip
    print(f"# {sum(a.numel() for a in args[0::4]) / 1e6:.2f} M parameters, "
          f"{torch.get_num_threads()} threads, median thread CPU of {ns.repeat}")  # fmt: skip
    for name, ts in times.items():
        print(f"{name:<22} {statistics.median(ts) * 1e3:7.2f} ms")
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
