"""The PyTorch/XLA-style device loop fed by per-host data (tests/test_device_loop_dist.py).

``python device_loop.py DATA MODEL`` trains a small MLP for 3 steps on the virtual device of a
``(DATA, MODEL)`` mesh. Each process's loader yields only the rows of the global batch its
device holds (``process_slice``), and ``GlobalBatchLoader(..., device=dev)`` puts them on the
device. Run alone, the one process loads the whole batch; under torch.distributed (one process
per device) each loads its own rows. Prints one JSON line per process: the losses, the rows it
read, and the bytes it put on the device during the loop (``partita.metrics().upload_bytes``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.data import GlobalBatchLoader, process_slice

GLOBAL_BATCH, STEPS = 16, 3


def main(data: int, model_axis: int) -> dict:
    if "RANK" in os.environ:
        pd.initialize()
    mesh = Mesh.create((data, model_axis), ("data", "model"))
    dev = partita.use_spmd(mesh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dev)
    partita.mark_sharding(model[0].weight, mesh, P("model", None))
    partita.mark_sharding(model[2].weight, mesh, P(None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
        for _ in range(STEPS)
    ]
    read: list[list[int]] = []

    def my_rows() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """What a per-host DataLoader yields: only this process's rows (a copy, as loaded)."""
        for x, y in batches:
            rows = process_slice(x.shape, mesh, P("data"))[0]
            read.append([rows.start, rows.stop])
            yield x[rows].clone(), y[rows].clone()

    partita.metrics(reset=True)
    losses, shards = [], []
    for xb, yb in GlobalBatchLoader(my_rows(), mesh, P("data"), device=dev):
        assert xb.device == dev and tuple(xb.shape) == (GLOBAL_BATCH, 8)
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        # the devices whose shards this process holds: a batch it uploaded, a replicated bias
        shards = [[s.device for s in t.local_shards] for t in (xb, model[0].bias)]
    return {
        "rank": pd.process_index(),
        "losses": losses,
        "read": read,
        "upload_bytes": partita.metrics().upload_bytes,
        "shards": shards,
        "compiles": partita.metrics().compiles,
        "recompiled": partita.metrics().recompile_reasons,
    }


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]))
    # One write of the whole line: under torchrun the ranks share one pipe, and a line printed in
    # two writes can interleave with another rank's (atomic below PIPE_BUF, 4096 bytes).
    sys.stdout.flush()
    os.write(1, (json.dumps(result) + "\n").encode())
    if "RANK" in os.environ:
        pd.barrier()
