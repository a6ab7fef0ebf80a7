"""An MLP FSDP train step on 2 processes, per-device programs compiled by Inductor and not.

Usage (2 processes): compiled_programs.py OUT.pt. Rank 0 saves ``{"plain": (losses, params),
"compiled": (losses, params), "stats": (regions, skipped), "memory": TrainStep.memory()}`` for
``tests/test_compiled_programs.py`` to compare.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F  # noqa: N812

import partita
import partita.distributed as pd
from partita import Mesh

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def run(inductor: bool) -> tuple[list[float], dict[str, torch.Tensor], partita.TrainStep]:
    model = copy.deepcopy(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = Mesh.create((2,), ("data",))
    step = partita.train_step(
        model,
        F.mse_loss,
        opt,
        mesh=mesh,
        param_specs="fsdp",
        options={"inductor": inductor},
    )
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))
        losses.append(float(step(batch)))
    return losses, step.full_parameters(), step


pd.initialize()
plain = run(False)
compiled = run(True)
stats = compiled[2].stats
if pd.is_main_process():
    torch.save(
        {
            "plain": plain[:2],
            "compiled": compiled[:2],
            "stats": (stats.inductor_regions, stats.skipped),
            "memory": plain[2].memory(),
        },
        sys.argv[1],
    )
