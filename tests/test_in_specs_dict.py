"""``in_specs`` given as a dict for positional arguments (as if keyed by parameter name) is a
CaptureError that says how to write it, not "a pytree of P(...) holds 'x' of type str"."""

from __future__ import annotations

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import CaptureError

MESH = Mesh.create((2,), ("x",))


def test_dict_in_specs_for_positional_arguments() -> None:
    step = partita.jit(lambda x: x * 2, mesh=MESH, in_specs={"x": P("x")})
    with pytest.raises(CaptureError, match=r"is a dict \('x'\).*in_specs=\(\{\.\.\.\},\)"):
        step(torch.randn(4))


def test_dict_in_specs_inside_the_tuple_still_work() -> None:
    step = partita.jit(lambda b: b["a"] * 2, mesh=MESH, in_specs=({"a": P("x")},))
    a = torch.randn(4)
    out = step({"a": a})
    assert repr(out.sharding) == "P('x')"
    torch.testing.assert_close(out.full(), a * 2)
