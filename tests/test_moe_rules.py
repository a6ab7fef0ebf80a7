"""The grouped products' rules (rules/grouped.py) beyond the op table: transformers' own
``grouped_mm_fallback`` (forward and backward) and the backward forms of ``aten._grouped_mm``,
sharded as a preset shards expert weights, equal to the unsharded program."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import partita
from partita import Mesh, P
from partita.rules import get_rule
from partita.rules import grouped as grouped_rules

pytest.importorskip("transformers")
from transformers.integrations import moe as hf_moe

MESH = Mesh.create((2, 4), ("data", "model"))
OFFS = torch.tensor([3, 3, 9, 16], dtype=torch.int32)  # 4 experts, one with no rows

SPECS = [
    (P(), P()),
    (P(None, "model"), P(None, "model", None)),  # the contracting dim split
    (P(), P("model", None, None)),  # experts split ('tp' on 3-D expert weights)
    (P("data", None), P(None, None, "model")),  # rows split, output columns split
    (P(None, "data"), P("data", "model", None)),  # fsdp+tp
]


def test_the_library_ops_find_their_rules_by_name() -> None:
    ops = torch.ops.transformers
    for op, rule in [
        (ops.grouped_mm_fallback.default, grouped_rules.grouped_mm_rule),
        (ops.grouped_mm_fallback_backward.default, grouped_rules.grouped_mm_backward_rule),
    ]:
        fn = get_rule(op)
        assert fn is not None and fn.__qualname__ == rule.__qualname__
        assert get_rule(str(op)) is fn


def _fallback_and_grads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = torch.ops.transformers.grouped_mm_fallback(x, w, offs=OFFS)
    gx, gw = torch.autograd.grad((out * out.detach().cos()).sum(), (x, w))
    return out, gx, gw


@pytest.mark.parametrize(("xs", "ws"), SPECS, ids=str)
def test_grouped_mm_fallback_and_backward_sharded_equal_unsharded(xs: Any, ws: Any) -> None:
    assert hf_moe is not None  # the import registered the library's ops
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 8, generator=g), torch.randn(4, 8, 12, generator=g)
    step = partita.jit(_fallback_and_grads, mesh=MESH, in_specs=(xs, ws))
    got = step(x, w)
    want = _fallback_and_grads(x, w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.full(), b, rtol=1e-5, atol=1e-5)


def _grouped_and_grads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``aten._grouped_mm``'s backward calls its other forms: 2-D x 2-D (the weights'
    gradient, one matrix per group) and 2-D x 3-D with transposed weights."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = torch._grouped_mm(x, w, offs=OFFS)
    gx, gw = torch.autograd.grad(out.float().sum(), (x, w))
    return out, gx, gw, torch._grouped_mm(w, w.transpose(1, 2))  # and the batched form


@pytest.mark.parametrize(("xs", "ws"), SPECS, ids=str)
def test_aten_grouped_mm_forms_sharded_equal_unsharded(xs: Any, ws: Any) -> None:
    """bfloat16 (the only dtype the op's meta kernel takes) holding -1, 0, 1: exact sums."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-1, 2, (16, 64), generator=g).to(torch.bfloat16)
    w = torch.randint(-1, 2, (4, 64, 64), generator=g).to(torch.bfloat16)
    step = partita.jit(_grouped_and_grads, mesh=MESH, in_specs=(xs, ws))
    got = step(x, w)
    want = _grouped_and_grads(x, w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.full(), b, rtol=0, atol=0)
