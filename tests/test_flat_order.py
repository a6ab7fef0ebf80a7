"""``runtime.flat_order``: the ops that read only a flat graph's inputs run just before their
first reader, with the same results bit for bit; an op reading an input some op writes, or
drawing random numbers, stays where it was."""

from __future__ import annotations

import random

import torch
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx

from partita.runtime.flat_order import sink_input_ops


def _order(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _update(p: Tensor, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """An AdamW-like shape: ``p * decay`` and ``v * beta2`` read only inputs, the gradient
    comes from a long computation in between."""
    decayed, kept = p * 0.99, v * 0.999
    g = (x @ x.t()).tanh() @ x  # the "backward pass"
    v2 = kept + 0.001 * g * g
    return decayed - 0.01 * g / (v2.sqrt() + 1e-8), v2


def test_input_only_ops_run_just_before_their_reader_with_the_same_results() -> None:
    args = (torch.randn(8, 4), torch.rand(8, 4), torch.randn(8, 4))
    gm = make_fx(_update)(*args)
    want = gm(*args)
    assert _order(gm)[:2] == ["mul", "mul_1"]  # traced where the program wrote them
    # p * decay, v * beta2, and 0.01 * g (computed from inputs too, read after the sqrt)
    assert sink_input_ops(gm) == 3
    order = _order(gm)
    # each now runs right before the op that reads it, after the matmuls
    assert order.index("mul_1") == order.index("add") - 1
    assert order.index("mul") == order.index("sub") - 1
    assert order.index("mm_1") < order.index("mul_1")
    for got, expected in zip(gm(*args), want, strict=True):
        assert torch.equal(got, expected)


def test_an_input_written_in_place_keeps_its_readers_in_place() -> None:
    def fn(p: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        early = p * 2  # reads p before p is written
        p.add_(1)
        return (x @ x.t()).sum() + early, p

    args = (torch.ones(3), torch.randn(3, 3))
    gm = make_fx(fn)(*[a.clone() for a in args])
    want = gm(*[a.clone() for a in args])
    assert sink_input_ops(gm) == 0
    for got, expected in zip(gm(*[a.clone() for a in args]), want, strict=True):
        assert torch.equal(got, expected)


def test_random_draws_stay_in_order() -> None:
    def fn(p: Tensor, x: Tensor) -> Tensor:
        noise = torch.rand_like(p)  # reads only an input, but draws
        return (x @ x.t()).sum() + torch.rand_like(p) + noise

    gm = make_fx(fn)(torch.ones(3), torch.randn(3, 3))
    before = _order(gm)
    sink_input_ops(gm)
    assert [n for n in _order(gm) if "rand" in n] == [n for n in before if "rand" in n]
    assert _order(gm).index("rand_like") < _order(gm).index("mm")


def _many_before_one() -> fx.GraphModule:
    """300 input-only ops, each reading ``x`` or one of the five before it, all read first by
    one op that stays (it reads a random draw): each sinks into the gap just before that
    reader, halving it; ten ops read the reader."""
    rng = random.Random(0)
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    noise = g.call_function(aten.rand_like.default, (x,))
    vals = [x]
    for k in range(300):
        a = rng.choice(vals[-5:]) if rng.random() < 0.5 else x
        vals.append(g.call_function(aten.mul.Tensor, (a, 1.0 + k % 3)))
    r = g.call_function(aten.stack.default, ([noise, *vals[1:]],))
    g.output((r, *[g.call_function(aten.add.Tensor, (r, v)) for v in rng.sample(vals[1:], 10)]))
    return fx.GraphModule(torch.nn.Module(), g)


def test_many_ops_sunk_before_one_reader_keep_the_graph_in_order() -> None:
    """Sinking hundreds of ops into one gap leaves no float between its ends: the positions
    are numbered again, so each op still goes before its first reader (``lint`` checks the
    order; with the old positions ops tied and some went after their readers)."""
    x = torch.randn(3)
    gm = _many_before_one()
    torch.manual_seed(0)
    want = gm(x)
    assert sink_input_ops(gm) > 100
    gm.graph.lint()
    torch.manual_seed(0)
    got = gm(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
