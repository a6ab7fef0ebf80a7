"""One vocabulary: "plan" is the collective report, presets are ``shard=``, one spelling each.

The old names keep working for one deprecation cycle and say what replaces them: the module
``partita.plans`` (now ``partita.presets``), ``train_step(plan=...)`` (now ``shard=``),
``TrainStep.step(batch)`` / ``.last_plan`` / ``.parameters()`` (now ``step(batch)`` /
``.plan`` / ``.params``), and the training names of ``partita.models`` (now
``partita.training``). See docs/concepts.md, "Vocabulary".
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
import partita.models
import partita.training
from partita import Mesh, P

MESH = Mesh.create((8,), ("data",))


def test_partita_plans_is_a_deprecated_alias_of_presets() -> None:
    sys.modules.pop("partita.plans", None)
    with pytest.warns(DeprecationWarning, match=r"partita.plans is now partita.presets"):
        plans = importlib.import_module("partita.plans")
    assert plans.StandardPlan is partita.presets.StandardPreset
    assert plans.PLANS == partita.presets.PRESETS
    assert plans.param_specs is partita.presets.param_specs
    assert partita.plans is plans  # the attribute of the package still resolves
    assert "plans" not in partita.__all__ and "presets" in partita.__all__


@pytest.fixture(scope="module")
def step() -> partita.TrainStep:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return partita.train_step(model, F.mse_loss, opt, mesh=MESH, shard="dp")


def test_plan_keyword_is_a_deprecated_name_of_shard() -> None:
    model = nn.Linear(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"train_step\(plan=...\) is deprecated; use "
                      r"train_step\(shard=...\)"):  # fmt: skip
        old = partita.train_step(model, F.mse_loss, opt, mesh=MESH, plan="fsdp")
    new = partita.train_step(model, F.mse_loss, opt, mesh=MESH, shard="fsdp")
    assert old.param_specs == new.param_specs == {"weight": P("data", None), "bias": P("data")}


def test_one_spelling_per_accessor(step: partita.TrainStep) -> None:
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    assert step.plan is None
    loss = step(batch)
    assert isinstance(step.plan, partita.Plan)
    with pytest.warns(DeprecationWarning, match=r"TrainStep.last_plan is deprecated; use "
                      r"TrainStep.plan"):  # fmt: skip
        assert step.last_plan is step.plan
    with pytest.warns(DeprecationWarning, match=r"TrainStep.parameters\(\) is deprecated; use "
                      r"TrainStep.params"):  # fmt: skip
        assert step.parameters().keys() == step.params.keys()
    with pytest.warns(DeprecationWarning, match=r"TrainStep.step\(batch\) is deprecated; use "
                      r"calling the TrainStep"):  # fmt: skip
        again = step.step(batch)
    assert again < loss  # it did train: same batch, lower loss


def test_training_names_moved_out_of_models() -> None:
    with pytest.warns(DeprecationWarning, match=r"partita.models.make_train_step moved to "
                      r"partita.training.make_train_step"):  # fmt: skip
        old = partita.models.make_train_step
    assert old is partita.training.make_train_step
    import partita.models.steps as old_module

    with pytest.warns(DeprecationWarning, match=r"partita.models.steps.init_opt_state moved to "
                      r"partita.training.optim.init_opt_state"):  # fmt: skip
        assert old_module.init_opt_state is partita.training.init_opt_state
    assert set(partita.models.__all__) == {"GPT", "GPTConfig", "SmallCNN"}
