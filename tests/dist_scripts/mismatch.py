"""Rank 2 compiles a different program from the others: every rank must fail, not hang."""

from __future__ import annotations

import torch

import partita
import partita.distributed as pd
from partita import Mesh, P

pd.initialize()
mesh = Mesh.create((4,), ("data",))


def f(x: torch.Tensor) -> torch.Tensor:
    if pd.process_index() == 2:  # a per-rank branch: the classic way to deadlock
        return (x + 1).sum(0)
    return (x * 2).sum(0)


out = partita.jit(f, mesh=mesh, in_specs=P("data"))(torch.ones(8, 4))
print("ran", out.full().tolist(), flush=True)
