"""A short virtual-device training loop with the persistent compile cache (used by
tests/test_virtual_device.py in this process and in a second one).

``python virtual_cache.py CACHE_DIR`` prints one JSON line: the losses and the metrics.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn

import partita
from partita import Mesh, P

MESH = Mesh.create((2, 4), ("data", "model"))


def run(cache_dir: str | None, steps: int = 2, mesh: Mesh = MESH) -> dict:
    """Train a small MLP for ``steps`` steps on the virtual device; losses and metrics."""
    dev = partita.use_spmd(mesh, cache_dir=cache_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dev)
    partita.mark_sharding(model[0].weight, mesh, P("model", None))
    partita.mark_sharding(model[2].weight, mesh, P(None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = partita.metrics(reset=True)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8).to(dev), torch.randn(8, 4).to(dev)
        partita.mark_sharding(x, mesh, P("data", None))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        partita.sync()
        losses.append(loss.item())
    m = partita.metrics(reset=True)
    partita.metrics().__dict__.update(before.__dict__)  # the caller's counters continue
    weight = model[0].weight.cpu().tolist()
    return {"losses": losses, "compiles": m.compiles, "disk_hits": m.disk_hits, "weight": weight}


def run_compiled(steps: int = 6, mesh: Mesh = MESH) -> dict:
    """The same MLP trained by a ``partita.compile`` step (capturable AdamW): losses, the
    first weight, how many times the function ran and how many calls were replays."""
    dev = partita.use_spmd(mesh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dev)
    partita.mark_sharding(model[0].weight, mesh, P("model", None))
    partita.mark_sharding(model[2].weight, mesh, P(None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
    calls = [0]

    @partita.compile
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        x, y = x.to(dev), y.to(dev)
        partita.mark_sharding(x, mesh, P("data", None))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    before = partita.metrics(reset=True)
    g = torch.Generator().manual_seed(0)
    losses = [
        train_step(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)).item()
        for _ in range(steps)
    ]
    m = partita.metrics(reset=True)
    partita.metrics().__dict__.update(before.__dict__)
    weight = model[0].weight.cpu().tolist()
    return {
        "losses": losses,
        "weight": weight,
        "calls": calls[0],
        "replays": m.compiled_step_replays,
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
