"""Op-table cases of the rules added for PyTorch's op database: special functions and other
elementwise ops, whole-tensor and order-statistic reductions, vector norms, diagonals, repeats,
distances and lookups, ops gathered whole, the remaining random distributions.

Imported at the end of ``op_cases`` (it registers into the same ``CASES``); data only, like
``op_cases``. Sizes are uneven on purpose (5, 6, 7). Linear algebra and FFTs are in
``op_cases_linalg``, pools, interpolations and grid sampling (forward and backward) in
``op_cases_plane`` (both imported at the end).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from op_cases import R, case, f, ints, pos, small_ints_f, unit  # isort: skip

aten = torch.ops.aten

L = {"tol": "loose"}

# --- elementwise: special functions and friends -----------------------------------------------

for _op, _mk in [
    (aten.digamma.default, pos(6, 5)),
    (aten.erfc.default, f(6, 5)),
    (aten.i0.default, f(6, 5)),
    (aten.lgamma.default, pos(6, 5)),
    (aten.signbit.default, f(6, 5)),
    (aten.angle.default, f(6, 5)),
    (aten.special_airy_ai.default, f(6, 5)),
    (aten.special_bessel_j0.default, f(6, 5)),
    (aten.special_bessel_j1.default, f(6, 5)),
    (aten.special_bessel_y0.default, pos(6, 5)),
    (aten.special_bessel_y1.default, pos(6, 5)),
    (aten.special_erfcx.default, f(6, 5)),
    (aten.special_i0e.default, f(6, 5)),
    (aten.special_i1.default, f(6, 5)),
    (aten.special_i1e.default, f(6, 5)),
    (aten.special_modified_bessel_i0.default, f(6, 5)),
    (aten.special_modified_bessel_i1.default, f(6, 5)),
    (aten.special_modified_bessel_k0.default, pos(6, 5)),
    (aten.special_modified_bessel_k1.default, pos(6, 5)),
    (aten.special_ndtri.default, lambda g: torch.rand(6, 5, generator=g) * 0.9 + 0.05),
    (aten.special_scaled_modified_bessel_k0.default, pos(6, 5)),
    (aten.special_scaled_modified_bessel_k1.default, pos(6, 5)),
    (aten.special_spherical_bessel_j0.default, f(7, 5)),
]:
    case(_op, (lambda op: lambda x: op(x))(_op), _mk, **L)

case(
    aten._conj.default,
    lambda x, y: aten._conj.default(torch.complex(x, y)).resolve_conj(),
    f(7, 5),
    f(7, 5),
)
case(
    aten._conj_physical.default,
    lambda x, y: aten._conj_physical.default(torch.complex(x, y)),
    f(6, 5),
    f(6, 1),
)
case(aten.polygamma.default, lambda x: aten.polygamma.default(2, x), pos(6, 5), **L)
case(aten.round.decimals, lambda x: aten.round.decimals(x * 100, decimals=1), f(6, 5))
case(aten.frexp.Tensor, lambda x: aten.frexp.Tensor(x), f(7, 5))

# polynomials: x and a small integer degree n, broadcast
for _op in [
    aten.special_chebyshev_polynomial_t.default,
    aten.special_chebyshev_polynomial_u.default,
    aten.special_chebyshev_polynomial_v.default,
    aten.special_chebyshev_polynomial_w.default,
    aten.special_hermite_polynomial_h.default,
    aten.special_hermite_polynomial_he.default,
    aten.special_laguerre_polynomial_l.default,
    aten.special_legendre_polynomial_p.default,
    aten.special_shifted_chebyshev_polynomial_t.default,
    aten.special_shifted_chebyshev_polynomial_u.default,
    aten.special_shifted_chebyshev_polynomial_v.default,
    aten.special_shifted_chebyshev_polynomial_w.default,
]:
    case(
        _op,
        (lambda op: lambda x, n: op(x, n))(_op),
        unit(6, 5),
        lambda g: torch.randint(0, 4, (5,), generator=g).float(),
        **L,
    )

for _op, _mx, _my in [
    (aten.copysign.Tensor, f(6, 5), f(5)),
    (aten.fmax.default, f(6, 5), f(6, 1)),
    (aten.fmin.default, f(6, 5), f(5)),
    (aten.hypot.default, f(6, 5), f(6, 5)),
    (aten.nextafter.default, f(6, 5), f(5)),
    (aten.igamma.default, pos(6, 5), pos(5)),
    (aten.igammac.default, pos(6, 5), pos(6, 1)),
    (aten.special_zeta.default, lambda g: torch.rand(6, 5, generator=g) + 1.5, pos(5)),
    (aten.ldexp.Tensor, f(6, 5), lambda g: torch.randint(-3, 4, (5,), generator=g)),
    (aten.complex.default, f(6, 5), f(6, 5)),
    (aten.polar.default, pos(6, 5), f(6, 5)),
]:
    case(_op, (lambda op: lambda x, y: op(x, y))(_op), _mx, _my, **L)

# --- reductions ---------------------------------------------------------------------------------

case(aten.max.default, lambda x: aten.max.default(x), f(7, 5))
case(aten.min.default, lambda x: aten.min.default(x), f(6, 5))
case(aten.prod.default, lambda x: aten.prod.default(x), pos(6, 5), **R)
case(aten.median.default, lambda x: aten.median.default(x), f(7, 5))
case(aten.nanmedian.default, lambda x: aten.nanmedian.default(x), f(6, 5))
case(aten.median.dim, lambda x: aten.median.dim(x, 1), f(6, 5))
case(aten.nanmedian.dim, lambda x: aten.nanmedian.dim(x, 0, True), f(7, 5))
case(aten.kthvalue.default, lambda x: aten.kthvalue.default(x, 2, 1), f(6, 5))
case(aten.mode.default, lambda x: aten.mode.default(x, 0), small_ints_f(7, 5))


def _vector_norms(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every ord the rule distinguishes: 1 and 0 (sums), -inf (a min), 2 and inf (gathered)."""
    ords = [(1, False), (0, True), (float("-inf"), False), (2, False)]
    every_dim = aten.linalg_vector_norm.default(x, float("inf"))
    return (*(aten.linalg_vector_norm.default(x, o, [1], k) for o, k in ords), every_dim)


