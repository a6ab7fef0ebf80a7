"""The "gather, compute, keep replicated" rules (linalg, FFT, plane pools, grouped and
transposed convolution): sharded results equal eager, batch dims cost no communication, and
the Plan names the op that needed each gather.

The op table (tests/test_op_table.py) runs one case per op on random specs; this module checks
the policy itself and the calls that share an op with a case there (grouped and transposed
convolutions are ``aten.convolution`` like the plain one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import partita
from partita import Mesh, P
from partita.partition.plan import Plan

aten = torch.ops.aten
MESH = Mesh.create((2, 4), ("x", "y"))


def _check(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], in_specs: Any) -> Plan:
    step = partita.jit(fn, mesh=MESH, in_specs=in_specs)
    got = step(*args)
    want = fn(*args)
    got_l = got if isinstance(got, tuple) else (got,)
    want_l = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got_l, want_l, strict=True):
        torch.testing.assert_close(g.full(), w, rtol=1e-4, atol=1e-4)
    return step.lower(*args)


def test_batched_inverse_sharded_on_batch_needs_no_collective() -> None:
    a = torch.randn(8, 3, 3) + 3 * torch.eye(3)
    plan = _check(lambda a: aten.linalg_inv_ex.default(a)[0], (a,), (P(("x", "y")),))
    assert plan.collectives == []
    assert plan.output_shardings[0].dim_axes[0] == ("x", "y")


def test_matrix_dims_are_gathered_and_the_plan_names_the_op() -> None:
    a = torch.randn(6, 5, 5) + 5 * torch.eye(5)
    plan = _check(lambda a: aten.linalg_inv_ex.default(a)[0], (a,), (P("x", "y", None),))
    kinds = {(c.kind, c.mesh_axes) for c in plan.collectives}
    assert ("all_gather", ("y",)) in kinds
    assert all("linalg_inv_ex" in c.reason for c in plan.collectives if c.kind == "all_gather")


def test_svd_raises_on_padding_so_it_is_gathered_whole() -> None:
    """A NaN in an uneven batch dim's padding would make LAPACK raise: svd gathers it all."""
    a = torch.randn(5, 4, 3)
    plan = _check(lambda a: aten._linalg_svd.default(a, False, False)[1], (a,), (P("y"),))
    assert [c.kind for c in plan.collectives] == ["all_gather"]


def test_fft_gathers_only_the_transformed_dim() -> None:
    x = torch.randn(6, 7)
    plan = _check(lambda x: aten._fft_r2c.default(x, [1], 0, True), (x,), (P("x", "y"),))
    assert [(c.kind, c.mesh_axes) for c in plan.collectives] == [("all_gather", ("y",))]
    assert plan.output_shardings[0].dim_axes[0] == ("x",)


def test_grouped_and_transposed_convolution_keep_the_batch_sharded() -> None:
    x, w, b = torch.randn(6, 4, 7, 6), torch.randn(6, 2, 3, 3), torch.randn(6)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 2)
        z = aten.convolution.default(y, w, None, [2, 1], [0, 1], [1, 1], True, [1, 0], 1)
        grads = aten.convolution_backward.default(
            y, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 2, [True, True, True]
        )
        return z, *grads

    plan = _check(fn, (x, w, b), (P("x", "y"), P("y"), None))
    assert plan.output_shardings[0].dim_axes[0] == ("x",)


def test_adaptive_pool_passes_batch_and_channels_through() -> None:
    x = torch.randn(6, 5, 7, 6)
    plan = _check(
        lambda x: aten._adaptive_avg_pool2d.default(x, [3, 2]), (x,), (P("x", "y", None, None),)
    )
    assert plan.collectives == []


def test_as_strided_reads_the_traced_storage() -> None:
    """A gathered operand's storage layout is not the user's: the as_strided handler replays
    the traced one (partition/special/strided.py)."""
    x = torch.randn(3, 3)
    step = partita.jit(lambda x: x.as_strided((2, 2), (1, 2)) * 1, mesh=MESH, in_specs=(P("y"),))
    torch.testing.assert_close(step(x).full(), x.as_strided((2, 2), (1, 2)))
