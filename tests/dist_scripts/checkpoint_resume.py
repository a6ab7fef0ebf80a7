"""One rank of ``test_checkpoint.test_gloo_resume_and_save`` (4 processes, Gloo).

    python checkpoint_resume.py <checkpoint saved on (2, 4) fsdp+tp> <output dir>

Loads the checkpoint on (4,) under fsdp, trains the 3 steps the uninterrupted run trained
(rank 0 writes the losses), saves to ``<out>/final``, then saves again with rank 2's writer
failing: every rank must get a CheckpointError and ``final`` must still load to the same
values (rank 0 writes ``failed_save.txt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F  # noqa: N812

import partita.checkpoint as ckpt
import partita.distributed as pd
from partita import Mesh
from partita.errors import CheckpointError
from partita.models import GPT, GPTConfig
from partita.training import train_step

CFG = GPTConfig(n_layer=1, n_head=4, d_model=16, vocab_size=32, seq_len=8, bias=False)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def fresh(mesh: Mesh):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return train_step(model, loss_fn, opt, mesh=mesh, param_specs="fsdp"), sched


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    pd.initialize()
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(5):
        ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
        data.append((ids, torch.roll(ids, -1, 1)))
    mesh = Mesh.create((4,), ("data",))
    step, sched = fresh(mesh)
    assert ckpt.load(step, src, scheduler=sched) == {"position": 2, "name": "run-a"}
    losses = []
    for batch in data[2:]:
        losses.append(float(step(batch)))
        sched.step()
    if pd.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        torch.save(losses, out / "losses.pt")
    ckpt.save(step, out / "final", scheduler=sched)
    want = step.full_parameters()

    real = dcp.FileSystemWriter.write_data

    def failing(self, plan, planner):
        if pd.process_index() == 2:
            raise OSError("rank 2: disk full (injected)")
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = failing  # type: ignore[method-assign]
    step(data[0])  # the state moves on; the failed save must not reach "final"
    try:
        ckpt.save(step, out / "final")
    except CheckpointError as e:
        assert "disk full (injected)" in str(e), e
    else:
        raise SystemExit("the save with a failing rank did not raise")
    dcp.FileSystemWriter.write_data = real  # type: ignore[method-assign]
    again, _ = fresh(mesh)
    ckpt.load(again, out / "final")
    got = again.full_parameters()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    pd.barrier()
    if pd.is_main_process():
        (out / "failed_save.txt").write_text("CheckpointError on every rank; reloaded")
    pd.shutdown()


if __name__ == "__main__":
    main()
