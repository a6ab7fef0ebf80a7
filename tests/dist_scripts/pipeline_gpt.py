"""An 8-layer GPT whose blocks run as a pipeline (``partita.pipeline``), and its unsharded twin.

Imported by ``tests/test_pipeline_parallel.py`` (the LocalMesh); run as a script under 4
processes (``pipeline_gpt.py OUT.pt SCHEDULE [SCHEDULE ...]``) it trains the same 3 steps through
torch.distributed on mesh ``(stage=4,)`` under each schedule in turn, and rank 0 saves
``{schedule: (losses, parameters)}``, the parameters as the unsharded GPT names them.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.presets import PresetLike

CFG = GPTConfig(n_layer=8, n_head=2, d_model=32, vocab_size=64, seq_len=8)
BATCH = 16
STEPS = 3


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum: AdamW divides each gradient by its own root mean square, which turns
    # the rounding of a reordered sum in a near-zero gradient into a visible step.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def models(mesh: Mesh, microbatches: int = 4, **pipeline: Any) -> tuple[GPT, GPT, partita.Pipeline]:
    """``(pipelined model, unsharded copy, its Pipeline)`` from the same seed."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    pipe = partita.pipeline(model.blocks, mesh=mesh, microbatches=microbatches, **pipeline)
    model.blocks = pipe  # type: ignore[assignment]
    return model, ref, pipe


def train(
    mesh: Mesh, param_specs: PresetLike = "dp", microbatches: int = 4, **pipeline: Any
) -> tuple[list[float], dict[str, torch.Tensor], partita.TrainStep, partita.Pipeline]:
    """3 steps of the pipelined GPT: losses, parameters under the unsharded GPT's names."""
    model, _, pipe = models(mesh, microbatches, **pipeline)
    batch_spec = P("data") if "data" in mesh.axis_names else P()  # not the preset's axis
    step = partita.train_step(
        model,
        loss_fn,
        optimizer(model.parameters()),
        mesh=mesh,
        param_specs=param_specs,
        batch_spec=batch_spec,
    )
    losses = [float(step(b)) for b in batches()]
    return losses, unstacked(step.full_parameters(), pipe), step, pipe


def unstacked(full: dict[str, torch.Tensor], pipe: partita.Pipeline) -> dict[str, torch.Tensor]:
    """The pipelined model's parameters named as in the unsharded GPT."""
    blocks = pipe.unstack({k.removeprefix("blocks."): v for k, v in full.items()})
    out = {k: v for k, v in full.items() if not k.startswith("blocks.")}
    out.update({f"blocks.{k}": v for k, v in blocks.items()})
    return out


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same 3 steps unsharded, in plain torch."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = optimizer(ref.parameters())
    losses = []
    for ids, targets in batches():
        opt.zero_grad()
        loss = loss_fn(ref(ids), targets)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in ref.named_parameters()}


if __name__ == "__main__":
    import partita.distributed as pd

    pd.initialize()
    saved = {}
    for schedule in sys.argv[2:]:
        losses, params, _, _ = train(
            Mesh.create((4,), ("stage",)), schedule=schedule, microbatches=4
        )
        pd.log(f"pipeline {schedule}: losses {losses}")
        saved[schedule] = (losses, params)
    if pd.is_main_process():
        torch.save(saved, sys.argv[1])
