"""The pipelined step computes no more than its bubble: the matmul FLOPs of its per-device
program are exactly ``(M + S - 1) / M`` times one stage's real work.

A stage's real work is its layers, checkpointed, forward and backward, on its ``M``
micro-batches one after another in eager torch (counted by ``FlopCounterMode``); the pipelined
step (GPipe, ``remat=True``) runs its chunk on every one of the ``M + S - 1`` iterations, so its
per-device program (``Plan.local_program``, counted by ``partita.cost.flops.node_flops``) must
hold that much and no more: no extra forward, no gradient of a bubble slot beyond the chunk's
own backward, no per-iteration work the eager baseline does not do. Counted, not timed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import partita
from partita import Mesh, P
from partita.cost.flops import node_flops

STAGES, LAYERS, WIDTH, ROWS, SEQ = 4, 8, 32, 2, 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


def _step_matmul_flops(layers: list[Block], m: int) -> int:
    mesh = Mesh.create((STAGES,), ("stage",))
    pipe = partita.pipeline(layers, mesh=mesh, microbatches=m, batch_axes=())
    weights = {n: p.detach() for n, p in pipe.stack.named_parameters()}

    def step(w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = {k: v.requires_grad_() for k, v in w.items()}
        y = torch.func.functional_call(pipe, {f"stack.{k}": v for k, v in w.items()}, (x,))
        loss = y.square().mean()
        return (loss, *torch.autograd.grad(loss, list(w.values())))

    jitted = partita.jit(step, mesh=mesh, in_specs=({n: P("stage") for n in weights}, P()))
    plan = jitted.lower(weights, torch.randn(m * ROWS, SEQ, WIDTH))
    values = plan._local_values()
    return sum(
        node_flops(node, values)
        for node in plan.local_program.graph.nodes
        if getattr(node.target, "overloadpacket", None) in flop_registry
    )


def _real_work_flops(layers: list[Block], m: int) -> int:
    mine = nn.Sequential(*layers[: LAYERS // STAGES])
    with FlopCounterMode(display=False) as counter:
        for _ in range(m):
            x = torch.randn(ROWS, SEQ, WIDTH, requires_grad=True)
            y = checkpoint(mine, x, use_reentrant=False)
            y.backward(torch.ones_like(y))
    return counter.get_total_flops()


@pytest.mark.parametrize("m", [4, 8])
def test_step_flops_are_real_work_times_the_bubble(m: int) -> None:
    torch.manual_seed(0)
    layers = [Block(WIDTH) for _ in range(LAYERS)]
    real = _real_work_flops(layers, m)
    assert real > 0
    assert _step_matmul_flops(layers, m) * m == real * (m + STAGES - 1)
