"""Auto-sharding through ``train_step``'s own spelling: a ``transformers`` family trained under
``param_specs="auto"`` equals eager, its Plan names the chosen plan; ``memory_limit`` reaches the
step by every route an option has (``options=`` as a dict or a ``CompileOptions``,
``partita.options.using``, ``PARTITA_MEMORY_LIMIT``), and a limit below every plan is a
``MemoryLimitError`` naming the smallest peak found.

Issue 28's ``train_step(..., shard="auto", memory_limit=M)`` is spelled
``train_step(..., param_specs="auto", options={"memory_limit": M})``: how parameters are split is
``param_specs`` everywhere and a knob is an option, never a keyword of one entry point
(docs/concepts.md, "Vocabulary"; ``tests/test_vocabulary.py`` keeps ``shard=`` a TypeError).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.errors import MemoryLimitError

pytest.importorskip("scipy")
pytest.importorskip("transformers")

from test_models import MODELS, build

MESH = Mesh.create((2, 4), ("data", "model"))


def test_a_llama_trains_like_eager_under_auto_and_its_plan_names_the_choice() -> None:
    model, case = build("llama"), MODELS["llama"]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    step = partita.train_step(model, case.loss, opt, mesh=MESH, param_specs="auto")
    for inputs, targets in case.batches(torch.Generator().manual_seed(0)):
        loss = step((inputs, targets))
        ref_opt.zero_grad()
        ref_loss = case.loss(ref(inputs), targets)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    full = step.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    report = step.plan.auto
    assert report is step.auto and report.chosen in {c.name for c in report.candidates}
    assert {"auto", "dp", "fsdp", "tp", "fsdp+tp"} <= {c.name for c in report.candidates}
    names = {f"param.{k}" for k, p in model.named_parameters() if p.requires_grad}
    assert names <= set(report.shardings)  # every parameter's chosen spec, by name
    for name, spec in step.param_specs.items():  # the step runs the chosen specs
        assert step.params[name].sharding.spec == spec
    assert str(step.param_specs["lm_head.weight"]) == report.shardings["param.lm_head.weight"]
    assert f"chosen: {report.chosen}" in report.explain()
    assert "auto-sharding" in step.plan.explain()


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


BATCH = (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 32))


def _lower(options: Any = None) -> partita.Plan:
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = partita.train_step(
        model, F.mse_loss, opt, mesh=MESH, param_specs="auto", options=options
    )
    return step.lower(BATCH)


@functools.cache
def _peaks() -> tuple[int, ...]:
    """Every candidate's peak without a limit (computed once)."""
    return tuple(sorted(c.peak for c in _lower().auto.candidates))


#: Each route an option has into ``train_step``: (name, lower(limit)).
ROUTES: dict[str, Callable[[int, pytest.MonkeyPatch], partita.Plan]] = {
    "options-dict": lambda m, _: _lower({"memory_limit": m}),
    "CompileOptions": lambda m, _: _lower(partita.CompileOptions(memory_limit=m)),
    "using": lambda m, _: _using(m),
    "environment": lambda m, mp: (mp.setenv("PARTITA_MEMORY_LIMIT", str(m)), _lower())[1],
}


def _using(limit: int) -> partita.Plan:
    with partita.options.using(memory_limit=limit):
        return _lower()


@pytest.mark.parametrize("route", list(ROUTES))
def test_memory_limit_reaches_train_step_by_every_route(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    peaks = _peaks()
    limit = (peaks[0] + peaks[-1]) // 2  # the biggest plan does not fit
    plan = ROUTES[route](limit, monkeypatch)
    assert plan.auto.memory_limit == limit
    assert plan.memory().peak <= limit and plan.auto.best().fits
    assert any(not c.fits for c in plan.auto.candidates)  # the limit was applied


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_memory_limit_below_every_plan_names_the_smallest_peak(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    smallest_free = _peaks()[0]
    with pytest.raises(MemoryLimitError, match=r"no plan fits memory_limit=1024 bytes") as e:
        ROUTES[route](1024, monkeypatch)
    found = re.search(r"smallest peak found is (\d+) bytes .*by the '([^']+)' plan", str(e.value))
    assert found, str(e.value)
    # the memory rounds may propose a plan smaller than the unlimited run's smallest
    assert 1024 < int(found[1]) <= smallest_free
    assert "Raise memory_limit" in str(e.value)
