"""The virtual-device loop of virtual_cache.py under torch.distributed, one process per device
of a 1x2 mesh, then the same model trained by a ``partita.compile`` step; rank 0 prints the two
results as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import partita.distributed as pd
from partita import Mesh

sys.path.insert(0, str(Path(__file__).parent))
from virtual_cache import run, run_compiled

pd.initialize()
mesh = Mesh.create((1, 2), ("data", "model"))
result = run(None, steps=3, mesh=mesh)
result["compiled"] = run_compiled(steps=6, mesh=mesh)
if pd.process_index() == 0:
    print(json.dumps(result), flush=True)
pd.barrier()
