"""When the LocalMesh traces a segment to a flat graph (``runtime.flat_trace``), that each
step drops the values nothing reads after it (``SegmentPlan.frees``), and that contractions run
where their operands are complete (``runtime.step_order``)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

import partita
from partita import P
from partita.capture import trace
from partita.errors import OptionError
from partita.ir import collectives as coll
from partita.runtime import flat_trace, step_order
from partita.runtime.executor import executor_for
from partita.runtime.local import LocalMesh
from partita.runtime.segments import Segment
from partita.values.mesh import Mesh

from programs import gpt_step  # isort: skip

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
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "3")
    runner = LocalMesh(MESH)
    first = runner.run(gm, inputs)
    runner.run(gm, inputs)
    assert not any(_traced(runner, gm))
    third = runner.run(gm, inputs)
    assert all(_traced(runner, gm))
    for got, want in zip(third, first, strict=True):
        torch.testing.assert_close(got, want)
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "0")  # never
    runner = LocalMesh(MESH)
    for _ in range(4):
        runner.run(gm, inputs)
    assert not any(_traced(runner, gm))


def test_traced_once_the_eager_runs_cost_as_much(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, a segment signature is traced at the first run after its eager runs have
    cost its node count times the seconds per node traces took so far."""
    gm, inputs = _program()
    monkeypatch.delenv("PARTITA_TRACE_FLAT_AT", raising=False)
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
    monkeypatch.delenv("PARTITA_TRACE_FLAT_AT", raising=False)
    monkeypatch.setattr(flat_trace, "_TRACED", [0.0, 0])
    assert not tracer.due(0)
    tracer.spent(5.0)  # the first run is not counted
    assert not tracer.due(0) and tracer.seconds == 0.0
    tracer.spent(0.0)
    assert tracer.due(0)
    assert flat_trace.FlatTracer().due(100, at=1)  # the trace_flat_at option
    assert not flat_trace.FlatTracer().due(100, at=0)


def test_a_malformed_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "soon")
    with pytest.raises(OptionError, match="PARTITA_TRACE_FLAT_AT='soon': must be a whole number"):
        partita.options.current()


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


def _fsdp_gpt(monkeypatch: pytest.MonkeyPatch, min_chunk: int) -> tuple[list[Any], Any]:
    """A tiny GPT FSDP step on 4 devices with segments cut after ``min_chunk`` nodes."""
    monkeypatch.setattr(step_order, "_MIN_CHUNK", min_chunk)
    step, args = gpt_step(batch=4)
    mesh = Mesh.create((4,), ("d",))
    pspecs = {k: P("d") if v.shape[0] % 4 == 0 else P() for k, v in args[0].items()}
    state_specs = {k: (pspecs if isinstance(v, dict) else P()) for k, v in args[2].items()}
    in_specs = (pspecs, {k: P() for k in args[1]}, state_specs, (P("d"), P("d")))
    jitted = partita.jit(step, mesh=mesh, in_specs=in_specs)
    outs = [jitted(*args) for _ in range(3)]  # eager, traced, flat
    leaves = [[x.full() for x in pytree.tree_leaves(o)] for o in outs]
    plan = executor_for(mesh)._plan(jitted._cache[next(iter(jitted._cache))].local)
    return leaves, plan


