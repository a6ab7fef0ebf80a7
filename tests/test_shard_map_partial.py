"""Partially manual regions (``shard_map(..., axes=)``) whose auto axis does not divide a dim.

On a dim the region's spec leaves alone, the block's dim is the global dim, so an uneven auto
split is kept across the boundary (zero padded and masked as everywhere in partita): no gather.
On a dim the spec splits over a manual axis, an auto axis that does not divide the block cannot
be kept (padded blocks do not line up with the global tiles): the value crosses the boundary
whole over it, with a :class:`ShardMapWarning` giving the cost and the fix. Both equal the
unsharded program, values and gradients.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import ShardMapWarning
from partita.partition.manual import USER_COLLECTIVE

MESH = Mesh.create((2, 4), ("d", "m"))


def _value_and_grad(fn: Callable, x: torch.Tensor) -> tuple:
    x = x.detach().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad((out * torch.cos(out)).sum(), x)
    return out, grad


def _check(program: Callable, ref: Callable, x: torch.Tensor, spec: P) -> partita.Plan:
    """``program`` and its gradient under jit equal ``ref`` unsharded; returns the Plan."""
    step = partita.jit(lambda x: _value_and_grad(program, x), mesh=MESH, in_specs=(spec,))
    for got, want in zip(step(x), _value_and_grad(ref, x), strict=True):
        torch.testing.assert_close(got.full(), want, atol=1e-5, rtol=1e-5)
    return step.lower(x)


def test_uneven_auto_axis_on_a_dim_the_spec_leaves_alone_is_kept() -> None:
    """5 rows split over 'd' (3 + 2, padded) around and inside a region manual over 'm' on the
    columns: the body's mean over the padded rows is masked, and nothing is gathered."""

    def body(h: torch.Tensor) -> torch.Tensor:
        y = partita.psum(h.square(), "m")
        return y - y.mean(0, keepdim=True)

    region = partita.shard_map(body, mesh=MESH, in_specs=P(None, "m"), out_specs=P(), axes=["m"])

    def ref(x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x).square().reshape(5, 4, 2).sum(1)
        return (y - y.mean(0, keepdim=True)) * x.sum(1, keepdim=True)

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardMapWarning)
        plan = _check(lambda x: region(torch.tanh(x)) * x.sum(1, keepdim=True), ref, x, P("d"))
    # Before, 'd' was dropped at both boundaries: two all_gathers of the [5, 2] block.
    assert not [c for c in plan.collectives if c.kind == "all_gather"], plan.explain()
    forward_psum = next(c for c in plan.collectives if USER_COLLECTIVE in c.reason)
    assert forward_psum.shape == (3, 2)  # on the body's 'd' tile of the [5, 2] block


def test_auto_axis_not_dividing_a_manually_split_block_warns() -> None:
    """12 rows over ('m', 'd') outside a region manual over 'm' on the rows: its [3, 8] block
    cannot be split over 'd' into the global value's tiles, so a typed warning says so."""
    region = partita.shard_map(
        lambda h: torch.sin(h) * 2.0, mesh=MESH, in_specs=P("m"), out_specs=P("m"), axes=["m"]
    )
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", partita.RematerializationWarning)
        with pytest.warns(ShardMapWarning) as caught:
            _check(
                lambda x: region(torch.tanh(x)) + 1.0,
                lambda x: torch.sin(torch.tanh(x)) * 2.0 + 1.0,
                x,
                P(("m", "d")),
            )
    text = next(str(w.message) for w in caught if issubclass(w.category, ShardMapWarning))
    for part in (
        r"shard_map input 0 \(%manual_enter",  # what
        r"dim 0 of its \[3, 8\] block over \('d',\) inside",  # the values
        r"2 devices do not divide 3.*splits that dim over \('m',\).*would not line up",  # why
        r"costs here all_gather over \('m', 'd'\) of \d+ bytes per device",  # the cost
        r"make dim 0 a multiple of 8 \(pad it\), or shard another dim over \('d',\)",  # the fix
    ):
        assert re.search(part, text), (part, text)
