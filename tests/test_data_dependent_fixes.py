"""A call whose result shape comes from the data, or a higher-order op (``torch.cond``,
``flex_attention``), stops capture with the fix for that call.

Each case is a common PyTorch idiom that cannot be captured as written (capture runs on fake
tensors: shapes, no values). The CaptureError must name the user's line and lead with the
data-independent way to write that call (``capture/diagnose.py``), not only the generic hint,
and never surface as a crash from inside torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.errors import CaptureError

MESH = Mesh.create((2,), ("x",))
I = torch.tensor([0, 3, 1, 4, 2, 1])  # noqa: E741
X = torch.randn(6, 4)

CASES: list[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...], str]] = [
    ("one_hot", lambda i: F.one_hot(i), (I,), "Pass num_classes="),
    ("repeat_interleave", lambda x, i: x.repeat_interleave(i, 0), (X, I), "output_size="),
    ("nonzero", lambda x: torch.nonzero(x > 0), (X,), "nonzero_static"),
    ("boolean_mask", lambda x: x[x > 0], (X,), "torch.where(mask, x, 0)"),
    ("bincount", lambda i: torch.bincount(i), (I,), "known number of bins"),
    ("tensor_split", lambda x: torch.tensor_split(x, torch.tensor([1, 3])), (X,), "list of ints"),
    ("narrow", lambda x, i: x.narrow(0, i[0], 2), (X, I), "start as an int"),
    ("unique", lambda i: torch.unique(i), (I,), "distinct values"),
    ("cov", lambda x: torch.cov(x), (X,), "xm @ xm.T"),
    ("gaussian_nll", lambda x: F.gaussian_nll_loss(x, x * 0, x.abs() + 1), (X,), "clamp_min"),
]


@pytest.mark.parametrize(("fn", "args", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_data_dependent_call_names_its_fix(
    fn: Callable[..., Any], args: tuple[torch.Tensor, ...], fix: str
) -> None:
    step = partita.jit(fn, mesh=MESH, in_specs=tuple(P() for _ in args))
    with pytest.raises(CaptureError) as info:
        step(*args)
    message = str(info.value)
    assert "test_data_dependent_fixes.py:" in message  # the user's line
    assert fix in message
    assert "This is data-dependent" in message  # the reason, not "the function raised this"


def test_other_data_dependent_code_gets_the_generic_hint() -> None:
    step = partita.jit(lambda x: x * 2 if x.sum() > 0 else x, mesh=MESH, in_specs=(P(),))
    with pytest.raises(CaptureError, match=r"^Cannot trace .*This is data-dependent"):
        step(X)


def _flex(x: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    q = x.view(1, 1, 6, 4)
    return flex_attention(q, q, q)


@pytest.mark.parametrize(
    ("fn", "name", "fix"), [(_flex, "flex_attention", "sdpa")], ids=["flex_attention"]
)
def test_higher_order_op_names_itself_and_the_fix(fn: Any, name: str, fix: str) -> None:
    """Was torch's "no rule registered for HigherOrderOperator ... and mode <_CaptureMode>",
    presented as the function's own bug."""
    with pytest.raises(CaptureError) as info:
        partita.jit(fn, mesh=MESH, in_specs=(P(),))(X)
    message = str(info.value)
    assert "test_data_dependent_fixes.py:" in message
    assert f"higher-order op {name} " in message and fix in message
    assert "_CaptureMode" not in message and "itself raised" not in message


def test_take_with_a_0d_index_is_not_data_dependent() -> None:
    """torch's decomposition of take indexes with the index tensor (``flat[index]``): a 0-d
    index became a Python int, read from the data; capture decomposes it to ``index.Tensor``."""
    index = torch.tensor(7)
    step = partita.jit(lambda x, i: torch.take(x, i), mesh=MESH, in_specs=(P("x"), P()))
    torch.testing.assert_close(step(X, index).full(), torch.take(X, index))


def test_a_value_read_only_for_a_check_is_dropped() -> None:
    """``torch._check_tensor_all(cond)`` (transformers' ``torch_compilable_check``, e.g. the
    image-token count check of Llava) reads a value only for a deferred assertion: it was
    refused as data-dependent; the check is dropped, the program runs."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        torch._check_tensor_all((x > -100).all())
        return x * 2

    out = partita.jit(fn, mesh=MESH, in_specs=(P("x"),))(X)
    torch.testing.assert_close(out.full(), X * 2)


def test_a_value_used_by_the_program_is_still_refused() -> None:
    step = partita.jit(lambda x: x * x.sum().item(), mesh=MESH, in_specs=(P(),))
    with pytest.raises(CaptureError, match="data-dependent"):
        step(X)
