"""A linear layer's bias on the LocalMesh is its matmul's addend (``addmm``), as in the
unsharded program: a column-parallel layer's in the traced flat graph
(``runtime.flat_matmul.fuse_bias_adds``), a row-parallel layer's in the contraction over the
joined slices (``runtime.contraction``). The joined product's rows and columns are the
unsharded ones, so the sharded result equals the unsharded ``F.linear`` bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

import partita
from partita import Mesh, P
from partita.runtime.flat_matmul import broadcast_matmul

MESH = Mesh.create((2, 4), ("data", "model"))


def _linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return F.linear(x, w, b)


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    w, b = torch.randn(96, 1024, generator=g) / 32, torch.randn(96, generator=g)
    return x, w, b


def _run(specs: tuple[P, P, P]) -> tuple[Tensor, Tensor]:
    x, w, b = _inputs()
    fn = partita.jit(_linear, mesh=MESH, in_specs=specs)
    for _ in range(3):  # the segments traced flat at the second run, the step fused after
        got = fn(x, w, b)
    return got.full(), F.linear(x, w, b)


def test_a_column_parallel_bias_is_the_addend_of_its_mm() -> None:
    """Weight and bias split by output over ``model``, rows over ``data``: one ``addmm`` over
    every row and column, as ``F.linear`` computes it."""
    got, want = _run((P("data"), P("model"), P("model")))
    assert torch.equal(got, want)


def test_a_row_parallel_bias_is_the_addend_of_the_joined_mm() -> None:
    """Weight split by input over ``model`` (the product summed over ``model``), the bias
    added once: one ``addmm`` over the joined slices, as ``F.linear`` computes it."""
    got, want = _run((P("data", "model"), P(None, "model"), P()))
    assert torch.equal(got, want)


def test_broadcast_matmul_with_a_bias_equals_matmul_plus_bias() -> None:
    """The bias as the ``mm``'s addend where it varies only along ``b``'s own dims, added
    after otherwise (along ``a``'s dim, along ``M``, or with a shared batch dim)."""
    g = torch.Generator().manual_seed(1)
    cases = [
        ((2, 1, 3, 4), (1, 4, 4, 6), (1, 4, 1, 6), [2, 4]),  # along b's dim: addmm
        ((2, 1, 3, 4), (1, 4, 4, 6), (6,), [2, 4]),  # the same everywhere: addmm
        ((2, 1, 3, 4), (1, 4, 4, 6), (2, 1, 1, 6), [2, 4]),  # along a's dim: after
        ((2, 1, 3, 4), (1, 4, 4, 6), (1, 4, 3, 6), [2, 4]),  # along M: after
        ((2, 4, 3, 4), (2, 4, 4, 6), (1, 4, 1, 6), [2, 4]),  # a bmm: after
    ]
    for sa, sb, sc, batch in cases:
        a, b = torch.randn(sa, generator=g), torch.randn(sb, generator=g)
        c = torch.randn(sc, generator=g)
        want = (torch.matmul(a, b) + c).expand(*batch, sa[-2], sb[-1])
        torch.testing.assert_close(broadcast_matmul(a, b, batch, c), want)
