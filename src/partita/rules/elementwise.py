"""Rules of elementwise ops: unary and binary math, comparisons, casts, ``where``, ``lerp``.

Every operand broadcasts to the result: dims are aligned from the right, a dim equal to the
result's shares its factor, and a size-1 dim that broadcasts carries no factor (``1``); 0-d
operands have no dims and scalar (non-tensor) arguments are not operands. Every factor passes
through. This module does not cover random ops (``random.py``) or ``*_like`` creation ops
(``creation.py``).
"""

from __future__ import annotations

from partita.rules import register_rule
from partita.rules.common import Names, aten_ops, broadcast_dims, build
from partita.rules.factor import FactorRule, OpInfo

__all__ = ["ELEMENTWISE_OPS", "elementwise_rule"]

_NAMES = (
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
    "asin.default",
    "asinh.default",
    "atan.default",
    "atan2.default",
    "atanh.default",
    "bitwise_and.Scalar",
    "bitwise_and.Tensor",
    "bitwise_not.default",
    "bitwise_or.Scalar",
    "bitwise_or.Tensor",
    "bitwise_xor.Tensor",
    "ceil.default",
    "clamp.Tensor",
    "clamp.default",
    "clamp_max.default",
    "clamp_min.default",
    "clone.default",
    "copy.default",
    "cos.default",
    "cosh.default",
    "detach.default",
    "div.Scalar",
    "div.Tensor",
    "div.Tensor_mode",
    "div_.Scalar",
    "div_.Tensor",
    "elu.default",
    "elu_backward.default",
    "eq.Scalar",
    "eq.Tensor",
    "erf.default",
    "erfinv.default",
    "exp.default",
    "exp2.default",
    "expm1.default",
    "fill.Scalar",
    "fill.Tensor",
    "floor.default",
    "floor_divide.default",
    "fmod.Scalar",
    "fmod.Tensor",
    "ge.Scalar",
    "ge.Tensor",
    "gelu.default",
    "gelu_backward.default",
    "gt.Scalar",
    "gt.Tensor",
    "hardtanh.default",
    "isinf.default",
    "isnan.default",
    "le.Scalar",
    "le.Tensor",
    "leaky_relu.default",
    "leaky_relu_backward.default",
    "lerp.Scalar",
    "lerp.Tensor",
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
    "pow.Scalar",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "reciprocal.default",
    "relu.default",
    "remainder.Scalar",
    "remainder.Tensor",
    "round.default",
    "rsqrt.default",
    "rsub.Scalar",
    "rsub.Tensor",
    "sgn.default",
    "sigmoid.default",
    "sigmoid_backward.default",
    "sign.default",
    "silu.default",
    "silu_backward.default",
    "sin.default",
    "sinh.default",
    "softplus.default",
    "softplus_backward.default",
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


@register_rule(*ELEMENTWISE_OPS)
def elementwise_rule(info: OpInfo, handler: str | None = None) -> FactorRule:
    """Broadcasting elementwise: ``a b, 1 b, -> a b`` for ``[4, 8] + [1, 8] + 0-d``.

    Every result has the broadcast shape (the first result's); operands align from the right.
    """
    out = next((r for r in info.results if r is not None), None)
    if out is None:
        raise NotImplementedError(f"{info.target} has no tensor result")
    dims = Names().take(out.ndim)
    results = []
    for r in info.results:
        if r is not None and tuple(r.shape) != tuple(out.shape):
            raise NotImplementedError(
                f"{info.target}: results of shapes {out.shape} and {r.shape} are not elementwise"
            )
        results.append(None if r is None else dims)
    operands = [broadcast_dims(m, out.shape, dims) for m in info.operands]
    return build(info, operands, results, handler=handler)