case(aten.linalg_vector_norm.default, _vector_norms, f(6, 7), partial=True, **R)

# --- shape ---------------------------------------------------------------------------------------

case(aten.diagonal.default, lambda x: aten.diagonal.default(x, 1, 0, 2) * 1, f(6, 7, 5))
case(aten.diagonal_copy.default, lambda x: aten.diagonal_copy.default(x, -1), f(7, 6))
case(
    aten.diagonal_scatter.default,
    lambda x, s: aten.diagonal_scatter.default(x, s, 0, 1, 2),
    f(7, 5, 6),
    f(7, 5),
)
case(aten.repeat.default, lambda x: aten.repeat.default(x, [2, 1, 3]), f(6, 5), partial=True)
case(aten.narrow_copy.default, lambda x: aten.narrow_copy.default(x, 1, 1, 3), f(6, 5))
case(aten.view_as_complex.default, lambda x: aten.view_as_complex.default(x * 1), f(6, 5, 2))
case(
    aten.view_as_real.default,
    lambda x, y: aten.view_as_real.default(torch.complex(x, y)) * 1,
    f(6, 5),
    f(6, 5),
)
case(
    aten.view.dtype,  # the same element size, and complex64 (pairs of the last dim)
    lambda x: (
        aten.view.dtype(x * 1, torch.int32) * 1,
        torch.view_as_real(aten.view.dtype(x * 1, torch.complex64)) * 1,
    ),
    f(6, 4),
)
# as_strided reads storage: a window over a transposed value must read the trace's layout
case(
    aten.as_strided.default,
    lambda x: aten.as_strided.default((x * 1).t(), [4, 3], [2, 1], 1),
    f(6, 5),
)
case(
    aten.as_strided_copy.default,
    lambda x: aten.as_strided_copy.default(x * 1, [5, 4], [5, 1], 3),
    f(6, 5),
)
case(
    aten.as_strided_scatter.default,
    lambda x, y: aten.as_strided_scatter.default((x * 1).t(), y, [3, 2], [1, 5], 2),
    f(6, 5),
    f(3, 2),
)

# --- matmul ---------------------------------------------------------------------------------------

