"""Run every case of dist_cases.py on the distributed mesh; rank 0 saves the results. Then
rank 2 compiles a different program from the others: every rank must raise
PlanMismatchError, not hang; each prints it to stderr and exits normally (one launch covers
both checks of tests/test_distributed.py: each process imports torch and joins once).

Usage (4 processes): ops.py OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from dist_cases import cases

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.errors import PlanMismatchError

pd.initialize()
results = {}
for name, (mesh, fn, args, in_specs, out_specs, _) in cases().items():
    jitted = partita.jit(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    out = jitted(*args)
    kinds = sorted({c.kind for c in jitted.lower(*args).collectives})
    results[name] = (out.full(), kinds)  # full() on every rank: it gathers
    pd.log(f"{name}: ok {kinds}")

# partita.reshard of a distributed value: each rank ends with its own tile only (it used to
# build the whole stacked value on every rank).
mesh, fn, args, in_specs, out_specs, _ = cases()["all_to_all"]
moved = partita.reshard(partita.jit(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args),
                        partita.P("data", None))  # fmt: skip
results["reshard"] = (moved.full(), (type(moved).__name__, tuple(moved.local_shape)))
pd.log(f"reshard: ok {results['reshard'][1]}")
if pd.is_main_process():
    torch.save(results, sys.argv[1])


def per_rank_branch(x: torch.Tensor) -> torch.Tensor:
    if pd.process_index() == 2:  # a per-rank branch: the classic way to deadlock
        return (x + 1).sum(0)
    return (x * 2).sum(0)


try:
    mismatched = partita.jit(per_rank_branch, mesh=Mesh.create((4,), ("data",)), in_specs=P("data"))
    print("mismatch ran", mismatched(torch.ones(8, 4)).full().tolist(), flush=True)
except PlanMismatchError as e:
    print(f"PlanMismatchError: {e}", file=sys.stderr, flush=True)
