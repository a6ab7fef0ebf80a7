"""Lowering Llama-3-70B and -405B training steps built on the meta device: wall time and RSS.

Run: ``.venv/bin/python bench/bench_plan_scale.py [--models 70b 405b] [--batch 16] [--seq 2048]``

Each model runs in its own process (so ``ru_maxrss``, the process high-water mark, is its own):
the ``transformers`` ``LlamaForCausalLM`` of the published shapes, built under
``torch.device("meta")`` (shapes, no data), ``partita.train_step(model, cross entropy, AdamW,
param_specs="fsdp+tp")`` on a ``(data, model)`` mesh, then ``step.lower((ids, ids))`` with
token ids of ``batch x seq`` on the meta device. Printed per model: the wall and CPU seconds of
building the step and of ``lower`` (trace, propagate, partition: the repeated decoder layers
are traced once, ``capture/layer_auto.py``), the peak RSS of the process (it includes Python,
torch and transformers), the collectives of the Plan and its per-device bytes, and the
per-device peak of ``Plan.memory()`` (counted after the timing).

* ``70b``: hidden 8192, MLP 28672, 80 layers, 64 heads / 8 KV heads, vocabulary 128256, on
  ``(8, 128)``;
* ``405b``: hidden 16384, MLP 53248, 126 layers, 128 heads / 8 KV heads, vocabulary 128256, on
  ``(16, 1024)``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODELS = {
    "70b": dict(hidden=8192, ffn=28672, layers=80, heads=64, kv=8, mesh=(8, 128)),
    "405b": dict(hidden=16384, ffn=53248, layers=126, heads=128, kv=8, mesh=(16, 1024)),
}


def _child(name: str, batch: int, seq: int) -> None:
    import torch
    import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
    from transformers import LlamaConfig, LlamaForCausalLM

    import partita
    from partita import Mesh

    m = MODELS[name]
    config = LlamaConfig(
        hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv"], vocab_size=128256,
    )  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)

    def loss_fn(out, targets):  # type: ignore[no-untyped-def]
        return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mesh = Mesh.create(m["mesh"], ("data", "model"))
    step = partita.train_step(model, loss_fn, opt, mesh=mesh, param_specs="fsdp+tp")
    built = time.perf_counter() - wall, time.process_time() - cpu
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    wall, cpu = time.perf_counter(), time.process_time()
    plan = step.lower((ids, ids))
    lowered = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    params = sum(p.numel() for p in model.parameters())
    peak = plan.memory().peak
    print(json.dumps({
        "params": params, "built": built, "lowered": lowered, "rss": rss,
        "collectives": len(plan.collectives), "bytes": plan.bytes_per_device, "peak": peak,
        "summary": plan.summary(), "mesh": repr(mesh),
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.batch, args.seq)
        return
    import torch

    print(f"# {sys.executable} bench/bench_plan_scale.py --models {' '.join(args.models)} "
          f"--batch {args.batch} --seq {args.seq}")  # fmt: skip
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs; one process per model; "
          f"fsdp+tp, AdamW, token ids {args.batch}x{args.seq} on the meta device")  # fmt: skip
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    for name in args.models:
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, "--batch", str(args.batch),
             "--seq", str(args.seq)],
            capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n## Llama-3-{name.upper()} ({r['params'] / 1e9:.1f}B parameters) on {r['mesh']}")
        print(f"build step   {r['built'][0]:7.2f} s wall {r['built'][1]:7.2f} s CPU")
        print(f"lower        {r['lowered'][0]:7.2f} s wall {r['lowered'][1]:7.2f} s CPU")
        print(f"peak RSS     {r['rss']:7.2f} GiB (the whole process)")
        print(f"Plan peak    {r['peak'] / 2**30:7.2f} GiB per device (Plan.memory())")
        print(r["summary"])


if __name__ == "__main__":
    main()
