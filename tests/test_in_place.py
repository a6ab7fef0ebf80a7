"""Elementwise ops written into an operand that dies there (runtime.in_place): the same results
bit for bit, fewer new tensors, and nothing written that another value reads or shares."""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from partita.runtime.in_place import reuse_dead_operands
from partita.runtime.overlap import _live_bytes

aten = torch.ops.aten


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor):
    """The functional AdamW update of training.optim (one tile), ``s`` a 0-d step size."""
    p2 = p * 0.99
    m2 = m + s * (g - m)
    v2 = v * 0.999 + 0.001 * g * g
    denom = torch.sqrt(v2) / 0.5 + 1e-8
    return p2 - s * (m2 / denom), m2, v2


def _args() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = (torch.randn(64, 32, generator=gen) for _ in range(4))
    return [p, g, m, v.abs(), torch.tensor(0.01)]


class _NewStorages(TorchDispatchMode):
    """How many ops return a tensor of new memory (not an input's, as an in-place op does)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        self.count += isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in ins
        return out


def _news(gm: fx.GraphModule, args: list[torch.Tensor]) -> int:
    mode = _NewStorages()
    with mode:
        gm(*args)
    return mode.count


def test_adamw_same_bits_fewer_tensors() -> None:
    args = _args()
    gm = make_fx(_adamw)(*args)
    want, before = gm(*args), _news(gm, args)
    assert reuse_dead_operands(gm) == 8
    kept = [a.clone() for a in args]
    got = gm(*args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(args, kept, strict=True):  # the inputs (the caller's state) not written
        assert torch.equal(a, b)
    assert (before, _news(gm, args)) == (14, 6)
    # the product with the 0-d step size, dead operand second, runs as its in-place form
    assert sum(n.target is aten.mul_.Tensor for n in gm.graph.nodes) == 3


def _rewritten(fn, *args: torch.Tensor) -> list[str]:  # type: ignore[no-untyped-def]
    gm = make_fx(fn)(*args)
    want = fn(*args)
    reuse_dead_operands(gm)
    got = gm(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):  # fmt: skip
        assert torch.equal(a, b)
    return [str(n.target) for n in gm.graph.nodes if str(n.target).endswith("_.Tensor")]


def test_shared_or_promoted_operands_not_written() -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    # read again later, viewed, an input, promoted to float64, broadcast: none written
    assert _rewritten(lambda a, b: ((t := a * 2) + b, t), x, y) == []
    assert _rewritten(lambda a, b: ((t := a * 2) + b, t.t()), x, y) == []
    assert _rewritten(lambda a, b: a.t() + b, x, y) == []
    assert _rewritten(lambda a, b: (a * 2) + b, x, y.double()) == []
    assert _rewritten(lambda a, b: (a[0] * 2) + b, x, y) == []
    assert _rewritten(lambda a, b: (t := a * 2) * t, x, y) == []  # read twice by one op
    assert _rewritten(lambda a, b: (a * 2) + b, x, y) == ["aten.add_.Tensor"]


def test_not_commutative_second_operand_not_written() -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    assert _rewritten(lambda a, b: b - (a * 2), x, y) == []
    assert _rewritten(lambda a, b: b / (a * 2), x, y) == []
    assert _rewritten(lambda a, b: b * (a * 2), x, y) == ["aten.mul_.Tensor"]


def test_overlap_counts_in_place_result_with_its_operand() -> None:
    gm = make_fx(lambda a, b: (a * 2 + b).sqrt())(torch.ones(3), torch.ones(3))
    assert reuse_dead_operands(gm) == 2
    nodes = list(gm.graph.nodes)
    size_of = {n: 1 for n in nodes if n.op != "output"}
    # the two inputs and one new tensor: a.mul's, which add_ and sqrt_ write again
    assert max(_live_bytes(nodes, size_of)) == 3
