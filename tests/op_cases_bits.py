"""Op-table cases of the rules added for integer programs and the op database's integer-only
entries: bit shifts and the bitwise ops with a scalar first operand, ``gcd``/``lcm``, the
scalar overloads of binary math, ``scatter`` with ``reduce=``, ``resize``, the index-list
creators (``tril_indices``/``triu_indices``) and the bin edges of ``histogramdd``.

Imported at the end of ``op_cases`` (it registers into the same ``CASES``); data only. Integer
results are compared exactly; sizes are uneven on purpose (5, 6, 7).
"""

from __future__ import annotations

import torch

from op_cases import case, f, ints, pos, unit  # isort: skip

aten = torch.ops.aten

L = {"tol": "loose"}

# --- shifts and bitwise ops (int64, exact) --------------------------------------------------------

for _op, _fn in [
    (aten.bitwise_left_shift.Tensor, lambda x, y: aten.bitwise_left_shift.Tensor(x, y)),
    (aten.bitwise_right_shift.Tensor, lambda x, y: aten.bitwise_right_shift.Tensor(x, y)),
    (aten.__lshift__.Tensor, lambda x, y: aten.__lshift__.Tensor(x, y)),
    (aten.__rshift__.Tensor, lambda x, y: aten.__rshift__.Tensor(x, y)),
]:
    case(_op, _fn, ints(1000, 6, 5, low=-1000), ints(8, 5))
for _op, _fn in [
    (aten.bitwise_left_shift.Tensor_Scalar, lambda x: aten.bitwise_left_shift.Tensor_Scalar(x, 3)),
    (
        aten.bitwise_right_shift.Tensor_Scalar,
        lambda x: aten.bitwise_right_shift.Tensor_Scalar(x, 2),
    ),
    (aten.__lshift__.Scalar, lambda x: aten.__lshift__.Scalar(x, 1)),
    (aten.__rshift__.Scalar, lambda x: aten.__rshift__.Scalar(x, 3)),
    (aten.bitwise_xor.Scalar, lambda x: aten.bitwise_xor.Scalar(x, 6)),
    (aten.bitwise_and.Scalar_Tensor, lambda x: aten.bitwise_and.Scalar_Tensor(6, x)),
    (aten.bitwise_or.Scalar_Tensor, lambda x: aten.bitwise_or.Scalar_Tensor(6, x)),
    (aten.bitwise_xor.Scalar_Tensor, lambda x: aten.bitwise_xor.Scalar_Tensor(6, x)),
]:
    case(_op, _fn, ints(1000, 6, 5, low=-1000))
for _op, _fn in [
    (aten.bitwise_left_shift.Scalar_Tensor, lambda y: aten.bitwise_left_shift.Scalar_Tensor(5, y)),
    (
        aten.bitwise_right_shift.Scalar_Tensor,
        lambda y: aten.bitwise_right_shift.Scalar_Tensor(999, y),
    ),
]:
    case(_op, _fn, ints(8, 6, 5))

case(aten.gcd.default, lambda x, y: aten.gcd.default(x, y), ints(60, 6, 5, low=-60), ints(60, 5))
case(aten.lcm.default, lambda x, y: aten.lcm.default(x, y), ints(30, 6, 5, low=-30), ints(30, 6, 1))

# --- binary math with a scalar operand -----------------------------------------------------------

case(aten.copysign.Scalar, lambda x: aten.copysign.Scalar(x, -1.0), f(6, 5))
case(aten.remainder.Scalar_Tensor, lambda x: aten.remainder.Scalar_Tensor(3.0, x), pos(6, 5))
case(aten.div.Scalar_mode, lambda x: aten.div.Scalar_mode(x, 0.3, rounding_mode="floor"), f(6, 5))
case(aten.special_zeta.other_scalar, lambda x: aten.special_zeta.other_scalar(x, 2.0), pos(6, 5))
case(aten.special_zeta.self_scalar, lambda x: aten.special_zeta.self_scalar(2.5, x), pos(6, 5), **L)
for _name in [
    "chebyshev_polynomial_t",
    "chebyshev_polynomial_u",
    "chebyshev_polynomial_v",
    "chebyshev_polynomial_w",
    "hermite_polynomial_h",
    "hermite_polynomial_he",
    "laguerre_polynomial_l",
    "legendre_polynomial_p",
    "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w",
]:
    _packet = getattr(aten, f"special_{_name}")
    case(_packet.n_scalar, (lambda op: lambda x: op(x, 3))(_packet.n_scalar), unit(6, 5), **L)
    case(
        _packet.x_scalar,
        (lambda op: lambda n: op(0.4, n))(_packet.x_scalar),
        lambda g: torch.randint(0, 4, (6, 5), generator=g).float(),
        **L,
    )

# --- scatter with reduce=, resize ----------------------------------------------------------------

case(
    aten.scatter.reduce,
    lambda x, i, s: aten.scatter.reduce(x, 0, i, s, reduce="add"),
    f(7, 5),
    ints(7, 4, 5),
    f(4, 5),
    tol="reduction",
)
case(
    aten.scatter.value_reduce,
    lambda x, i: aten.scatter.value_reduce(x, 1, i, 1.5, reduce="multiply"),
    f(6, 5),
    ints(5, 6, 3),
)
case(aten.resize.default, lambda x: aten.resize.default(x * 1, [6, 5]), f(6, 5))

# --- computed whole: index lists, histogram bin edges -------------------------------------------

case(aten.tril_indices.default, lambda: aten.tril_indices.default(6, 5, -1))
case(aten.triu_indices.default, lambda: aten.triu_indices.default(5, 7, 2))
case(
    aten._histogramdd_bin_edges.default,
    lambda x, w: aten._histogramdd_bin_edges.default(x, [3, 4], weight=w),
    f(7, 2),
    pos(7),
)
case(
    aten._histogramdd_from_bin_tensors.default,
    lambda x, a, b: aten._histogramdd_from_bin_tensors.default(x, [a, b]),
    f(7, 2),
    lambda g: torch.linspace(-2.0, 2.0, 4),
    lambda g: torch.linspace(-1.5, 1.5, 6),
)
case(
    aten.masked_scatter_backward.default,
    lambda g, m: aten.masked_scatter_backward.default(g, m, [4, 5]),
    f(6, 5),
    lambda gen: torch.rand(6, 5, generator=gen) < 0.5,
)
