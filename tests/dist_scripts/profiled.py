"""A small MLP train step, FSDP over a mesh of 2, profiled for its first 3 steps.

Usage (2 processes): profiled.py OUT_DIR. Each rank writes ``OUT_DIR/rank{r}.json``, the chrome
trace of its first 3 steps (the first one compiles the step and, on a DistributedMesh, runs it
without overlap to measure its values), for ``tests/test_profiler_ranges.py``.
Imported by that test too, to run the same step on the LocalMesh (:func:`profiled_steps`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from partita import Mesh

from mlp_step import adamw_step  # isort: skip

STEPS = 3


def profiled_steps(trace: Path) -> Any:
    """Run ``STEPS`` steps under ``torch.profiler``, from the first (which compiles the step);
    export the trace; return the Plan."""
    torch.manual_seed(0)
    mesh = Mesh.create((2,), ("data",))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    step, params, state = adamw_step(model, mesh, "fsdp")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g))] * STEPS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for batch in batches:
            _, params, _, state = step(params, {}, state, batch)
    prof.export_chrome_trace(str(trace))
    return step.lower(params, {}, state, batches[0])


if __name__ == "__main__":
    import partita.distributed as pd

    pd.initialize()
    out = Path(sys.argv[1])
    profiled_steps(out / f"rank{pd.process_index()}.json")
