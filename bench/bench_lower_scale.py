"""The CPU time of ``lower()`` against the mesh size: it should not grow with the device count.

Run: ``.venv/bin/python bench/bench_lower_scale.py [--repeat 5] [--meshes 2x4 16x64 64x256 8x128]``

Two programs, each lowered as ``partita.train_step(..., param_specs="fsdp+tp").lower(batch)``
on meshes ``(data, model)`` of 8 to 16,384 devices:

* ``MLP``: ``Linear(64, 256) -> ReLU -> Linear(256, 64)``, MSE loss, AdamW, batch 1024 x 64,
  built on the CPU (real tensors);
* ``Llama``: a tiny ``transformers`` Llama (2 layers, hidden 256, 8 heads / 4 KV heads, MLP
  512, vocabulary 1024, batch 64 x 128 token ids), built on the meta device.

Each (program, mesh) runs in its own process (``subprocess``), so process-wide caches (the
reshard planner's, torch's) start cold in each: ``first`` is the first ``lower`` of the process
(what a user pays once), ``median`` the median of ``--repeat`` more, each on a new
``train_step`` (its compile cache empty). Times are ``time.process_time()`` (CPU seconds of this
process) around ``lower`` alone; building the model and the step is not counted. The machine
is shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

MESHES = ("2x4", "16x64", "64x256", "8x128")


def _build(program: str, mesh_shape: tuple[int, ...]) -> tuple[object, tuple[object, object]]:
    import torch
    import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
    from torch import nn

    import partita
    from partita import Mesh

    mesh = Mesh.create(mesh_shape, ("data", "model"))
    if program == "MLP":
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        batch = (torch.randn(1024, 64), torch.randn(1024, 64))
        loss_fn = F.mse_loss
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=1024,
        )  # fmt: skip
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        ids = torch.empty(64, 128, dtype=torch.long, device="meta")
        batch = (ids, ids)

        def loss_fn(out, targets):  # type: ignore[no-untyped-def]
            return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = partita.train_step(model, loss_fn, opt, mesh=mesh, param_specs="fsdp+tp")
    return step, batch


def _child(program: str, mesh: str, repeat: int) -> None:
    """One (program, mesh): print a JSON line of CPU seconds."""
    shape = tuple(int(n) for n in mesh.split("x"))
    times = []
    for _ in range(repeat + 1):
        step, batch = _build(program, shape)
        start = time.process_time()
        plan = step.lower(batch)  # type: ignore[attr-defined]
        times.append(time.process_time() - start)
    print(json.dumps({"first": times[0], "median": statistics.median(times[1:]),
                      "collectives": len(plan.collectives)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.repeat)
        return
    import torch

    print(f"# {sys.executable} bench/bench_lower_scale.py --repeat {args.repeat} "
          f"--meshes {' '.join(args.meshes)}")  # fmt: skip
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or ''}; "
          f"CPU seconds of lower() alone (time.process_time), one process per row")  # fmt: skip
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    print(f"{'program':<8} {'mesh':>8} {'devices':>8} {'first':>8} {'median':>8} {'vs 2x4':>7}"
          f" {'collectives':>11}")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for program in ("MLP", "Llama"):
        base = None
        for mesh in args.meshes:
            out = subprocess.run(
                [sys.executable, __file__, "--repeat", str(args.repeat), "--child", program, mesh],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            base = row["median"] if base is None else base
            devices = math.prod(int(n) for n in mesh.split("x"))
            print(f"{program:<8} {mesh:>8} {devices:>8} {row['first']:>7.3f}s "
                  f"{row['median']:>7.3f}s {row['median'] / base:>6.2f}x "
                  f"{row['collectives']:>11}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
