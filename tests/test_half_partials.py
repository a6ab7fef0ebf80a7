"""float16/bfloat16 sums and means sharded over the mesh add their partials in float32.

Eager PyTorch accumulates a half-precision ``sum``/``mean`` in float32 and rounds once; the
captured program says so (``sum(x, dtype=float32).to(float16)``), so a reduction over a
sharded dim all-reduces float32 partials and rounds after. Per-device partials that overflow
float16 (+-80000 on each of two devices) then give eager's 0.0, not NaN, and every result
equals eager's up to the float32 order of the additions (one rounding step of the dtype at
most, where a float32 sum lands on a rounding tie). ``tests/op_cases.py`` holds one case per
op (float32, keyed by the op), so these half-precision variants live here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import partita
from partita import Mesh, P

MESH = Mesh.create((2, 2), ("a", "b"))

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda x: x.sum(),
    "sum.dim": lambda x: x.sum(1),
    "sum.dim keepdim": lambda x: x.sum((0, 1), keepdim=True),
    "sum dtype=half": lambda x: x.sum(0, dtype=x.dtype),
    "mean": lambda x: x.mean(),
    "mean.dim": lambda x: x.mean(0),
    "mean.dim keepdim": lambda x: x.mean(1, keepdim=True),
}
SPECS = [P("a", None), P(None, "b"), P("a", "b"), P(("a", "b"), None), P()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_half_reductions_equal_eager(op: str, dtype: torch.dtype) -> None:
    """Random values (uneven 6 x 10, some rows sharded with padding) under every layout."""
    fn = OPS[op]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = (torch.randn(6, 10, generator=g) * 300).to(dtype)
        for spec in SPECS:
            got = partita.jit(fn, mesh=MESH, in_specs=(spec,))(x).full()
            torch.testing.assert_close(got, fn(x), msg=f"{op} {spec}")  # the dtype's tolerance


def _overflowing(dtype: torch.dtype) -> torch.Tensor:
    """Halves that each sum beyond float16's 65504 (+-80000), in opposite directions."""
    return torch.tensor([[40000.0, 40000.0], [-40000.0, -40000.0]], dtype=dtype)


@pytest.mark.parametrize(
    "fn", [lambda x: x.sum(), lambda x: x.mean(), lambda x: x.sum(0), lambda x: x.mean(0)]
)
def test_overflowing_partials_give_eagers_finite_value(fn: Callable[..., Any]) -> None:
    x = _overflowing(torch.float16)
    want = fn(x)
    assert torch.isfinite(want).all()
    got = partita.jit(fn, mesh=MESH, in_specs=(P("a", None),))(x).full()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    x = torch.tensor([30000.0, 30000.0, -30000.0, -30000.0], dtype=torch.float16)  # +-60000
    got = partita.jit(lambda t: t.sum(), mesh=MESH, in_specs=(P("a"),))(x).full()
    assert got.item() == 0.0 and x.sum().item() == 0.0


def test_the_partials_move_in_float32() -> None:
    """The Plan's all_reduce of a float16 sum moves float32: 4 bytes per device for a scalar,
    8 for two values (twice float16's)."""
    x = _overflowing(torch.float16)
    plan = partita.jit(lambda t: t.sum(), mesh=MESH, in_specs=(P("a", None),)).lower(x)
    assert "all_reduce          x1    4 B per device" in plan.summary(), plan.summary()
    plan = partita.jit(lambda t: t.sum(0), mesh=MESH, in_specs=(P("a", None),)).lower(x)
    assert "x1    8 B per device" in plan.summary(), plan.summary()


def test_the_virtual_device_sums_halves_like_eager() -> None:
    dev = partita.use_spmd(MESH)
    x = _overflowing(torch.float16).to(dev)
    partita.mark_sharding(x, MESH, P("a", None))
    assert x.sum().item() == 0.0 and x.mean().item() == 0.0
    torch.testing.assert_close(x.sum(1).cpu(), _overflowing(torch.float16).sum(1))
