"""When the LocalMesh traces a segment to a flat graph (``runtime.flat_trace``), and that each
step drops the values nothing reads after it (``SegmentPlan.frees``)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, fx

from partita import collectives as coll
from partita.capture import trace
from partita.errors import JitArgumentError
from partita.mesh import Mesh
from partita.runtime import flat_trace
from partita.runtime.local import LocalMesh
from partita.runtime.segments import Segment

MESH = Mesh.create((2, 2), ("x", "y"))


def _program() -> tuple[fx.GraphModule, list[Tensor]]:
    def fn(a: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        h = (a @ w).relu()
        g = coll.all_reduce(h, "sum", ["y"], 2)
        return (g * 2).sum(-1), (a.exp() + 1).mean(-1)

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(4, 3, 5, generator=g), torch.randn(5, 6, generator=g)
    gm = trace(fn, (a[0], w)).graph_module
    return gm, [a, w.expand(4, 5, 6)]


def _traced(runner: LocalMesh, gm: fx.GraphModule) -> list[bool]:
    segments = [s for s in runner._plans[gm].steps if isinstance(s, Segment)]
    return [any(isinstance(f, fx.GraphModule) for f in s.flat.values()) for s in segments]


def test_traced_at_the_run_the_setting_names(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = _program()
    monkeypatch.setenv(flat_trace.TRACE_AT_ENV, "3")
    runner = LocalMesh(MESH)
    first = runner.run(gm, inputs)
    runner.run(gm, inputs)
    assert not any(_traced(runner, gm))
    third = runner.run(gm, inputs)
    assert all(_traced(runner, gm))
    for got, want in zip(third, first, strict=True):
        torch.testing.assert_close(got, want)
    monkeypatch.setenv(flat_trace.TRACE_AT_ENV, "0")  # never
    runner = LocalMesh(MESH)
    for _ in range(4):
        runner.run(gm, inputs)
    assert not any(_traced(runner, gm))


def test_traced_once_the_eager_runs_cost_as_much(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, a segment signature is traced at the first run after its eager runs have
    cost its node count times the seconds per node traces took so far."""
    gm, inputs = _program()
    monkeypatch.delenv(flat_trace.TRACE_AT_ENV, raising=False)
    monkeypatch.setattr(flat_trace, "_TRACED", [1.0, 1])  # a trace costs 1 s per node
    runner = LocalMesh(MESH)
    first = runner.run(gm, inputs)
    for _ in range(3):
        runner.run(gm, inputs)
    assert not any(_traced(runner, gm))  # milliseconds spent, seconds expected
    monkeypatch.setattr(flat_trace, "_TRACED", [1e-12, 10**12])  # nearly free
    again = runner.run(gm, inputs)
    assert all(_traced(runner, gm))
    for got, want in zip(again, first, strict=True):
        torch.testing.assert_close(got, want)
    seconds, nodes = flat_trace._TRACED  # the traces just made calibrate the estimate
    assert nodes > 10**12 and seconds > 1e-12


def test_the_first_two_runs_are_not_traced_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    tracer = flat_trace.FlatTracer()
    monkeypatch.delenv(flat_trace.TRACE_AT_ENV, raising=False)
    monkeypatch.setattr(flat_trace, "_TRACED", [0.0, 0])
    assert not tracer.due(0)
    tracer.spent(5.0)  # the first run is not counted
    assert not tracer.due(0) and tracer.seconds == 0.0
    tracer.spent(0.0)
    assert tracer.due(0)
    monkeypatch.setenv(flat_trace.TRACE_AT_ENV, "1")
    assert flat_trace.FlatTracer().due(100)


def test_a_malformed_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flat_trace.TRACE_AT_ENV, "soon")
    with pytest.raises(JitArgumentError, match="whole number"):
        flat_trace.trace_at()


def test_each_step_drops_what_nothing_reads_later() -> None:
    """``frees`` names every value once, at its last reader, never a graph output."""
    gm, inputs = _program()
    runner = LocalMesh(MESH)
    runner.run(gm, inputs)
    plan = runner._plans[gm]
    freed = [n for f in plan.frees for n in f]
    assert len(freed) == len(set(freed))
    outputs = {n for n in gm.graph.nodes if n.op == "output"}.pop().all_input_nodes
    assert not set(outputs) & set(freed)
    assert set(plan.placeholders) <= set(freed)
    for i, frees in enumerate(plan.frees):
        later = plan.steps[i + 1 :]
        for node in frees:
            assert not any(
                node in (s.inputs if isinstance(s, Segment) else s.all_input_nodes) for s in later
            )
    assert len(plan.frees) == len(plan.steps)
