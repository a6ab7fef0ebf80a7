"""A loop whose steps keep compiling on the virtual device gets a RecompileWarning (once)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import partita
from partita import Mesh, P, RecompileWarning
from partita.frontend.recompile import RECOMPILE_WARNING_AT
from partita.virtual import recording
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture
def dev() -> torch.device:
    dev = partita.use_spmd(MESH)
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    return dev


def _steps(dev: torch.device, lengths: list[int]) -> list[warnings.WarningMessage]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).to(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in lengths:
            ids = torch.randint(0, 16, (8, length)).to(dev)
            partita.mark_sharding(ids, MESH, P("data", None))
            loss = model(ids).logsumexp(-1).mean()
            loss.backward()
            partita.sync()
    return [w for w in caught if issubclass(w.category, RecompileWarning)]


def test_a_changing_sequence_length_warns_once_with_the_reason_and_the_fix(dev) -> None:
    caught = _steps(dev, list(range(1, RECOMPILE_WARNING_AT + 4)))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert f"compiled {RECOMPILE_WARNING_AT} distinct step programs" in text
    assert re.search(r"input \d+ of the step changed from \[8, \d+\] torch.int64", text), text
    assert "pad inputs to a few fixed shapes" in text and "partita.metrics()" in text
    assert caught[0].filename == __file__  # attributed to the user's sync


def test_a_loop_that_repeats_a_few_shapes_does_not_warn(dev) -> None:
    assert _steps(dev, [4, 8, 16] * 4) == []
