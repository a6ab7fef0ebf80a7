"""A rank's coordinates as constants (runtime.rank_constants): the per-device column tables
computed once, gathers by a constant run of columns as sliced copies, bit for bit. The GPT's
2-D step on 4 Gloo processes runs them in tests/test_distributed.py."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor, fx

from partita.runtime.rank_constants import (
    MAX_BYTES,
    fold_rank_constants,
    select_runs,
    slice_gathers,
)

aten = torch.ops.aten
COORD = 1  # this rank's coordinate along "model"


def _program() -> fx.GraphModule:
    """The partitioner's pattern for this rank's q|k of a fused projection split over 2
    devices: a table of every device's columns, this device's row by ``axis_index``, the
    columns gathered from a cat of this rank's and the peer's; and an ``arange`` that an op
    reading the input writes (so it must stay computed per run)."""
    g = fx.Graph()
    x = g.placeholder("x")  # [2, 3, 4]: this rank's columns
    y = g.placeholder("y")  # [2, 3, 4]: the peer's
    axis = g.call_function(torch.ops.partita.axis_index.default, (x, ["model"]))
    row = g.call_function(aten.reshape.default, (axis, [1]))
    table = g.call_function(Tensor.new_tensor, (row, [[0, 1, 4, 5], [2, 3, 6, 7]]))
    mine = g.call_function(aten.index_select.default, (table, 0, row))
    idx = g.call_function(aten.reshape.default, (mine, [-1]))
    both = g.call_function(aten.cat.default, ([x, y], 2))
    picked = g.call_function(aten.index_select.default, (both, -1, idx))
    start = g.call_function(aten.arange.default, (2,), {"dtype": torch.int64})
    offset = g.call_function(aten.mul.Tensor, (axis, 2))
    cols = g.call_function(aten.add_.Tensor, (start, offset))  # arange + 2 * coordinate
    from_x = g.call_function(aten.index_select.default, (x, 2, cols))
    total = g.call_function(aten.sum.default, (x,))
    mutable = g.call_function(aten.arange.default, (3,), {"dtype": torch.float32})
    written = g.call_function(aten.add_.Tensor, (mutable, total))  # written by a run's value
    g.output((picked, from_x, written))
    gm = fx.GraphModule(torch.nn.Module(), g)
    vals = {"x": torch.empty(2, 3, 4, device="meta"), "y": torch.empty(2, 3, 4, device="meta")}
    vals["cat_default"] = torch.empty(2, 3, 8, device="meta")
    for n in gm.graph.nodes:
        if n.name in vals:
            n.meta["val"] = vals[n.name]
    return gm


def _coordinate(axes: Sequence[str]) -> int:
    assert list(axes) == ["model"]
    return COORD


def _reference(gm: fx.GraphModule, *args: Tensor) -> tuple[Tensor, ...]:
    """``gm`` run with ``axis_index`` returning this rank's coordinate (as a rank runs it)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.target is torch.ops.partita.axis_index.default:
            n.target = _axis_index
    copy = fx.GraphModule(gm, graph)
    return tuple(copy(*args))


def _axis_index(like: Tensor, axes: Sequence[str]) -> Tensor:
    return torch.tensor(_coordinate(axes), dtype=torch.int64)


def _targets(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_rank_constants_same_bits() -> None:
    gm = _program()
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    want = _reference(gm, x, y)
    gone = fold_rank_constants(gm, _coordinate, torch.device("cpu"))
    assert gone >= 6  # axis_index, the table, its row, the column offsets
    assert slice_gathers(gm) == 2
    targets = _targets(gm)
    assert aten.index_select.default not in targets
    assert Tensor.new_tensor not in targets
    assert torch.ops.partita.axis_index.default not in targets
    assert aten.cat.default not in targets  # read by the gather only: no longer made
    for _ in range(2):  # a second run: nothing folded was written by the first
        got = gm(x, y)
        for a, b in zip(got, want, strict=True):
            assert a.is_contiguous() and a.shape == b.shape and torch.equal(a, b)
    # the arange that the run's sum writes into stays computed per run
    assert targets.count(aten.arange.default) == 1
    picked = next(n for n in gm.graph.nodes if n.target is select_runs)
    assert picked.args[2] == [(0, 2, 2), (1, 2, 2)]  # columns 2, 3 of x and 2, 3 of y


def test_select_runs_is_a_new_tensor() -> None:
    x = torch.arange(24.0).reshape(2, 3, 4)
    out = select_runs([x], 0, [(0, 0, 2)])  # the whole of dim 0: a copy, not x itself
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    two = select_runs([x, x + 100], 2, [(0, 3, 1), (1, 0, 2)])
    assert torch.equal(two, torch.cat([x, x + 100], 2).index_select(2, torch.tensor([3, 4, 5])))
    assert two.is_contiguous()


def test_nothing_known_nothing_folded() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    idx = g.call_function(aten.argmax.default, (x,))
    g.output(g.call_function(operator.getitem, (g.call_function(aten.sort.default, (x,)), 0)))
    del idx
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert fold_rank_constants(gm, _coordinate, torch.device("cpu")) == 0
    assert slice_gathers(gm) == 0


def test_a_large_value_stays_computed() -> None:
    """A constant larger than MAX_BYTES is not held between steps; a small one is."""
    g = fx.Graph()
    x = g.placeholder("x")
    big = g.call_function(aten.zeros.default, ([MAX_BYTES // 4 + 1],), {"dtype": torch.float32})
    small = g.call_function(aten.zeros.default, ([4],), {"dtype": torch.float32})
    g.output(
        (g.call_function(aten.add.Tensor, (big, x)), g.call_function(aten.add.Tensor, (small, x)))
    )
    gm = fx.GraphModule(torch.nn.Module(), g)
    fold_rank_constants(gm, _coordinate, torch.device("cpu"))
    assert [n.target for n in gm.graph.nodes].count(aten.zeros.default) == 1  # the large one
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 1  # the small one, held
    out = gm(torch.ones(()))
    assert torch.equal(out[0], torch.ones(MAX_BYTES // 4 + 1))
    assert torch.equal(out[1], torch.ones(4))