def test_contractions_run_where_their_operands_are_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight gradient's matmul runs after the part of the backward that completes its
    operands (then they are dropped), not after the whole backward; the results are the
    same bit for bit as with the backward uncut."""
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "2")
    cut, plan = _fsdp_gpt(monkeypatch, 4)
    whole, whole_plan = _fsdp_gpt(monkeypatch, 10**9)
    for a, b in zip(cut, whole, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    kinds = ["S" if isinstance(s, Segment) else "n" for s in plan.steps]
    whole_kinds = ["S" if isinstance(s, Segment) else "n" for s in whole_plan.steps]
    assert kinds.count("S") > whole_kinds.count("S")
    # some contraction runs between two segments of the same depth
    names = [s.gm.__class__.__name__ if isinstance(s, Segment) else "" for s in plan.steps]
    assert any(
        names[i - 1] and names[i + 1] and names[i - 1].split("_")[0] == names[i + 1].split("_")[0]
        for i in range(1, len(names) - 1)
        if not names[i]
    )


def test_no_cut_between_a_multi_output_op_and_its_items() -> None:
    """A segment cut where a contraction's operands are complete never falls between an op
    with several results and a ``getitem`` of it: a segment reading the op's tuple could not
    be traced flat, so the whole step never ran fused (GLM under ``tp``: an attention
    backward's gradients)."""
    aten = torch.ops.aten
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    both = g.call_function(aten.var_mean.correction, (x, [1]))
    h = first = g.call_function(operator.getitem, (both, 0))
    for _ in range(30):
        h = g.call_function(aten.relu.default, (h,))
    mm = g.call_function(aten.mm.default, (h, w))  # complete after the relus
    second = g.call_function(operator.getitem, (both, 1))  # read only later
    g.output((mm, g.call_function(aten.add.Tensor, (second, 1))))
    nodes = [n for n in g.nodes if n.op == "call_function" and n is not mm]
    chunks = step_order.chunks_at_contractions(nodes, [mm])
    assert len(chunks) == 2 and chunks[0][1] == [mm]  # cut after the relus
    for chunk, _ in chunks:
        for n in chunk:
            if n.target is operator.getitem:
                assert n.args[0] in chunk, f"{n} in another chunk than its op"
    assert first in chunks[0][0] and second in chunks[0][0]


def _node_text(gm: fx.GraphModule) -> list[str]:
    """Each node's op, target, arguments and fake value's metadata."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        meta = (v.shape, v.stride(), v.storage_offset(), v.dtype) if isinstance(v, Tensor) else v
        out.append(f"{n.op} {n.target} {n.args} {n.kwargs} {meta}")
    return out


def test_trace_fake_gives_the_graph_make_fx_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace_fake`` (no torch-function mode, plain inputs faked from their metadata, a lazy
    GraphModule) traces the graph plain ``make_fx`` traces, on plain inputs, a view, an
    input sharing another's storage and a 0-d one; plain inputs are not logged to torch's
    structured trace, and the code is generated when the graph first runs."""
    from torch._subclasses import meta_utils
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.experimental.proxy_tensor import make_fx

    modes: list[int] = []  # torch-function modes active while tracing

    def body(a: Tensor, b: Tensor, s: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        modes.append(len(torch.overrides._get_current_function_mode_stack()))
        return a @ b + s, (c * s).sum(-1)

    fn = flat_trace.vmap_axis(body, (0, 0, None, 0), (0, 0))
    base = torch.randn(4, 6, 5)
    args = [base[:, :, 1:], torch.randn(4, 4, 3), torch.tensor(2.0), base]
    plain = [torch.randn(4, 6, 4), torch.randn(4, 4, 3), torch.ones(1), torch.randn(4, 6, 5)]
    logged: list[str] = []
    monkeypatch.setattr(meta_utils, "trace_structured", lambda name, **_: logged.append(name))
    for inputs in (args, plain):
        want = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
        assert logged  # make_fx's from_tensor logs each input
        logged.clear()
        assert modes.pop() > 0  # make_fx's TorchFunctionMetadataMode
        got = flat_trace.trace_fake(fn, inputs)
        assert modes.pop() == 0
        assert isinstance(got, _LazyGraphModule)
        assert _node_text(got) == _node_text(want)
        got.recompile()  # as a pass does: the code is not generated here...
        assert type(got).forward is _LazyGraphModule._lazy_forward
        for g, w in zip(got(*inputs), want(*inputs), strict=True):  # ...but when it runs
            assert torch.equal(g, w)
        assert got.code == want.code
    assert logged == []  # the plain inputs of the second trace
