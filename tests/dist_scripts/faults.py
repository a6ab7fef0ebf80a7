"""One injected fault in a 2-process run: ``faults.py MODE``; every survivor must fail typed.

Each rank runs a small step for ``STEPS`` steps (a matmul whose rows are split over the mesh
axis ``data``, summed: every step all-reduces a scalar over the mesh-axis group, a group of its
own created by ``new_group``); rank 1 misbehaves as MODE says:

===========  =========================================================================
stall        sleeps ``FAULT_STALL`` seconds (default 45) before step 2
kill         SIGKILLs itself before step 2
raise        raises a plain Python error before step 2
shapes       passes a global input of shape (10, 4) where rank 0 passes (8, 4)
dtypes       passes float64 inputs where rank 0 passes float32
programs     compiles a different function (a per-rank branch)
fewer_steps  stops after 2 steps and exits cleanly; the others run 4
===========  =========================================================================

A PartitaError is printed as ``PARTITA <type>: <message>`` on stderr and the process exits
with status 17, so the test can tell a typed partita error from a crash (1, or a signal).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.errors import PartitaError

PARTITA_EXIT = 17
STEPS = 4


def main(mode: str) -> None:
    pd.initialize()
    rank = pd.process_index()
    mesh = Mesh.create((pd.process_count(),), ("data",))
    faulty = rank == 1

    def step_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if mode == "programs" and faulty:
            return (x @ w).amax()
        return (x @ w).sum()

    step = partita.jit(step_fn, mesh=mesh, in_specs=(P("data", None), P()))
    rows = 10 if mode == "shapes" and faulty else 8
    dtype = torch.float64 if mode == "dtypes" and faulty else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=gen).to(dtype)
    w = torch.randn(4, 3, generator=gen).to(dtype)
    steps = 2 if mode == "fewer_steps" and faulty else STEPS
    for i in range(steps):
        if i == 2 and faulty:
            if mode == "stall":
                time.sleep(float(os.environ.get("FAULT_STALL", "45")))
            elif mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "raise":
                raise RuntimeError("injected failure on rank 1")
        loss = step(x, w).full()
        print(f"step {i} loss={loss.item():.6f}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except PartitaError as e:
        print(f"PARTITA {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(PARTITA_EXIT)
