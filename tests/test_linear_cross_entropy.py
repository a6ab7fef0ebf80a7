"""``F.linear_cross_entropy`` with ``options=`` (PyTorch's batch-chunked kernel, a Python custom
op) is traced as its implementation: forward and backward run sharded and equal eager.

Before, the op reached propagation as ``torch_nn._linear_cross_entropy_batch_chunked`` with no
rule (an UnsupportedOpError); traced through without functionalizing its implementation, the
reduction="none" variant returned the uninitialised buffer it writes into.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P

options_module = pytest.importorskip("torch.nn.modules.linear_cross_entropy_options")
MESH = Mesh.create((2, 2), ("data", "model"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_linear_cross_entropy_forward_and_backward(reduction: str) -> None:
    options = options_module.LinearCrossEntropyOptions(batch_chunk_size=3)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(10, 6, generator=g)
    t = torch.randint(0, 10, (8,), generator=g)

    def loss_and_grads(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = F.linear_cross_entropy(x, w, t, reduction=reduction, options=options)
        loss.sum().backward()
        return loss, x.grad, w.grad

    want = loss_and_grads(x, w, t)
    step = partita.jit(loss_and_grads, mesh=MESH, in_specs=(P("data"), P("model"), P("data")))
    got = step(x, w, t)
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_.full(), w_, rtol=1e-5, atol=1e-5)
