"""CPU of the LocalMesh's flat and fused traces of a GPT training step: ``flat_trace.trace_fake``
against plain ``make_fx`` (what both traces called before), alternated in one process.

    PYTHONPATH=src .venv/bin/python bench/bench_trace_fake.py --repeat 3

A 4-layer GPT (width 64, 4 heads, sequence 32, batch 16, AdamW) trains 4 steps under
``fsdp+tp`` on ``(2, 4)`` and ``fsdp`` on ``(8,)``, segments traced flat at the second step
and the whole step at the third; per run the CPU of the 4 steps (compile included) and of the
traces, and the last loss (the same for both: the graphs are the same).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

os.environ["PARTITA_TRACE_FLAT_AT"] = "2"

import torch
import torch.nn.functional as F  # noqa: N812
from torch.fx.experimental.proxy_tensor import make_fx

from partita import train_step
from partita.models import GPT, GPTConfig
from partita.runtime import flat_trace, fused_step, segments
from partita.values.mesh import Mesh

NEW = flat_trace.trace_fake
SPENT = {"flat": 0.0, "fused": 0.0}


def old_trace_fake(fn: Callable[..., Any], args: Any) -> Any:
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


def _timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        start = time.process_time()
        try:
            return f(*a, **k)
        finally:
            SPENT[name] += time.process_time() - start

    return run


segments.trace_flat = _timed("flat", flat_trace.trace_flat)  # type: ignore[assignment]
fused_step.trace_step = _timed("fused", fused_step.trace_step)  # type: ignore[assignment]


def run(variant: str, shape: tuple[int, ...], names: tuple[str, ...], preset: str) -> tuple:
    fn = NEW if variant == "new" else old_trace_fake
    flat_trace.trace_fake = fused_step.trace_fake = fn  # type: ignore[assignment]
    SPENT["flat"] = SPENT["fused"] = 0.0
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=64, vocab_size=64, seq_len=32, bias=False)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = train_step(
        model,
        lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
        opt,
        mesh=Mesh.create(shape, names),
        param_specs=preset,
    )
    g = torch.Generator().manual_seed(0)
    start = time.process_time()
    loss = 0.0
    for _ in range(4):
        ids = torch.randint(0, 64, (16, 32), generator=g)
        loss = float(step((ids, torch.roll(ids, -1, dims=1))))
    return time.process_time() - start, SPENT["flat"], SPENT["fused"], loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cases = [((2, 4), ("data", "model"), "fsdp+tp"), ((8,), ("data",), "fsdp")]
    run("new", *cases[0])  # the first compile of a process pays once
    rows: dict[tuple[str, str], list[tuple]] = {}
    for rep in range(args.repeat):
        for case in cases:
            for variant in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                total, flat, fused, loss = run(variant, *case)
                rows.setdefault((case[2], variant), []).append((total, flat, fused))
                print(
                    f"{case[2]:8s} {variant}: 4 steps {total:6.2f} s CPU, flat traces {flat:5.2f}, "
                    f"fused trace {fused:5.2f}, load {os.getloadavg()[0]:.1f}, loss {loss:.6f}",
                    flush=True,
                )
    for (preset, variant), rs in sorted(rows.items()):
        med = [sorted(r[i] for r in rs)[len(rs) // 2] for i in range(3)]
        print(
            f"median {preset:8s} {variant}: steps {med[0]:.2f} flat {med[1]:.2f} fused {med[2]:.2f}"
        )


if __name__ == "__main__":
    main()
