"""Rules of elementwise ops: unary and binary math (special functions included: gamma family,
Bessel functions, orthogonal polynomials), comparisons, bitwise ops and shifts, ``gcd``/``lcm``,
casts, ``where``, ``lerp``.

Every operand broadcasts to the result: dims are aligned from the right, a dim equal to the
result's shares its factor, and a size-1 dim that broadcasts carries no factor (``1``); 0-d
operands have no dims and scalar (non-tensor) arguments are not operands. Every factor passes
through. This module does not cover random ops (``random.py``) or ``*_like`` creation ops
(``creation.py``).
"""

from __future__ import annotations

from partita.errors import UnsupportedOpError
from partita.rules.common import Names, aten_ops, broadcast_dims, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.ruleset import RuleSet

RULES = RuleSet("elementwise")

__all__ = ["ELEMENTWISE_OPS", "elementwise_rule"]

_NAMES = (
    "__lshift__.Scalar",
    "__lshift__.Tensor",
    "__rshift__.Scalar",
    "__rshift__.Tensor",
    "_conj.default",
    "_conj_physical.default",
    "_to_copy.default",
    "abs.default",
    "acos.default",
    "acosh.default",
    "add.Scalar",
    "add.Tensor",
    "add_.Tensor",
    "addcdiv.default",
    "addcmul.default",
    "alias.default",
    "angle.default",
    "asin.default",
    "asinh.default",
    "atan.default",
    "atan2.default",
    "atanh.default",
    "bitwise_and.Scalar",
    "bitwise_and.Scalar_Tensor",
    "bitwise_and.Tensor",
    "bitwise_left_shift.Scalar_Tensor",
    "bitwise_left_shift.Tensor",
    "bitwise_left_shift.Tensor_Scalar",
    "bitwise_not.default",
    "bitwise_or.Scalar",
    "bitwise_or.Scalar_Tensor",
    "bitwise_or.Tensor",
    "bitwise_right_shift.Scalar_Tensor",
    "bitwise_right_shift.Tensor",
    "bitwise_right_shift.Tensor_Scalar",
    "bitwise_xor.Scalar",
    "bitwise_xor.Scalar_Tensor",
    "bitwise_xor.Tensor",
    "ceil.default",
    "clamp.Tensor",
    "clamp.default",
    "clamp_max.default",
    "clamp_min.default",
    "clone.default",
    "complex.default",
    "copy.default",
    "copysign.Scalar",
    "copysign.Tensor",
    "cos.default",
    "cosh.default",
    "detach.default",
    "digamma.default",
    "div.Scalar",
    "div.Scalar_mode",
    "div.Tensor",
    "div.Tensor_mode",
    "div_.Scalar",
    "div_.Tensor",
    "elu.default",
    "elu_backward.default",
    "eq.Scalar",
    "eq.Tensor",
    "erf.default",
    "erfc.default",
    "erfinv.default",
    "exp.default",
    "exp2.default",
    "expm1.default",
    "fill.Scalar",
    "fill.Tensor",
    "floor.default",
    "floor_divide.default",
    "fmax.default",
    "fmin.default",
    "fmod.Scalar",
    "fmod.Tensor",
    "frexp.Tensor",
    "gcd.default",
    "ge.Scalar",
    "ge.Tensor",
    "gelu.default",
    "gelu_backward.default",
    "gt.Scalar",
    "gt.Tensor",
    "hardshrink_backward.default",
    "hardtanh.default",
    "hypot.default",
    "i0.default",
    "igamma.default",
    "igammac.default",
    "isinf.default",
    "isnan.default",
    "lcm.default",
    "ldexp.Tensor",
    "le.Scalar",
    "le.Tensor",
    "leaky_relu.default",
    "leaky_relu_backward.default",
    "lerp.Scalar",
    "lerp.Tensor",
    "lgamma.default",
    "lift_fresh_copy.default",
    "log.default",
    "log10.default",
    "log1p.default",
    "log2.default",
    "logical_and.default",
    "logical_not.default",
    "logical_or.default",
    "logical_xor.default",
    "lt.Scalar",
    "lt.Tensor",
    "masked_fill.Scalar",
    "masked_fill.Tensor",
    "maximum.default",
    "minimum.default",
    "mul.Scalar",
    "mul.Tensor",
    "mul_.Scalar",
    "mul_.Tensor",
    "nan_to_num.default",
    "native_dropout_backward.default",
    "ne.Scalar",
    "ne.Tensor",
    "neg.default",
    "nextafter.default",
    "polar.default",
    "polygamma.default",
    "pow.Scalar",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "reciprocal.default",
    "relu.default",
    "remainder.Scalar",
    "remainder.Scalar_Tensor",
    "remainder.Tensor",
    "round.decimals",
    "round.default",
    "rrelu_with_noise_backward.default",
    "rsqrt.default",
    "rsub.Scalar",
    "rsub.Tensor",
    "sgn.default",
    "sigmoid.default",
    "sigmoid_backward.default",
    "sign.default",
    "signbit.default",
    "silu.default",
    "silu_backward.default",
    "sin.default",
    "sinh.default",
    "softplus.default",
    "softplus_backward.default",
    "softshrink_backward.default",
    "special_airy_ai.default",
    "special_bessel_j0.default",
    "special_bessel_j1.default",
    "special_bessel_y0.default",
    "special_bessel_y1.default",
    "special_chebyshev_polynomial_t.default",
    "special_chebyshev_polynomial_t.n_scalar",
    "special_chebyshev_polynomial_t.x_scalar",
    "special_chebyshev_polynomial_u.default",
    "special_chebyshev_polynomial_u.n_scalar",
    "special_chebyshev_polynomial_u.x_scalar",
    "special_chebyshev_polynomial_v.default",
    "special_chebyshev_polynomial_v.n_scalar",
    "special_chebyshev_polynomial_v.x_scalar",
    "special_chebyshev_polynomial_w.default",
    "special_chebyshev_polynomial_w.n_scalar",
    "special_chebyshev_polynomial_w.x_scalar",
    "special_erfcx.default",
    "special_hermite_polynomial_h.default",
    "special_hermite_polynomial_h.n_scalar",
    "special_hermite_polynomial_h.x_scalar",
    "special_hermite_polynomial_he.default",
    "special_hermite_polynomial_he.n_scalar",
    "special_hermite_polynomial_he.x_scalar",
    "special_i0e.default",
    "special_i1.default",
    "special_i1e.default",
    "special_laguerre_polynomial_l.default",
    "special_laguerre_polynomial_l.n_scalar",
    "special_laguerre_polynomial_l.x_scalar",
    "special_legendre_polynomial_p.default",
    "special_legendre_polynomial_p.n_scalar",
    "special_legendre_polynomial_p.x_scalar",
    "special_modified_bessel_i0.default",
    "special_modified_bessel_i1.default",
    "special_modified_bessel_k0.default",
    "special_modified_bessel_k1.default",
    "special_ndtri.default",
    "special_scaled_modified_bessel_k0.default",
    "special_scaled_modified_bessel_k1.default",
    "special_shifted_chebyshev_polynomial_t.default",
    "special_shifted_chebyshev_polynomial_t.n_scalar",
    "special_shifted_chebyshev_polynomial_t.x_scalar",
    "special_shifted_chebyshev_polynomial_u.default",
    "special_shifted_chebyshev_polynomial_u.n_scalar",
    "special_shifted_chebyshev_polynomial_u.x_scalar",
    "special_shifted_chebyshev_polynomial_v.default",
    "special_shifted_chebyshev_polynomial_v.n_scalar",
    "special_shifted_chebyshev_polynomial_v.x_scalar",
    "special_shifted_chebyshev_polynomial_w.default",
    "special_shifted_chebyshev_polynomial_w.n_scalar",
    "special_shifted_chebyshev_polynomial_w.x_scalar",
    "special_spherical_bessel_j0.default",
    "special_zeta.default",
    "special_zeta.other_scalar",
    "special_zeta.self_scalar",
    "sqrt.default",
    "square.default",
    "sub.Scalar",
    "sub.Tensor",
    "sub_.Tensor",
    "tan.default",
    "tanh.default",
    "tanh_backward.default",
    "threshold.default",
    "threshold_backward.default",
    "trunc.default",
    "where.Scalar",
    "where.ScalarOther",
    "where.ScalarSelf",
    "where.self",
)

