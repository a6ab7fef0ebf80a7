"""One vocabulary: one name per concept, and no deprecated spellings (see docs/concepts.md).

"plan" is the collective report (``partita.Plan``, ``step.plan``); how parameters are split is
``param_specs`` everywhere (``partita.jit``, ``partita.train_step``, ``TrainStep.param_specs``,
``partita.presets.param_specs``); the compiler's knobs are options (``options=``,
``partita.options.using``), not keywords of each entry point. The old spellings are gone, not
aliased: ``partita.plans``, ``train_step(shard=/plan=)``, ``TrainStep.step(batch)`` /
``.last_plan`` / ``.parameters()``, the training names of ``partita.models``.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
import partita.models
from partita import Mesh, P

MESH = Mesh.create((8,), ("data",))

#: The knobs that are options only (docs/options.md), never keywords of an entry point.
OPTION_KNOBS = ("strict", "replicate_unsupported", "collectives", "regather", "inductor")


def test_the_old_names_are_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("partita.plans")
    with pytest.raises(AttributeError):
        partita.plans  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("partita.models.steps")
    assert not hasattr(partita.models, "make_train_step")
    assert set(partita.models.__all__) == {"GPT", "GPTConfig", "GShardMoE", "SmallCNN"}
    for old in ("last_plan", "parameters", "step"):
        assert not hasattr(partita.TrainStep, old), old


@pytest.mark.parametrize("entry", [partita.jit, partita.train_step], ids=lambda f: f.__name__)
def test_knobs_are_options_not_keywords(entry: object) -> None:
    names = set(inspect.signature(entry).parameters)
    assert "options" in names and "param_specs" in names
    assert not names & {*OPTION_KNOBS, "shard", "plan"}, names


def test_train_step_takes_param_specs_like_jit() -> None:
    model = nn.Linear(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = partita.train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
    assert step.param_specs == {"weight": P("data", None), "bias": P("data")}
    with pytest.raises(TypeError, match="shard"):
        partita.train_step(model, F.mse_loss, opt, mesh=MESH, shard="fsdp")  # type: ignore[call-arg]
    fwd = partita.jit(model, mesh=MESH, in_specs=(P("data"),), param_specs="fsdp")
    x = torch.randn(8, 4)
    torch.testing.assert_close(fwd(x).full(), model(x))
