"""Run a small MLP train step on 4 processes under several bucketing / overlap settings.

Usage (4 processes): overlap.py OUT.pt. Rank 0 saves ``{(mesh, setting): (losses, params,
call counts)}`` and the fused ops' results beside the single ops' (on groups whose torch
order differs from partita's member order), for ``tests/test_overlap.py`` to compare.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import partita.distributed as pd
from partita import Mesh
from partita.runtime.distributed import close_executors, distributed_executor

from mlp_step import adamw_step  # isort: skip

#: (PARTITA_BUCKET_BYTES, PARTITA_OVERLAP_BYTES[, PARTITA_REGATHER]): off/off against, for
#: FSDP, small buckets with a bound of one byte in flight (every launch deferred to the previous
#: wait) and the defaults with re-gathering for the backward; for 2-D, the defaults.
SETTINGS = {
    "fsdp": [("0", "0"), ("4096", "1"), ("", "", "1")],
    "fsdp+tp": [("0", "0"), ("", "")],
}


def mlp_run(mesh: Mesh, plan: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 8),
    )  # fmt: skip
    step, params, state = adamw_step(model, mesh, plan)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        batch = (torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
        loss, params, _, state = step(params, {}, state, batch)
        losses.append(float(loss.full()))
    counts = step.lower(params, {}, state, batch).call_counts()
    return losses, {k: v.full() for k, v in params.items()}, counts


def fused_ops(mesh: Mesh) -> dict[str, list[torch.Tensor]]:
    """Each fused op beside its members run alone, over ("model", "data") (reordered group)."""
    ex = distributed_executor(mesh)
    g = torch.Generator().manual_seed(ex.rank)
    xs = [torch.randn(4, 6, generator=g), torch.randn(8, generator=g)]
    axes = ["model", "data"]
    out = {
        "ag": ex.call("all_gather_bucket", xs, [1, 0], axes, 4),
        "ag1": [ex.call("all_gather", x, d, axes, 4) for x, d in zip(xs, [1, 0], strict=True)],
        "ar": ex.call("all_reduce_bucket", xs, "avg", axes, 4),
        "ar1": [ex.call("all_reduce", x, "avg", axes, 4) for x in xs],
        "rs": ex.call("reduce_scatter_bucket", xs, [0, 0], "sum", axes, 4),
        "rs1": [ex.call("reduce_scatter", x, 0, "sum", axes, 4) for x in xs],
    }
    return {k: [t.clone() for t in v] for k, v in out.items()}


pd.initialize()
results: dict = {}
for shape, names, plan in [((4,), ("data",), "fsdp"), ((2, 2), ("data", "model"), "fsdp+tp")]:
    mesh = Mesh.create(shape, names)
    for setting in SETTINGS[plan]:
        os.environ["PARTITA_BUCKET_BYTES"], os.environ["PARTITA_OVERLAP_BYTES"] = setting[:2]
        os.environ["PARTITA_REGATHER"] = setting[2] if len(setting) > 2 else "0"
        close_executors()  # a fresh executor; the options are read at each call (the key)
        results[(plan, setting)] = mlp_run(mesh, plan)
        pd.log(f"{plan} {setting}: {results[(plan, setting)][2]}")
results["fused"] = fused_ops(Mesh.create((2, 2), ("data", "model")))
if pd.is_main_process():
    torch.save(results, sys.argv[1])
