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
through the pipeline as ``train_step`` realizes it. Then a small CNN whose convolutions
exchange halos (priced as the handler emits them, ``auto.halos``), and the report of a ``jit``
solve under ``auto_objective="bytes"``. No timing."""

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
from partita.auto.halos import halo_sends
from partita.auto.ilp import Model, Solution, build_model
from partita.auto.realize import realized_price, write_solution
from partita.auto.space import Space
from partita.cost import get_profile
from partita.models import SmallCNN

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


def _problem(monkeypatch: pytest.MonkeyPatch, step: Any, batch: Any) -> search.AutoProblem:
    """The auto problem of ``step`` on ``batch``, taken before the presets compile."""
    seen: dict[str, Any] = {}

    def stop(problem: search.AutoProblem) -> Any:
        seen["problem"] = problem
        raise _StopError

    monkeypatch.setattr(partita.auto, "choose", stop)
    with pytest.raises(_StopError):
        step.lower(batch)
    monkeypatch.undo()
    return seen["problem"]


def _sends(problem: search.AutoProblem, solver: Any, choice: list[int]) -> float:
    """The wire bytes of ``choice``'s Plan, realized through the pipeline as ``train_step``
    realizes the solver's answer."""
    sol = Solution(choice, 0.0, 0.0, 0.0, False, "given", 0, 0, 0.0, 0.0)

    def rewrite(gm: Any) -> None:
        write_solution(solver.space, choice, gm)

    return float(problem.compile(solver.specs(problem, sol), rewrite).plan.estimate().wire_bytes)


def _modelled(space: Space, pricer: Pricer, model: Model, choice: list[int]) -> float:
    """The realized price of ``choice`` in a bytes model, less the stored-bytes tie-break."""
    stored = float(model.stored @ onehot(model, choice)) * pricer.per_stored_byte
    return realized_price(space, pricer, model, choice) - stored


def _bytes_model(solver: Any) -> tuple[Pricer, Model]:
    space = solver.space
    pricer = Pricer(space.mesh, get_profile("cpu-gloo"), "bytes", stored_bytes=space.stored_bytes)
    return pricer, build_model(space, pricer, solver.model.rep)


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
    problem = _problem(monkeypatch, _step(), BATCH)
    solver = search._Solver(problem)
    space = solver.space
    pricer, model = _bytes_model(solver)
    choices = _reusing_choices(space, pricer, model)
    assert len(choices) >= 4  # at least two inputs' shardings reuse a copy somewhere
    prices = Prices(model)
    over = 0
    for choice in choices:
        sends = _sends(problem, solver, choice)
        modelled = _modelled(space, pricer, model, choice)
        assert modelled == pytest.approx(sends, abs=0.5)
        # the objective prices each reshard from the producer: above the Plan where a copy is
        # the partitioner's start (the old model's report)
        x = onehot(model, choice)
        over += prices.total(x) - float(model.stored @ x) * pricer.per_stored_byte > sends + 0.5
    assert over == len(choices) // 2  # the objective is above the Plan where a copy is reused


def test_a_windowed_ops_halo_exchanges_are_priced_as_its_plan_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small CNN on (2, 4), the all-replicated plan with one convolution (forward or
    backward) splitting its rows or columns over ``model``: the modelled wire bytes are the
    Plan's (its halo permutes and the reshards around them). Before ``auto.halos`` a halo was
    priced as two permutes of the local result, and not at all in a convolution's backward,
    whose windowed factors are also summed (its weight gradient)."""
    torch.manual_seed(0)
    cnn = SmallCNN(in_channels=3, num_classes=10, size=8, width=4).train()
    opt = torch.optim.SGD(cnn.parameters(), lr=0.1)
    mesh = Mesh.create(MESH, ("data", "model"))
    step = partita.train_step(cnn, F.cross_entropy, opt, mesh=mesh, param_specs="auto")
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    problem = _problem(monkeypatch, step, batch)
    solver = search._Solver(problem)
    space = solver.space
    pricer, model = _bytes_model(solver)
    checked: set[str] = set()
    for b, block in enumerate(space.blocks):
        if block.op is None or block.op.rule.handler != "halo" or model.rep[b] != b:
            continue
        rule = block.op.rule
        i = next(
            (
                i
                for i, assign in enumerate(block.assigns)
                if len(assign) == 1 and halo_sends(mesh, block.node, rule, assign)
            ),
            None,
        )
        if i is None:
            continue
        choice = _set([0] * len(space.blocks), model.rep, b, i)
        sends = _sends(problem, solver, choice)
        assert sends > 0
        assert _modelled(space, pricer, model, choice) == pytest.approx(sends, abs=0.5)
        checked.add(str(block.node.target))
    assert checked == {"aten.convolution.default", "aten.convolution_backward.default"}


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