case(
    aten.addmv.default,
    lambda c, a, v: aten.addmv.default(c, a, v, beta=0.5, alpha=2.0),
    f(6),
    f(6, 5),
    f(5),
    **R,
)
case(
    aten.addbmm.default,
    lambda c, a, b: aten.addbmm.default(c, a, b),
    f(6, 7),
    f(3, 6, 5),
    f(3, 5, 7),
    **R,
)

# --- distances and lookups ------------------------------------------------------------------------

case(
    aten._cdist_forward.default,
    lambda a, b: aten._cdist_forward.default(a, b, 2.0, None),
    f(2, 6, 5),
    f(2, 7, 5),
    **L,
)
case(aten._pdist_forward.default, lambda a: aten._pdist_forward.default(a, 2.0), f(6, 5), **L)
case(aten.dist.default, lambda a, b: aten.dist.default(a, b, 3), f(6, 5), f(5), **L)
case(
    aten._trilinear.default,
    lambda a, b, c: aten._trilinear.default(a, b, c, [1, 3], [0], [1, 2], [2, 3]),
    f(6, 5),
    f(7, 5, 4),
    f(6, 4),
    **L,
)
case(
    aten.bucketize.Tensor,
    lambda x, bnd: aten.bucketize.Tensor(x, bnd),
    f(6, 5),
    lambda g: torch.randn(7, generator=g).sort()[0],
)
case(
    aten.searchsorted.Tensor,
    lambda s, x: aten.searchsorted.Tensor(s, x, right=True),
    lambda g: torch.randn(6, 7, generator=g).sort(-1)[0],
    f(6, 5),
)

# --- norms, random --------------------------------------------------------------------------------

case(
    aten._batch_norm_with_update_functional.default,
    lambda x, w, b, rm, rv: aten._batch_norm_with_update_functional.default(
        x, w, b, rm, rv, 0.1, 1e-5
    ),
    f(6, 3, 5),
    pos(3),
    f(3),
    f(3),
    pos(3),
    **L,
)

RND = {"random": True}
case(aten.cauchy.default, lambda x: aten.cauchy.default(x), f(6, 5), **RND)
case(aten.exponential.default, lambda x: aten.exponential.default(x, 2.0), f(7, 5), **RND)
case(aten.geometric.default, lambda x: aten.geometric.default(x, 0.3), f(6, 5), **RND)
case(aten.log_normal.default, lambda x: aten.log_normal.default(x), f(6, 5), **RND)
_RANDOM_FROM = getattr(aten.random, "from")  # `from` is a Python keyword
case(_RANDOM_FROM, lambda x: _RANDOM_FROM(x, 0, 7), f(6, 5), **RND)
case(aten.random.to, lambda x: aten.random.to(x, 7), f(6, 5), **RND)
case(aten.random.default, lambda x: aten.random.default(x.to(torch.int32)), f(6, 5), **RND)

# --- gathered whole, and index_reduce -------------------------------------------------------------

case(
    aten.index_reduce.default,
    lambda x, i, s: aten.index_reduce.default(x, 0, i, s, "amax", include_self=False),
    f(6, 5),
    lambda g: torch.randint(0, 6, (7,), generator=g),
    f(7, 5),
)
case(
    aten._embedding_bag_forward_only.default,
    lambda w, i, o: aten._embedding_bag_forward_only.default(w, i, o, False, 1),
    f(10, 5),
    lambda g: torch.randint(0, 10, (7,), generator=g),
    lambda g: torch.tensor([0, 2, 2, 5]),
)
case(
    aten.histogram.bin_ct,
    lambda x, w: aten.histogram.bin_ct(x, 7, range=[-2.0, 2.0], weight=w),
    f(6, 5),
    pos(6, 5),
    **R,
)
case(
    aten._histogramdd_from_bin_cts.default,
    lambda x: aten._histogramdd_from_bin_cts.default(x, [3, 5], range=[-2.0, 2.0, -1.0, 1.0]),
    f(7, 2),
)
case(
    aten.histogram.bins_tensor,
    lambda x, e: aten.histogram.bins_tensor(x, e),
    f(6, 5),
    lambda g: torch.linspace(-2, 2, 6),
)
case(aten.hash_tensor.default, lambda x: aten.hash_tensor.default(x, [1]), f(6, 5))
case(
    aten.masked_scatter.default,
    lambda x, m, s: aten.masked_scatter.default(x, m, s),
    f(6, 5),
    lambda g: torch.rand(6, 5, generator=g) < 0.5,
    f(30),
)
case(
    aten.nonzero_static.default,
    lambda x: aten.nonzero_static.default(x, size=9),
    lambda g: torch.rand(6, 5, generator=g) < 0.2,
)
case(
    aten.put.default,
    lambda x, i, s: aten.put.default(x, i, s, True),
    f(6, 5),
    lambda g: torch.randint(0, 30, (7,), generator=g),
    f(7),
)
case(
    aten.segment_reduce.default,
    lambda x, n: aten.segment_reduce.default(x, "sum", lengths=n),
    f(7, 5),
    lambda g: torch.tensor([2, 0, 4, 1]),
    **R,
)


