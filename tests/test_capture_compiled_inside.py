"""A ``torch.compile``'d function or submodule inside a captured program is traced as its
Python code (capture runs under ``torch.compiler.set_stance("force_eager")``).

Before, dynamo compiled it during capture and its kernel ran on fake tensors: "Cannot access
data pointer of Tensor" from inside torch (transformers' flex-attention masks hit the same).
"""

from __future__ import annotations

import torch
from torch import nn

import partita
from partita import Mesh, P

MESH = Mesh.create((2,), ("x",))


def test_compiled_function_inside_jit() -> None:
    inner = torch.compile(lambda t: torch.sin(t) * 2)
    x = torch.randn(6, 4)
    got = partita.jit(lambda t: inner(t) + 1, mesh=MESH, in_specs=(P("x"),))(x)
    torch.testing.assert_close(got.full(), torch.sin(x) * 2 + 1)


def test_compiled_submodule_inside_jit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    model[0] = torch.compile(model[0])
    x = torch.randn(6, 4)
    got = partita.jit(model, mesh=MESH, in_specs=(P("x"),))(x)
    torch.testing.assert_close(got.full(), model(x), rtol=1e-5, atol=1e-5)