ELEMENTWISE_OPS = aten_ops(_NAMES)


#: A cast or copy: its result is its operand's data, so a stored input stays stored through it.
RULES.declare(aten_ops(["_to_copy.default"]), OpFacts(keeps_data=True))
RULES.declare(aten_ops(["clone.default"]), OpFacts(keeps_data=True, linear="first"))
#: Linear ops: a sum of partial sums, or a partial sum times a replicated factor, stays a partial
#: sum, reduced once where it is needed whole (``propagate.linear``).
RULES.declare(aten_ops(["add.Tensor", "sub.Tensor"]), OpFacts(linear="addends"))
RULES.declare(aten_ops(["mul.Tensor"]), OpFacts(linear="scaled"))
RULES.declare(aten_ops(["alias.default", "div.Tensor", "neg.default"]), OpFacts(linear="first"))


@RULES.register(*ELEMENTWISE_OPS)
def elementwise_rule(info: OpInfo, handler: str | None = None) -> FactorRule:
    """Broadcasting elementwise: ``a b, 1 b, -> a b`` for ``[4, 8] + [1, 8] + 0-d``.

    Every result has the broadcast shape (the first result's); operands align from the right.
    """
    out = next((r for r in info.results if r is not None), None)
    if out is None:
        raise UnsupportedOpError(f"{info.target} has no tensor result")
    dims = Names().take(out.ndim)
    results = []
    for r in info.results:
        if r is not None and tuple(r.shape) != tuple(out.shape):
            raise UnsupportedOpError(
                f"{info.target}: results of shapes {out.shape} and {r.shape} are not elementwise"
            )
        results.append(None if r is None else dims)
    operands = [broadcast_dims(m, out.shape, dims) for m in info.operands]
    return build(info, operands, results, handler=handler)
