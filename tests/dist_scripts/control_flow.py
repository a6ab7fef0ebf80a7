"""Run the control-flow programs of test_control_flow.py on 4 processes (mesh 2x2); rank 0
saves every result.

Usage (4 processes): control_flow.py OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import partita
import partita.distributed as pd
import test_control_flow as cases

pd.initialize()
mesh = partita.Mesh.create((2, 2), ("x", "y"))
results = {}
for name, fn in cases.PROGRAMS.items():
    x, w = cases._inputs(7)
    out = partita.jit(fn, mesh=mesh, in_specs=cases.SPECS)(x, w)
    results[name] = [o.full() for o in torch.utils._pytree.tree_leaves(out)]
    pd.log(f"{name}: ok")
if pd.is_main_process():
    torch.save(results, sys.argv[1])
