"""An MLP train step, FSDP over a mesh of 2 Gloo processes, and its measured breakdown.

Usage (2 processes): breakdown_step.py OUT_DIR. Each rank writes ``OUT_DIR/rank{r}.json``:
``runtime.breakdown.measure``'s CPU, wall time and parts of a step, for
``tests/test_breakdown_dist.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import partita.distributed as pd
from partita import Mesh
from partita.runtime.breakdown import measure

from mlp_step import adamw_step  # isort: skip

pd.initialize()
torch.manual_seed(0)
mesh = Mesh.create((2,), ("data",))
# wide enough that the gathers and reduce-scatters move megabytes (Gloo's threads work)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64))
step, params, state = adamw_step(model, mesh)
g = torch.Generator().manual_seed(0)
batch = (torch.randn(512, 256, generator=g), torch.randn(512, 64, generator=g))
held = [params, state]


def one() -> None:
    _, held[0], _, held[1] = step(held[0], {}, held[1], batch)


for _ in range(3):  # compile, the measuring first run, the overlapped steady state
    one()
split = measure(one, repeat=3, profiled=2)
out = Path(sys.argv[1]) / f"rank{pd.process_index()}.json"
out.write_text(json.dumps({"cpu": split.cpu, "wall": split.wall, "parts": split.parts}))
