"""Tests of capture's decomposition table: built without the composite-op entries ``make_fx``
applies by itself, it decomposes what ``torch._decomp.core_aten_decompositions()`` does."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch._decomp import core_aten_decompositions
from torch._subclasses.functional_tensor import FunctionalTensor

from partita.capture import decompositions, trace
from partita.capture.rng import random_ops

CIA = torch._C.DispatchKey.CompositeImplicitAutograd
Table = dict[torch._ops.OpOverload, Callable[..., Any]]


def _eager_table() -> Table:
    """The table as capture built it before: the whole core table, then capture's edits."""
    table = dict(core_aten_decompositions())
    for op in (*decompositions.KEPT_OPS, *decompositions.VIEW_OPS):
        table.pop(op, None)
    table.update(decompositions.SDPA_OPS)
    table.update(decompositions.AS_STRIDED_OPS)
    table.update(decompositions.NN_KERNEL_OPS)
    table.update(decompositions.HALF_REDUCTION_OPS)
    return table


def _same_kernel(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """The same decomposition: one function, or the core table's wrapper of one op's
    composite kernel (a new ``functools.partial`` per build)."""
    if a is b:
        return True
    return (
        isinstance(a, functools.partial)
        and isinstance(b, functools.partial)
        and a.func.__code__ is b.func.__code__
        and a.args == b.args
        and a.keywords == b.keywords
    )


def test_the_table_decomposes_every_op_the_core_table_does() -> None:
    eager, table = _eager_table(), decompositions.decomposition_table()
    assert set(table) <= set(eager)
    devices = ("cpu", "cuda", "meta", "mps", "xpu", "hpu", "xla", "privateuseone")
    left_out = []
    for op, kernel in eager.items():
        if op in table:
            assert _same_kernel(table[op], kernel), op
            continue
        left_out.append(op)
        # make_fx decomposes an op it meets that is not in its table when the op is composite
        # and has no kernel for its tensors' device (proxy_call), by the same composite kernel.
        assert op._can_decompose(), op
        for device in devices:
            key = torch._C._parse_dispatch_key(torch._C._dispatch_key_for_device(device))
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (op, key)
        assert callable(op.py_kernels.get(CIA, op.decompose)), op
        assert op not in FunctionalTensor.metadata_fns and op not in random_ops(), op
    assert len(left_out) > 300  # the point: most of the core table is composite entries


def _cia_program(x: torch.Tensor, w: torch.Tensor, img: torch.Tensor) -> Any:
    """Composite ops of several kinds: with no device kernel (linear, softmax.int, layer_norm,
    flatten, chunk, expand_as), with one (matmul, dropout, upsample via ``py_impl``)."""
    h = F.linear(x, w).softmax(-1)
    h = F.layer_norm(h, (h.shape[-1],))
    a, b = h.chunk(2, dim=-1)
    m = torch.matmul(a, b.transpose(-1, -2)).flatten(1)
    d = F.dropout(m, 0.0, training=True) + m.expand_as(m)
    up = F.interpolate(img, scale_factor=2, mode="nearest")
    return d.sum() + up.mean()


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_programs_traced_with_the_table_are_those_of_the_core_table(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w, img = torch.randn(4, 6, 8), torch.randn(10, 8), torch.randn(2, 3, 4, 4)

    def fn(x: torch.Tensor, w: torch.Tensor, img: torch.Tensor) -> Any:
        if mode == "grad":
            w = w.requires_grad_()
            loss = _cia_program(x, w, img)
            return loss, torch.autograd.grad(loss, w)[0]
        context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with context:
            return _cia_program(x, w, img)

    def code() -> str:
        return trace(fn, (x, w, img)).graph_module.code

    lazy = code()
    monkeypatch.setattr(decompositions, "_table", _eager_table)
    assert code() == lazy
    assert "aten.linear" not in lazy and "aten.upsample_nearest2d" not in lazy
