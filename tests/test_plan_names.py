"""Plan.explain names each input as the user knows it (jit_signature.readable_name)."""

from __future__ import annotations

import re

import torch
from torch import nn

import partita
from partita import Mesh, P
from partita.frontend.signature import readable_name


def test_a_function_input_is_named_by_its_parameter() -> None:
    mesh = Mesh.create((2, 2), ("data", "model"))

    def mlp(x, weights, *, scale):
        return torch.relu(x @ weights["w1"]) @ weights["w2"] * scale

    specs = (P("data", None), {"w1": P(None, "model"), "w2": P("model", None)})
    step = partita.jit(mlp, mesh=mesh, in_specs=specs)
    plan = step.lower(torch.randn(8, 4), {"w1": torch.randn(4, 8), "w2": torch.randn(8, 4)},
                      scale=torch.tensor(2.0))  # fmt: skip
    text = plan.explain()
    lines = text.splitlines()
    start = lines.index("inputs:")
    assert [line.split()[0] for line in lines[start + 1 : start + 5]] == [
        "x", "weights['w1']", "weights['w2']", "scale",
    ]  # fmt: skip
    assert "  weights['w2']  P('model', None)" in text


def test_an_fsdp_gather_names_the_module_parameter() -> None:
    mesh = Mesh.create((4,), ("data",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fwd = partita.jit(model, mesh=mesh, in_specs=(P("data", None),), param_specs="fsdp")
    text = fwd.lower(torch.randn(8, 8)).explain()
    gathered = [line for line in text.splitlines() if line.strip().startswith("value:")]
    named = r"%arg\d+_1 \(parameter '\d\.(weight|bias)'\)$"
    assert any(re.search(named, line) for line in gathered), text
    assert "  args[0]" in text  # the forward's own argument, after parameters and buffers


def test_readable_name_falls_back_to_the_capture_path() -> None:
    assert readable_name("args[2]", lambda *xs: xs) == "args[2]"  # *args: no name to give
    assert readable_name("args[0][1]", max) == "args[0][1]"  # a builtin has no signature
    assert readable_name("kwargs['mask']", lambda x, mask=None: x) == "mask"
