"""A ``torch.compile``'d function or module given to partita is captured as written."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh, P
from partita.errors import PartitaWarning

MESH = Mesh.create((2, 2), ("data", "model"))


def _scaled_relu(a: torch.Tensor) -> torch.Tensor:
    return a.relu() * 2


def test_jit_of_a_compiled_function_traces_the_function() -> None:
    compiled = torch.compile(_scaled_relu)
    with pytest.warns(PartitaWarning, match=r"partita.jit got a torch.compile'd function "
                      r"\(_scaled_relu\).*inductor=True"):  # fmt: skip
        step = partita.jit(compiled, mesh=MESH, in_specs=(P("data", None),))
    a = torch.randn(8, 4)
    assert torch.equal(step(a).full(), _scaled_relu(a))


def test_train_step_of_a_compiled_module_keeps_the_parameter_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(PartitaWarning, match=r"train_step got a torch.compile'd module \(Sequ"):
        step = partita.train_step(torch.compile(model), F.cross_entropy, opt, mesh=MESH)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    loss = step((x, y))
    want = F.cross_entropy(ref(x), y)
    want.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert torch.allclose(loss, want, atol=1e-6)
    got = step.state_dict()["model"]
    assert sorted(got) == sorted(ref.state_dict())  # not "_orig_mod.0.weight"
    for name, value in ref.state_dict().items():
        assert torch.allclose(got[name], value, atol=1e-6), name
