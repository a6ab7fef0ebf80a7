"""The virtual-device loop of virtual_cache.py under torch.distributed, one process per device
of a 1x2 mesh; rank 0 prints its result as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import partita.distributed as pd
from partita import Mesh

sys.path.insert(0, str(Path(__file__).parent))
from virtual_cache import run

pd.initialize()
result = run(None, steps=3, mesh=Mesh.create((1, 2), ("data", "model")))
if pd.process_index() == 0:
    print(json.dumps(result), flush=True)
pd.barrier()
