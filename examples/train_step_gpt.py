"""Train partita's reference GPT with ``partita.train_step`` on 8 simulated devices.

    python examples/train_step_gpt.py [--shard fsdp+tp] [--steps 30]

The model is ordinary PyTorch; the only partita lines are the mesh, the preset and the
``train_step`` call. The same weights are trained unsharded with torch.optim beside it.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F  # noqa: N812

import partita.presets
from partita import Mesh
from partita.cli.demo import synthetic_batch
from partita.models import GPT, GPTConfig
from partita.training import train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="fsdp+tp", choices=partita.presets.PRESETS)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    mesh = Mesh.create((2, 4), ("data", "model"))
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=32, seq_len=16, bias=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    step = train_step(
        model, loss_fn, optimizer, mesh=mesh, param_specs=args.shard, max_grad_norm=1.0
    )

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=args.steps)

    gen = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        ids, targets = synthetic_batch(gen, 16, cfg.seq_len, cfg.vocab_size)
        loss = step((ids, targets))
        schedule.step()

        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(ids), targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_schedule.step()
        print(f"step {i + 1:3d}  loss {loss.item():.6f}  unsharded {ref_loss.item():.6f}")

    print(step.plan.summary())
    for key, (local, total) in step.memory().items():
        print(f"{key:<11} {local:>8} B per device, {total:>8} B unsharded")
    model.load_state_dict(step.state_dict()["model"])  # the module gets the trained weights
    diff = max(
        (p - r).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(f"largest parameter difference from torch.optim: {diff:.2e}")


if __name__ == "__main__":
    main()
