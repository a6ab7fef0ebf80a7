"""The modelled wire bytes of a plan equal its Plan's (issue 28) where the partitioner starts a
reshard from a copy of the value other than its producer's: a weight stored split is gathered
whole for one user and sliced from that copy for the next (``LocalValues.reshard``). The
integer program prices every reshard from the producer's sharding (``auto.links``), so there
its objective is above the Plan; the price of a plan the report gives (``auto.realize``) walks
the uses in program order and starts each reshard from the copy the partitioner picks (one
function, ``partition.resharding.reshard_source``), and equals the Plan.

The choices: on a two-layer MLP on (2, 4), the all-replicated plan with one parameter split
and one op's candidate changed, the first such pair per parameter sharding where the
objective and the realized price differ (the pair and the parameter alone), each realized
through the pipeline as ``train_step`` realizes it. Then the report of a ``jit`` solve under
``auto_objective="bytes"``. No timing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
import partita.auto
from partita import Mesh
from partita.auto import search
from partita.auto.costs import Pricer
from partita.auto.greedy import Prices, onehot
from partita.auto.ilp import Model, Solution, build_model
from partita.auto.realize import realized_price, write_solution
from partita.auto.space import Space
from partita.cost import get_profile

from test_auto_api import _MLP  # isort: skip

pytest.importorskip("scipy")

# a plan with an odd per-op choice may gather a value whole to re-tile it: the Plan says so
pytestmark = pytest.mark.filterwarnings("ignore::partita.RematerializationWarning")

MESH = (2, 4)
BATCH = (torch.randn(16, 32, generator=torch.Generator().manual_seed(0)), torch.randn(16, 32))


def _step(options: dict[str, Any] | None = None) -> Any:
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mesh = Mesh.create(MESH, ("data", "model"))
    return partita.train_step(
        model, F.mse_loss, opt, mesh=mesh, param_specs="auto", options=options
    )


class _StopError(Exception):
    pass


def _problem(monkeypatch: pytest.MonkeyPatch) -> search.AutoProblem:
    """The auto problem of the MLP's ``train_step``, taken before the presets compile."""
    seen: dict[str, Any] = {}

    def stop(problem: search.AutoProblem) -> Any:
        seen["problem"] = problem
        raise _StopError

    monkeypatch.setattr(partita.auto, "choose", stop)
    with pytest.raises(_StopError):
        _step().lower(BATCH)
    monkeypatch.undo()
    return seen["problem"]


def _set(choice: list[int], rep: list[int], b: int, i: int) -> list[int]:
    out = list(choice)
    for c in range(len(out)):
        if rep[c] == rep[b]:
            out[c] = i
    return out


def _reusing_choices(space: Space, pricer: Pricer, model: Model) -> list[list[int]]:
    """Per input block, its first sharding with a candidate of an op reading it under which
    the objective (each reshard from the producer) and the realized price (each from the
    copy the partitioner picks) differ, from the all-replicated choice: that choice, and the
    input's sharding alone. The Plans are the judges of both prices."""
    prices, rep = Prices(model), model.rep
    inputs = sorted(set(space.input_block.values()))
    members: dict[int, set[Any]] = {}
    for key, p in space.producer.items():
        members.setdefault(p, set()).add(key)
    base = [0] * len(space.blocks)
    out: list[list[int]] = []
    for b in inputs:
        for i in range(1, len(space.blocks[b])):
            split = _set(base, rep, b, i)
            for op in sorted({rep[u.block] for u in space.uses if u.value in members[b]}):
                found = next(
                    (
                        both
                        for j in range(1, len(space.blocks[op]))
                        for both in [_set(split, rep, op, j)]
                        if prices.total(onehot(model, both))
                        > realized_price(space, pricer, model, both) + 0.5
                    ),
                    None,
                )
                if found is not None:
                    out += [split, found]
                    break
            if out and out[-1][b] == i:
                break  # one sharding per input
    return out


def test_the_modelled_bytes_of_a_plan_that_reuses_a_copy_are_its_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = _problem(monkeypatch)
    solver = search._Solver(problem)
    space = solver.space
    pricer = Pricer(space.mesh, get_profile("cpu-gloo"), "bytes", stored_bytes=space.stored_bytes)
    model = build_model(space, pricer, solver.model.rep)
    choices = _reusing_choices(space, pricer, model)
    assert len(choices) >= 4  # at least two inputs' shardings reuse a copy somewhere
    prices = Prices(model)
    over = 0
    for choice in choices:
        sol = Solution(choice, 0.0, 0.0, 0.0, False, "given", 0, 0, 0.0, 0.0)

        def rewrite(gm: Any, choice: list[int] = choice) -> None:
            write_solution(space, choice, gm)

        plan = problem.compile(solver.specs(problem, sol), rewrite).plan
        sends = plan.estimate().wire_bytes
        stored = float(model.stored @ onehot(model, choice)) * pricer.per_stored_byte
        assert realized_price(space, pricer, model, choice) - stored == pytest.approx(
            sends, abs=0.5
        )
        # the objective prices each reshard from the producer: above the Plan where a copy is
        # the partitioner's start (the old model's report)
        over += prices.total(onehot(model, choice)) - stored > sends + 0.5
    assert over == len(choices) // 2  # the objective is above the Plan where a copy is reused


def test_the_report_gives_the_solvers_plan_its_plans_bytes() -> None:
    """Under ``auto_objective="bytes"`` and a memory limit that forces a split (replicated,
    the step peaks at 26,624 B per device), the report's modelled wire bytes of the solver's
    plan are its Plan's."""

    def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w1) @ w2

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 32, generator=g), torch.randn(32, 64, generator=g)]
    args.append(torch.randn(64, 32, generator=g))
    mesh = Mesh.create(MESH, ("data", "model"))
    options = {"auto_objective": "bytes", "memory_limit": 8000}
    report = partita.jit(mlp, mesh=mesh, auto=True, options=options).lower(*args).auto
    mine = next(c for c in report.candidates if c.name == "auto")
    assert mine.wire_bytes > 0
    assert report.realized_wire_bytes == pytest.approx(mine.wire_bytes, abs=0.5)
    assert report.realized_objective <= report.model_objective + 1e-6
    assert "on the wire" in report.explain()
