"""Rank 3 kills itself (SIGKILL) in the middle of training; the others must fail quickly."""

from __future__ import annotations

import os
import signal

import torch

import partita
import partita.distributed as pd
from partita import Mesh, P

pd.initialize()
mesh = Mesh.create((4,), ("data",))
step = partita.jit(lambda x, w: (x @ w).sum(), mesh=mesh, in_specs=(P(None, "data"), P("data")))
x, w = torch.randn(16, 32), torch.randn(32, 8)
for i in range(1000):
    if i == 3 and pd.process_index() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = step(x, w).full()
    print(f"step {i}", flush=True)