# --- nn.EmbeddingBag: bags by offsets [0, 3, 3, 5] (an empty bag) over 8 ids of a [10, 6] table


def _bag(mode: int) -> Callable[..., Any]:
    def fn(w: torch.Tensor, ids: torch.Tensor, *psw: torch.Tensor) -> Any:
        offsets = torch.tensor([0, 3, 3, 5])
        return aten._embedding_bag.default(w, ids, offsets, False, mode, False, *psw)

    return fn


def _bag_backward(op: Any, mode: int) -> Callable[..., Any]:
    def fn(g: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> Any:
        offsets = torch.tensor([0, 3, 3, 5])
        _, o2b, size, imax = aten._embedding_bag.default(w, ids, offsets, False, mode)
        if op == aten._embedding_bag_dense_backward.default:
            return op(g, ids, o2b, size, imax, 10, False, mode, None)
        return op(g, ids, offsets, o2b, size, imax, 10, False, mode, False, None)

    return fn


def _bag_weights_backward(
    g: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, psw: torch.Tensor
) -> Any:
    offsets = torch.tensor([0, 3, 3, 5])
    _, o2b, _, _ = aten._embedding_bag.default(w, ids, offsets, False, 0, False, psw)
    return aten._embedding_bag_per_sample_weights_backward.default(g, w, ids, offsets, o2b, 0)


IDS = ints(10, 8)
case(aten._embedding_bag.default, _bag(2), f(10, 6), IDS)  # max: argmax [bags, D] too
case(
    aten._embedding_bag_backward.default,
    _bag_backward(aten._embedding_bag_backward.default, 1),
    f(4, 6),
    f(10, 6),
    IDS,
    **R,
)
case(
    aten._embedding_bag_dense_backward.default,
    _bag_backward(aten._embedding_bag_dense_backward.default, 2),
    f(4, 6),
    f(10, 6),
    IDS,
    **R,
)
case(
    aten._embedding_bag_per_sample_weights_backward.default,
    _bag_weights_backward,
    f(4, 6),
    f(10, 6),
    IDS,
    f(8),
    **R,
)


# --- margin losses' backwards (gathered whole): scores [5, 4], class targets ---------------------


def _multilabel_backward(g: torch.Tensor, x: torch.Tensor) -> Any:
    target = torch.tensor(
        [[1, 3, -1, 0], [0, -1, 2, 2], [2, 1, 0, -1], [3, -1, 0, 0], [0, 1, 2, 3]]
    )
    _, is_target = aten.multilabel_margin_loss_forward.default(x, target, 1)
    return aten.multilabel_margin_loss_backward.default(g, x, target, 1, is_target)


case(
    aten.multi_margin_loss_backward.default,
    lambda g, x: aten.multi_margin_loss_backward.default(
        g, x, torch.tensor([1, 0, 3, 2, 1]), 1, 1.0, None, 1
    ),
    lambda g: torch.randn((), generator=g),
    f(5, 4),
)
case(
    aten.multilabel_margin_loss_backward.default,
    _multilabel_backward,
    lambda g: torch.randn((), generator=g),
    f(5, 4),
)

import op_cases_linalg  # noqa: E402,F401
import op_cases_moe  # noqa: E402,F401
import op_cases_plane  # noqa: E402,F401
