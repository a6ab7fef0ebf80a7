"""The per-step cost work (issue 32): the flat graph's ``_foreach`` groups
(``runtime.flat_foreach``), tracing early inside a loop (``flat_trace.repeated``), and the
measured breakdown of a step's CPU time (``runtime.breakdown``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx

from partita.runtime import flat_trace, ranges
from partita.runtime.breakdown import (
    CATEGORIES,
    CPU_CATEGORIES,
    OpClock,
    clocked_ranges,
    measure,
)
from partita.runtime.flat_foreach import foreach_elementwise
from partita.runtime.flat_views import fold_permutes
from partita.runtime.local import LocalMesh
from partita.values.mesh import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_foreach import adam_like as _adam_like  # the bench's AdamW-like update


def _inputs(n: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2), (7,), (4, 1), (6,), (1,), (3, 3), (8,), (2, 5)][:n]
    return [torch.rand(s, generator=g) + 0.1 for s in shapes for _ in range(4)]


def _count(gm: fx.GraphModule, name: str) -> int:
    return sum(name in str(n.target) for n in gm.graph.nodes)


def test_independent_updates_become_foreach_calls_bit_for_bit() -> None:
    args = _inputs(10)
    gm = make_fx(_adam_like, tracing_mode="fake")(*args)
    want = gm(*args)
    grouped = foreach_elementwise(gm)
    assert grouped > 0 and _count(gm, "_foreach_") > 0
    assert _count(gm, "aten.sqrt.default") == 0  # ten sqrts: one _foreach_sqrt
    got = gm(*args)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_buffer_written_through_a_view_is_read_after_the_writes() -> None:
    """The graph's inputs do not order a write through a view (``buf.select(0, 0).copy_(y)``)
    before a read of the buffer itself: the grouped ops' new order once ran that read first
    (GLM's ``tp`` step: its fused graph read a gradient buffer before its pieces were copied
    in). A member whose write a later op reads does not join a group that op feeds."""

    def fn(a: Tensor, *xs: Tensor) -> list[Tensor]:
        buf = a.new_zeros(2, 3)
        buf.select(0, 0).copy_(a * 3.0)  # a * 3.0: one depth from the end, as the others
        buf.select(0, 1).copy_(a)
        r = buf.sum()  # reads the buffer, not the copies
        return [buf, *((x + r) * 3.0 for x in xs)]

    args = [torch.rand(3) + 0.1 for _ in range(9)]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    want = gm(*args)
    grouped = foreach_elementwise(gm, from_outputs=True)
    for g, w in zip(gm(*args), want, strict=True):
        assert torch.equal(g, w)
    assert grouped == 16  # the outputs' 8 adds and 8 multiplies, not a * 3.0


def test_small_groups_stay_as_they_are() -> None:
    args = _inputs(3)  # three parameters: every group is below the threshold
    gm = make_fx(_adam_like, tracing_mode="fake")(*args)
    assert foreach_elementwise(gm) == 0
    assert _count(gm, "_foreach_") == 0


def test_large_updates_stay_per_op_small_ones_group() -> None:
    """Members over ``_MAX_BYTES`` keep their per-parameter order (grouping them streams
    every parameter's tensors through memory once per op: slower, not faster); the small
    ones of the same update still group."""
    g = torch.Generator().manual_seed(0)
    shapes = [(128, 256)] * 8 + [(16,)] * 8  # 128 KiB each, then 64 bytes each
    args = [torch.rand(s, generator=g) + 0.1 for s in shapes for _ in range(4)]
    gm = make_fx(_adam_like, tracing_mode="fake")(*args)
    want = gm(*args)
    grouped = foreach_elementwise(gm)
    assert grouped > 0
    big = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and "_foreach_" in str(n.target)
        and any(v.numel() > 16 for v in n.meta["val"])
    ]
    assert not big  # no group holds a 128 KiB member
    assert _count(gm, "aten.sqrt.default") == 8  # the large ones' sqrts stay ops
    for got, w in zip(gm(*args), want, strict=True):
        assert torch.equal(got, w)


def test_permute_chains_fold_and_identities_go() -> None:
    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        a = x.permute(2, 0, 1).permute(1, 2, 0)  # the identity, in two steps
        b = x.permute(1, 2, 0).permute(0, 2, 1).permute(-1, 0, 1)
        return a * 2, b + 1

    x = torch.randn(2, 3, 4)
    gm = make_fx(fn)(x)
    want = gm(x)
    assert fold_permutes(gm) == 4  # a: both go; b: three permutes become one
    assert _count(gm, "aten.permute") == 1
    for g, w in zip(gm(x), want, strict=True):
        assert torch.equal(g, w) and g.stride() == w.stride()


def test_a_loop_traces_segments_at_their_second_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARTITA_TRACE_FLAT_AT", raising=False)
    monkeypatch.setattr(flat_trace, "_TRACED", [1.0, 1])  # a trace costs 1 s per node
    tracer = flat_trace.FlatTracer()
    tracer.spent(0.0)
    assert not tracer.due(100)  # the cost-based choice waits
    with flat_trace.repeated():
        assert tracer.due(100)  # a loop: the second run traces
        assert not tracer.due(100, at=0)  # the option still wins
    assert not tracer.due(100)


def test_breakdown_of_a_simulated_step() -> None:
    mesh = Mesh.create((4,), ("x",))

    def fn(a: Tensor, w: Tensor) -> Tensor:
        h = (a @ w).relu().reshape(-1)
        return torch.ops.partita.all_reduce(h, "sum", ["x"], 4)

    gm = make_fx(fn)(torch.ones(8, 16), torch.ones(16, 16))
    runner = LocalMesh(mesh)
    inputs = [torch.randn(4, 8, 16), torch.randn(4, 16, 16)]
    runner.run(gm, inputs)
    split = measure(lambda: runner.run(gm, inputs), repeat=3, profiled=1)
    assert set(split.parts) == set(CATEGORIES)
    assert all(v >= 0 for v in split.parts.values())
    assert split.parts["collectives"] > 0 and split.parts["local compute"] > 0
    ops = sum(split.parts[k] for k in CPU_CATEGORIES)
    assert ops == pytest.approx(split.cpu)  # the parts split the CPU time
    assert "x floor" in split.row(split.cpu)


def test_op_clock_counts_top_level_ops_once_in_thread_cpu() -> None:
    a = torch.randn(256, 256)
    start = time.thread_time()
    with OpClock() as clock:
        (a @ a).t().contiguous()  # mm: compute; t, contiguous (and the copy inside): layout
    spent = time.thread_time() - start
    seconds = clock.seconds
    assert seconds["local compute"] > 0 and seconds["copies/layout"] > 0
    assert seconds["collectives"] == 0
    # thread CPU of the top-level ops only: within the thread's CPU of the block
    assert sum(seconds.values()) <= spent


def test_op_clock_leaves_mesh_op_ranges_to_the_range_clock() -> None:
    a = torch.randn(256, 256)
    with clocked_ranges() as in_ranges, OpClock() as clock:
        with ranges.record_function("partita.all_gather[x] 4 B #0"):
            a @ a  # inside a collective's range: the range clock's
        assert sum(clock.seconds.values()) == 0
        a @ a  # outside: local compute
        assert clock.seconds["local compute"] > 0
    assert in_ranges.seconds > 0
    assert ranges.record_function is not in_ranges  # put back


def test_op_clock_counts_partitas_attention_as_local_compute() -> None:
    """``partita.sdpa`` (the traced attention) is compute, not a collective: the whole
    ``partita`` namespace used to count as collectives, attention included."""
    q = torch.randn(2, 4, 64, 32)
    with OpClock() as clock:
        torch.ops.partita.sdpa(q, q, q, None, 0.0, True, None)
    assert clock.seconds["local compute"] > 0 and clock.seconds["collectives"] == 0
