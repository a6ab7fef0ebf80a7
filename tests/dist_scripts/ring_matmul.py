"""A collective matmul written by hand: ``x @ w`` with a ring of ``ppermute`` steps.

``x`` is sharded by rows and ``w`` by columns over mesh axis ``"i"``; each device multiplies the
row block it holds by its columns of ``w``, passes the block to its right neighbour, and after
``n`` steps has every row of its column block. No device ever holds all of ``x``.

Imported by ``tests/test_shard_map.py`` (LocalMesh); run as a script under 4 processes
(``ring_matmul.py OUT.pt``) it computes the same product through torch.distributed, and rank 0
saves it.
"""

from __future__ import annotations

import sys

import torch

import partita
from partita import Mesh, P


def ring_body(x_block: torch.Tensor, w_cols: torch.Tensor) -> torch.Tensor:
    """Per device: ``x_block`` [M/n, K], ``w_cols`` [K, N/n] -> the columns [M, N/n]."""
    n = partita.axis_size("i")
    me = partita.axis_index("i")
    ring = [(j, (j + 1) % n) for j in range(n)]
    rows = x_block.shape[0]
    out = x_block.new_zeros(n, rows, w_cols.shape[1])
    for step in range(n):
        # After `step` shifts this device holds the row block of device (me - step) mod n.
        which = torch.remainder(me - step, n)
        one_hot = (torch.arange(n) == which).to(x_block.dtype)
        out = out + one_hot[:, None, None] * (x_block @ w_cols)[None]
        if step < n - 1:
            x_block = partita.ppermute(x_block, "i", ring)
    return out.reshape(n * rows, w_cols.shape[1])


def ring_matmul(mesh: Mesh) -> partita.Jitted:
    """``x @ w`` as a jitted program over ``mesh`` (one axis, ``"i"``)."""
    region = partita.shard_map(
        ring_body, mesh=mesh, in_specs=(P("i", None), P(None, "i")), out_specs=P(None, "i")
    )
    return partita.jit(region, mesh=mesh, in_specs=(P("i", None), P(None, "i")))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randn(6, 12, generator=g)


if __name__ == "__main__":
    import partita.distributed as pd

    pd.initialize()
    x, w = inputs()
    step = ring_matmul(Mesh.create((4,), ("i",)))
    out = step(x, w).full()
    kinds = sorted({c.kind for c in step.lower(x, w).collectives})
    pd.log(f"ring matmul: ok {kinds}")
    if pd.is_main_process():
        torch.save((out, kinds), sys.argv[1])
