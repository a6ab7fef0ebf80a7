"""``nn.LSTM`` / ``nn.GRU`` on the virtual device: their fused cells as ordinary ops.

PyTorch's recurrent layers run a step of the cell through ``aten::_thnn_fused_lstm_cell`` /
``_thnn_fused_gru_cell`` on every device but the CPU (the virtual device is PrivateUse1): CUDA
kernels, with no meta kernel (shape inference fails) and no sharding rule. On the CPU PyTorch
computes the same cell from its gates with ordinary ops; :func:`lstm_cell` and
:func:`gru_cell`, registered at the device's autograd key, do that too, so the recording holds
the additions, activations and products (sharded by their rules, differentiated by autograd)
and the layer equals the CPU's. The third/second result, the kernel's *workspace*, is read
only by the fused kernel's own backward, which is not used here; it is returned with its
shape (the activated gates) so callers that keep it see what they expect.
"""

from __future__ import annotations

import torch

__all__ = ["gru_cell", "lstm_cell"]


def _gates(gates: torch.Tensor, bias: torch.Tensor | None, n: int) -> tuple[torch.Tensor, ...]:
    return (gates if bias is None else gates + bias).chunk(n, 1)


def lstm_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    cx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM step from its gate pre-activations (gate order i, f, g, o, as PyTorch's)."""
    gates = input_gates + hidden_gates
    for bias in (input_bias, hidden_bias):
        if bias is not None:
            gates = gates + bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def gru_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    hx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GRU step from its gate pre-activations (gate order r, z, n, as PyTorch's)."""
    i_r, i_z, i_n = _gates(input_gates, input_bias, 3)
    h_r, h_z, h_n = _gates(hidden_gates, hidden_bias, 3)
    r = (i_r + h_r).sigmoid()
    z = (i_z + h_z).sigmoid()
    n = (i_n + r * h_n).tanh()
    hy = (hx - n) * z + n
    return hy, torch.cat([r, z, n, hx, h_n], 1)
