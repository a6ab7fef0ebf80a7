"""partition/emit.py: handler code written as torch code on fx proxies emits the exact aten
overloads into the per-device graph, computes what eager torch computes, records its
collectives in the Plan, and refuses Python that per-device values cannot support."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx

from partita import Mesh
from partita.partition.emit import Emitter, node_of
from partita.partition.lower import Lowering

aten = torch.ops.aten


def _emitter() -> tuple[Lowering, Emitter]:
    mesh = Mesh.create((2,), ("x",))
    low = Lowering(fx.GraphModule(torch.nn.Module(), fx.Graph()), mesh)
    src = fx.Graph()
    op = src.call_function(aten._softmax.default, (src.placeholder("a"), 1, False))
    return low, Emitter(low, op)


def _targets(graph: fx.Graph) -> list[object]:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_torch_code_on_proxies_emits_exact_aten_overloads_and_eager_values() -> None:
    low, e = _emitter()
    x = e(low.graph.placeholder("x"))
    shifted = x - x.amax([1], True)
    ex = torch.exp(shifted)
    total = ex.sum([1], True)
    y = torch.where(total == 0, 0.0, ex / total)
    i = e.arange(6)
    j = torch.div(i, 4, rounding_mode="floor") * 10 + i.remainder(4)
    low.graph.output((node_of(y), node_of(j)))
    assert _targets(low.graph) == [
        aten.amax.default,
        aten.sub.Tensor,
        aten.exp.default,
        aten.sum.dim_IntList,
        aten.eq.Scalar,
        aten.div.Tensor,
        aten.where.ScalarSelf,
        aten.arange.default,
        aten.div.Tensor_mode,
        aten.mul.Tensor,
        aten.remainder.Scalar,
        aten.add.Tensor,
    ]
    a = torch.randn(3, 5)
    got_y, got_j = fx.GraphModule(torch.nn.Module(), low.graph)(a)
    torch.testing.assert_close(got_y, torch.softmax(a, 1), rtol=0, atol=1e-7)
    assert got_j.tolist() == [0, 1, 2, 3, 10, 11]


def test_collectives_are_explicit_calls_recorded_in_the_plan() -> None:
    low, e = _emitter()
    x = e(low.graph.placeholder("x"))
    out = e.all_reduce(x.amax([1]), ("x",), "max", shape=(3,), dtype=torch.float32, what="max")
    (node,) = [n for n in low.graph.nodes if n.target == torch.ops.partita.all_reduce.default]
    assert node is node_of(out) and node.args[1:] == ("max", ["x"], 2)
    (record,) = low.plan.collectives
    assert (record.kind, record.mesh_axes, record.shape) == ("all_reduce", ("x",), (3,))
    assert "_softmax" in record.reason and record.detail == "max, 2"


def test_padding_is_masked_with_where_only_when_the_split_is_uneven() -> None:
    low, e = _emitter()
    x = e(low.graph.placeholder("x"))
    assert e.mask_padding(x, ("x",), 6, 2, 0, -math.inf) is x  # 6 rows split evenly
    # 5 rows over 2 devices: tiles of 3; rows at or past 5 (global) get the fill.
    masked = e.mask_padding(x, ("x",), 5, 2, 0, -math.inf)
    assert _targets(low.graph) == [
        torch.ops.partita.axis_index.default,
        aten.mul.Tensor,
        aten.arange.default,
        aten.add.Tensor,
        aten.lt.Scalar,
        aten.reshape.default,
        aten.where.ScalarOther,
    ]
    assert node_of(masked).args[1:] == (x.node, -math.inf)


def test_reading_a_per_device_value_in_python_says_what_to_do() -> None:
    low, e = _emitter()
    x = e(low.graph.placeholder("x"))
    with pytest.raises(TypeError, match=r"emit: .*'getattr'.*node\.meta\['val'\]"):
        x.shape[0]
    with pytest.raises(TypeError, match=r"emit: .*'lshift'.*no aten op"):
        x << 1
