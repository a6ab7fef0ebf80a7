"""``capture.trace``: ``in_specs`` given as a dict for positional arguments is a CaptureError
that says how to write it (not "a pytree of P(...) holds 'x' of type str"); keyword arguments
take their specs by name (``kwarg_specs``)."""

from __future__ import annotations

import pytest
import torch

import partita
from partita import Mesh, P
from partita.capture import trace
from partita.errors import CaptureError

MESH = Mesh.create((2,), ("x",))


def test_dict_in_specs_for_positional_arguments() -> None:
    with pytest.raises(CaptureError, match=r"is a dict \('x'\).*in_specs=\(\{\.\.\.\},\)"):
        trace(lambda x: x * 2, (torch.randn(4),), in_specs={"x": P("x")}, mesh=MESH)


def test_dict_in_specs_inside_the_tuple_still_work() -> None:
    step = partita.jit(lambda b: b["a"] * 2, mesh=MESH, in_specs=({"a": P("x")},))
    a = torch.randn(4)
    out = step({"a": a})
    assert repr(out.sharding) == "P('x')"
    torch.testing.assert_close(out.full(), a * 2)


def test_trace_annotates_keyword_arguments_by_name() -> None:
    """``capture.trace(..., kwarg_specs=)``: a keyword tensor gets its spec (jit's in_specs by
    parameter name); one without a spec is replicated."""

    def fn(a: torch.Tensor, *, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return a * m + n

    x = torch.ones(4, 2)
    program = trace(
        fn, (x,), {"m": x, "n": x}, in_specs=(P(),), kwarg_specs={"m": P("x")}, mesh=MESH
    )
    sources = {a.source: repr(a.sharding) for a in program.annotations.values()}
    assert sources["in_specs for kwargs['m']"] == "P('x', None)"
    assert "in_specs for kwargs['n']" not in sources
    with pytest.raises(CaptureError, match=r"name \['k'\], which are not keyword arguments"):
        trace(fn, (x,), {"m": x, "n": x}, kwarg_specs={"k": P("x")}, mesh=MESH)
