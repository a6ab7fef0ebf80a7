"""Donated all_reduce inputs (``runtime.donate``): reduced in place only when the program reads
the input nowhere else and it shares no memory; the multi-process results are checked against
the simulated mesh by ``tests/test_distributed.py`` and ``tests/test_overlap.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from partita.ir import collectives
from partita.runtime import dist_ops
from partita.runtime.comm import Group
from partita.runtime.donate import donated_all_reduces
from partita.runtime.in_place import reuse_dead_operands

aten = torch.ops.aten


def _reduce(x: torch.Tensor) -> torch.Tensor:
    return collectives.all_reduce(x, "sum", ["model"], 2)


def _donated(fn: Any, *args: torch.Tensor) -> list[str]:
    gm = make_fx(fn)(*args)
    names = donated_all_reduces(gm.graph)
    # name each all_reduce by the op that produced its input
    return sorted(str(n.args[0].target).split(".")[1] for n in gm.graph.nodes if n.name in names)


def test_a_fresh_result_read_once_is_donated() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _reduce(torch.mm(a, a)), _reduce(torch.addmm(b, a, a))

    assert _donated(f, torch.ones(4, 4), torch.ones(4)) == ["addmm", "mm"]


def test_an_in_place_result_of_a_fresh_one_is_donated() -> None:
    """``runtime.in_place`` writes ``mm * 2`` into the matmul's result: still donated."""
    gm = make_fx(lambda a: _reduce(torch.mm(a, a) * 2))(torch.ones(4, 4))
    assert reuse_dead_operands(gm) == 1
    (name,) = donated_all_reduces(gm.graph)
    reduced = next(n for n in gm.graph.nodes if n.name == name)
    assert reduced.args[0].target is aten.mul_.Tensor


def test_an_input_read_again_or_shared_is_not_donated() -> None:
    a = torch.ones(4, 4)
    # read again after the all_reduce
    assert _donated(lambda a: (_reduce(y := torch.mm(a, a)), y + 1), a) == []
    # a view of a value that lives on, a program input, an _unsafe_view (a view all the same)
    assert _donated(lambda a: (_reduce(a.t()), a), a) == []
    assert _donated(lambda a: _reduce(a), a) == []
    gm = make_fx(lambda a: _reduce(aten._unsafe_view(torch.mm(a, a), [16])))(a)
    assert donated_all_reduces(gm.graph) == set()


class _Done:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("donate", [False, True])
def test_a_donated_all_reduce_reduces_its_input_in_place(
    monkeypatch: pytest.MonkeyPatch, donate: bool
) -> None:
    """A fake 2-rank torch (both ranks hold the same values) stands in for Gloo."""
    seen: dict[str, torch.Tensor] = {}

    def all_reduce(t: torch.Tensor, **kw: Any) -> _Done:
        seen["t"] = t
        t.mul_(2)
        return _Done()

    monkeypatch.setattr(dist_ops.dist, "all_reduce", all_reduce)
    x = torch.arange(6.0).reshape(2, 3)
    got = dist_ops.run(
        dist_ops.all_reduce(Group(None, (0, 1), (0, 1), 0), x, "sum", ["model"], "ar", donate)
    )
    torch.testing.assert_close(got, torch.arange(6.0).reshape(2, 3) * 2)
    assert (seen["t"].data_ptr() == x.data_ptr()) is donate
    assert torch.equal(x, got if donate else torch.arange(6.0).reshape(2, 3))
