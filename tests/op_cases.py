"""Sample calls for the op table (tests/test_op_table.py): one :class:`Case` per registered rule.

Each case is a small function of tensors that calls the op (``torch.ops.aten.<op>.<overload>``
directly; capture may still rewrite it, see ``survives_capture`` in the test), the sample
inputs it is called with (built from a seeded generator, with sizes that are often NOT
divisible by the mesh: 5, 6, 7), and how to compare the sharded result with the unsharded one.

Non-tensor arguments are closed over, so every argument of ``fn`` is a tensor that the test may
shard. This module holds data only: no sharding, no partita machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.capture import ops as partita_ops
from partita.capture.annotate import annotate as _annotate
from partita.values.mesh import Mesh
from partita.values.spec import P

aten = torch.ops.aten

Args = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    """One sample call of ``op``.

    Attributes:
        op: the registered op overload this case covers.
        fn: the function (of tensors only) that calls it.
        make_args: builds the sample inputs from a seeded generator.
        tol: "default" (1e-5), "reduction" (sums, matmuls: 1e-4) or "loose" (1e-3).
        partial: also run with the first input as a partial (sum) value.
        random: a global_random op: compare sharded and unsharded runs under the same seed.
        meta_only: the values are uninitialised (empty*): compare shapes and dtypes only.
        mesh_fn: when set, ``fn`` is built per mesh (``mesh_fn(mesh)``), e.g. for annotations.
        xfail: a known failure: the short cause (the test marks it xfail, strict).
    """

    op: Any
    fn: Callable[..., Any]
    make_args: Callable[[torch.Generator], Args]
    tol: str = "default"
    partial: bool = False
    random: bool = False
    meta_only: bool = False
    mesh_fn: Callable[[Mesh], Callable[..., Any]] | None = None
    xfail: str | None = None
    name: str = field(default="")

    def args(self) -> Args:
        return self.make_args(torch.Generator().manual_seed(0))

    def fn_for(self, mesh: Mesh) -> Callable[..., Any]:
        return self.mesh_fn(mesh) if self.mesh_fn is not None else self.fn


# --- sample-input makers ------------------------------------------------------------------------


def f(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(*shape, generator=g)


def pos(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    """Positive floats in [0.5, 1.5) (log, sqrt, division)."""
    return lambda g: torch.rand(*shape, generator=g) + 0.5


def unit(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    """Floats in (-0.9, 0.9) (asin, atanh, erfinv)."""
    return lambda g: torch.rand(*shape, generator=g) * 1.8 - 0.9


def small_ints_f(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    """Floats holding small integers (so comparisons see ties)."""
    return lambda g: torch.randint(-2, 3, shape, generator=g).float()


def ints(high: int, *shape: int, low: int = 0) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(low, high, shape, generator=g)


def bools(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.rand(*shape, generator=g) < 0.5


def scalar(value: float) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.tensor(value)


def args_of(
    *makers: Callable[[torch.Generator], torch.Tensor],
) -> Callable[[torch.Generator], Args]:
    return lambda g: tuple(m(g) for m in makers)


NO_ARGS: Callable[[torch.Generator], Args] = lambda g: ()  # noqa: E731

CASES: dict[Any, Case] = {}


def case(op: Any, fn: Callable[..., Any], *makers: Any, **kw: Any) -> None:
    """Register the case of ``op``; ``makers`` are tensor makers (or one ``make_args``)."""
    if op in CASES:
        raise RuntimeError(f"two cases for {op}")
    make = args_of(*makers)
    CASES[op] = Case(op, fn, make, name=str(op), **kw)


# --- elementwise --------------------------------------------------------------------------------

# unary float ops: (op, input maker)
for _op, _mk in [
    (aten.abs.default, f(6, 5)),
    (aten.acos.default, unit(6, 5)),
    (aten.acosh.default, lambda g: torch.rand(6, 5, generator=g) + 1.5),
    (aten.asin.default, unit(6, 5)),
    (aten.asinh.default, f(6, 5)),
    (aten.atan.default, f(6, 5)),
    (aten.atanh.default, unit(6, 5)),
    (aten.ceil.default, f(6, 5)),
    (aten.cos.default, f(6, 5)),
    (aten.cosh.default, f(6, 5)),
    (aten.erf.default, f(6, 5)),
    (aten.erfinv.default, unit(6, 5)),
    (aten.exp.default, f(6, 5)),
    (aten.exp2.default, f(6, 5)),
    (aten.expm1.default, f(6, 5)),
    (aten.floor.default, f(6, 5)),
    (aten.log.default, pos(6, 5)),
    (aten.log10.default, pos(6, 5)),
    (aten.log1p.default, pos(6, 5)),
    (aten.log2.default, pos(6, 5)),
    (aten.reciprocal.default, pos(6, 5)),
    (aten.relu.default, f(6, 5)),
    (aten.round.default, f(6, 5)),
    (aten.rsqrt.default, pos(6, 5)),
    (aten.sgn.default, f(6, 5)),
    (aten.sigmoid.default, f(6, 5)),
    (aten.sign.default, f(6, 5)),
    (aten.silu.default, f(6, 5)),
    (aten.sin.default, f(6, 5)),
    (aten.sinh.default, f(6, 5)),
    (aten.sqrt.default, pos(6, 5)),
    (aten.square.default, f(6, 5)),
    (aten.tan.default, unit(6, 5)),
    (aten.tanh.default, f(6, 5)),
    (aten.trunc.default, f(7, 2, 3)),
    (aten.isinf.default, lambda g: torch.randn(7, 5, generator=g).log()),  # nan and -inf
    (aten.isnan.default, lambda g: torch.randn(7, 5, generator=g).log()),
    (aten.gelu.default, f(2, 7, 5)),
]:
    case(_op, (lambda op: lambda x: op(x))(_op), _mk)

case(aten.neg.default, lambda x: aten.neg.default(x), f(6, 5), partial=True)
case(aten.alias.default, lambda x: aten.alias.default(x) * 1, f(6, 5), partial=True)
case(aten.detach.default, lambda x: aten.detach.default(x), f(6, 5), partial=True)
case(aten.clone.default, lambda x: aten.clone.default(x), f(7, 5), partial=True)
case(aten.lift_fresh_copy.default, lambda x: aten.lift_fresh_copy.default(x), f(6, 5))
case(
    aten._to_copy.default,
    lambda x: aten._to_copy.default(x, dtype=torch.float64),
    f(6, 5),
    partial=True,
)
case(aten.copy.default, lambda x, s: aten.copy.default(x, s), f(6, 5), f(5), partial=True)
case(aten.fill.Scalar, lambda x: aten.fill.Scalar(x, 2.5), f(6, 5))
case(aten.fill.Tensor, lambda x, v: aten.fill.Tensor(x, v), f(6, 5), scalar(1.5))
case(aten.logical_not.default, lambda x: aten.logical_not.default(x), bools(6, 5))
case(aten.bitwise_not.default, lambda x: aten.bitwise_not.default(x), ints(100, 6, 5))
case(aten.elu.default, lambda x: aten.elu.default(x, 1.0, 1.0, 1.0), f(6, 5))
case(aten.hardtanh.default, lambda x: aten.hardtanh.default(x, -0.5, 0.5), f(6, 5))
case(aten.leaky_relu.default, lambda x: aten.leaky_relu.default(x, 0.1), f(6, 5))
case(aten.softplus.default, lambda x: aten.softplus.default(x, 1.0, 20.0), f(6, 5))
case(
    aten.nan_to_num.default,
    lambda x: aten.nan_to_num.default(x, 0.0, 9.0, -9.0),
    lambda g: torch.randn(7, 5, generator=g).log(),
)
case(aten.threshold.default, lambda x: aten.threshold.default(x, 0.1, -1.0), f(6, 5))

# binary float ops with broadcasting: x [6, 5], y [5] / [6, 1]
for _op, _fn, _mx, _my, _partial in [
    (aten.add.Tensor, lambda x, y: aten.add.Tensor(x, y, alpha=2), f(6, 5), f(5), False),
    (aten.sub.Tensor, lambda x, y: aten.sub.Tensor(x, y), f(6, 5), f(6, 1), False),
    (aten.mul.Tensor, lambda x, y: aten.mul.Tensor(x, y), f(6, 5), f(5), True),
    (aten.div.Tensor, lambda x, y: aten.div.Tensor(x, y), f(6, 5), pos(6, 1), True),
    (
        aten.div.Tensor_mode,
        lambda x, y: aten.div.Tensor_mode(x, y, rounding_mode="floor"),
        f(6, 5),
        pos(5),
        False,
    ),
    (aten.atan2.default, lambda x, y: aten.atan2.default(x, y), f(6, 5), f(6, 5), False),
    (aten.maximum.default, lambda x, y: aten.maximum.default(x, y), f(6, 5), f(5), False),
    (aten.minimum.default, lambda x, y: aten.minimum.default(x, y), f(6, 5), f(6, 1), False),
    (aten.pow.Tensor_Tensor, lambda x, y: aten.pow.Tensor_Tensor(x, y), pos(6, 5), f(5), False),
    (aten.fmod.Tensor, lambda x, y: aten.fmod.Tensor(x, y), f(6, 5), pos(5), False),
    (aten.remainder.Tensor, lambda x, y: aten.remainder.Tensor(x, y), f(6, 5), pos(6, 1), False),
    (
        aten.floor_divide.default,
        lambda x, y: aten.floor_divide.default(x, y),
        f(6, 5),
        pos(5),
        False,
    ),
    (aten.rsub.Tensor, lambda x, y: aten.rsub.Tensor(x, y), f(6, 5), f(5), False),
    (aten.lerp.Scalar, lambda x, y: aten.lerp.Scalar(x, y, 0.3), f(6, 5), f(6, 5), False),
    (
        aten.gelu_backward.default,
        lambda g, x: aten.gelu_backward.default(g, x),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.elu_backward.default,
        lambda g, x: aten.elu_backward.default(g, 1.0, 1.0, 1.0, False, x),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.leaky_relu_backward.default,
        lambda g, x: aten.leaky_relu_backward.default(g, x, 0.1, False),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.sigmoid_backward.default,
        lambda g, y: aten.sigmoid_backward.default(g, y),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.silu_backward.default,
        lambda g, x: aten.silu_backward.default(g, x),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.softplus_backward.default,
        lambda g, x: aten.softplus_backward.default(g, x, 1.0, 20.0),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.tanh_backward.default,
        lambda g, y: aten.tanh_backward.default(g, y),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.threshold_backward.default,
        lambda g, x: aten.threshold_backward.default(g, x, 0.1),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.hardshrink_backward.default,
        lambda g, x: aten.hardshrink_backward.default(g, x, 0.5),
        f(6, 5),
        f(6, 5),
        True,
    ),
    (
        aten.softshrink_backward.default,
        lambda g, x: aten.softshrink_backward.default(g, x, 0.5),
        f(6, 5),
        f(6, 5),
        True,
    ),
]:
    case(_op, _fn, _mx, _my, partial=_partial)

# scalar-operand forms
for _op, _fn, _mk, _partial in [
    (aten.add.Scalar, lambda x: aten.add.Scalar(x, 1.5), f(6, 5), False),
    (aten.sub.Scalar, lambda x: aten.sub.Scalar(x, 1.5), f(6, 5), False),
    (aten.mul.Scalar, lambda x: aten.mul.Scalar(x, 1.5), f(6, 5), True),
    (aten.div.Scalar, lambda x: aten.div.Scalar(x, 3.0), f(6, 5), True),
    (aten.rsub.Scalar, lambda x: aten.rsub.Scalar(x, 1.5), f(6, 5), False),
    (aten.pow.Tensor_Scalar, lambda x: aten.pow.Tensor_Scalar(x, 2), f(6, 5), False),
    (aten.pow.Scalar, lambda x: aten.pow.Scalar(2.0, x), f(6, 5), False),
    (aten.fmod.Scalar, lambda x: aten.fmod.Scalar(x, 0.7), f(6, 5), False),
    (aten.remainder.Scalar, lambda x: aten.remainder.Scalar(x, 0.7), f(6, 5), False),
    (aten.clamp.default, lambda x: aten.clamp.default(x, -0.5, 0.5), f(6, 5), False),
    (aten.clamp_max.default, lambda x: aten.clamp_max.default(x, 0.5), f(6, 5), False),
    (aten.clamp_min.default, lambda x: aten.clamp_min.default(x, -0.5), f(6, 5), False),
]:
    case(_op, _fn, _mk, partial=_partial)

# in-place forms (on a fresh value: capture refuses mutating an input)
case(aten.add_.Tensor, lambda x, y: aten.add_.Tensor(x * 1, y), f(6, 5), f(5))
case(aten.sub_.Tensor, lambda x, y: aten.sub_.Tensor(x * 1, y), f(6, 5), f(6, 5))
case(aten.mul_.Tensor, lambda x, y: aten.mul_.Tensor(x * 1, y), f(6, 5), f(6, 1))
case(aten.mul_.Scalar, lambda x: aten.mul_.Scalar(x * 1, 3.0), f(6, 5), partial=True)
case(aten.div_.Tensor, lambda x, y: aten.div_.Tensor(x * 1, y), f(6, 5), pos(5))
case(aten.div_.Scalar, lambda x: aten.div_.Scalar(x * 1, 3.0), f(6, 5))

# comparisons (small integers so that ties happen): bool results, exact
for _name in ["eq", "ne", "lt", "le", "gt", "ge"]:
    _t = getattr(aten, _name).Tensor
    _s = getattr(aten, _name).Scalar
    case(_t, (lambda op: lambda x, y: op(x, y))(_t), small_ints_f(6, 5), small_ints_f(5))
    case(_s, (lambda op: lambda x: op(x, 0.0))(_s), small_ints_f(6, 5))

# bitwise / logical
case(
    aten.bitwise_and.Tensor, lambda x, y: aten.bitwise_and.Tensor(x, y), ints(64, 6, 5), ints(64, 5)
)
case(
    aten.bitwise_or.Tensor,
    lambda x, y: aten.bitwise_or.Tensor(x, y),
    ints(64, 6, 5),
    ints(64, 6, 5),
)
case(
    aten.bitwise_xor.Tensor,
    lambda x, y: aten.bitwise_xor.Tensor(x, y),
    ints(64, 6, 5),
    ints(64, 6, 1),
)
case(aten.bitwise_and.Scalar, lambda x: aten.bitwise_and.Scalar(x, 6), ints(64, 6, 5))
case(aten.bitwise_or.Scalar, lambda x: aten.bitwise_or.Scalar(x, 6), ints(64, 6, 5))
case(
    aten.logical_and.default, lambda x, y: aten.logical_and.default(x, y), bools(6, 5), bools(6, 5)
)
case(aten.logical_or.default, lambda x, y: aten.logical_or.default(x, y), bools(6, 5), bools(5))
case(
    aten.logical_xor.default, lambda x, y: aten.logical_xor.default(x, y), bools(6, 5), bools(6, 5)
)

# ternary
case(aten.where.self, lambda c, x, y: aten.where.self(c, x, y), bools(6, 5), f(6, 5), f(5))
case(aten.where.Scalar, lambda c: aten.where.Scalar(c, 1.0, 2.0), bools(6, 5))
case(aten.where.ScalarOther, lambda c, x: aten.where.ScalarOther(c, x, 0.5), bools(6, 5), f(6, 5))
case(aten.where.ScalarSelf, lambda c, y: aten.where.ScalarSelf(c, 0.5, y), bools(6, 1), f(6, 5))
case(
    aten.masked_fill.Scalar, lambda x, m: aten.masked_fill.Scalar(x, m, -1.0), f(6, 5), bools(6, 5)
)
case(
    aten.masked_fill.Tensor,
    lambda x, m, v: aten.masked_fill.Tensor(x, m, v),
    f(6, 5),
    bools(5),
    scalar(2.0),
)
case(aten.clamp.Tensor, lambda x, lo, hi: aten.clamp.Tensor(x, lo, hi), f(6, 5), unit(5), pos(6, 1))
case(aten.lerp.Tensor, lambda x, y, w: aten.lerp.Tensor(x, y, w), f(6, 5), f(6, 5), unit(5))
case(
    aten.addcdiv.default,
    lambda x, a, b: aten.addcdiv.default(x, a, b, value=0.5),
    f(6, 5),
    f(6, 5),
    pos(5),
)
case(
    aten.addcmul.default,
    lambda x, a, b: aten.addcmul.default(x, a, b, value=0.5),
    f(6, 5),
    f(6, 1),
    f(6, 5),
)
case(
    aten.native_dropout_backward.default,
    lambda g, m: aten.native_dropout_backward.default(g, m, 2.0),
    f(6, 5),
    bools(6, 5),
    partial=True,
)

# --- matmul ---------------------------------------------------------------------------------------

case(
    aten.mm.default,
    lambda a, b: aten.mm.default(a, b),
    f(6, 5),
    f(5, 7),
    tol="reduction",
    partial=True,
)
case(
    aten.bmm.default,
    lambda a, b: aten.bmm.default(a, b),
    f(3, 6, 5),
    f(3, 5, 7),
    tol="reduction",
    partial=True,
)
case(
    aten.addmm.default,
    lambda c, a, b: aten.addmm.default(c, a, b),
    f(7),
    f(6, 5),
    f(5, 7),
    tol="reduction",
)
case(
    aten.baddbmm.default,
    lambda c, a, b: aten.baddbmm.default(c, a, b, beta=0.5, alpha=2.0),
    f(3, 6, 7),
    f(3, 6, 5),
    f(3, 5, 7),
    tol="reduction",
)
case(
    aten.mv.default,
    lambda a, v: aten.mv.default(a, v),
    f(6, 5),
    f(5),
    tol="reduction",
    partial=True,
)
case(
    aten.dot.default, lambda a, b: aten.dot.default(a, b), f(7), f(7), tol="reduction", partial=True
)
case(aten.vdot.default, lambda a, b: aten.vdot.default(a, b), f(7), f(7), tol="reduction")

# --- shape ----------------------------------------------------------------------------------------

case(aten.view.default, lambda x: aten.view.default(x, [3, 2, 5]), f(6, 5), partial=True)
case(aten._unsafe_view.default, lambda x: aten._unsafe_view.default(x, [2, 3, 5]), f(6, 5))
case(aten.view_copy.default, lambda x: aten.view_copy.default(x, [6, 5]), f(2, 3, 5))
case(aten._reshape_alias.default, lambda x: aten._reshape_alias.default(x, [30], [1]), f(6, 5))
case(aten.reshape.default, lambda x: aten.reshape.default(x, [5, 6]), f(6, 5), partial=True)
case(aten.expand.default, lambda x: aten.expand.default(x, [6, 5]), f(6, 1), partial=True)
case(aten.expand_copy.default, lambda x: aten.expand_copy.default(x, [7, 6, 5]), f(6, 5))
case(aten.flatten.using_ints, lambda x: aten.flatten.using_ints(x, 0, 1), f(2, 3, 5))
case(aten.unflatten.int, lambda x: aten.unflatten.int(x, 0, [2, 3]), f(6, 5))
case(aten.squeeze.default, lambda x: aten.squeeze.default(x), f(6, 1, 5))
case(aten.squeeze.dim, lambda x: aten.squeeze.dim(x, 1), f(6, 1, 5))
case(aten.squeeze.dims, lambda x: aten.squeeze.dims(x, [0, 2]), f(1, 7, 1))
case(aten.unsqueeze.default, lambda x: aten.unsqueeze.default(x, 1), f(6, 5))
case(aten.permute.default, lambda x: aten.permute.default(x, [2, 0, 1]), f(2, 3, 5), partial=True)
case(aten.permute_copy.default, lambda x: aten.permute_copy.default(x, [1, 0]), f(6, 5))
case(aten.t.default, lambda x: aten.t.default(x), f(6, 5), partial=True)
case(aten.transpose.int, lambda x: aten.transpose.int(x, 0, 2), f(2, 3, 5))
case(aten.transpose_copy.int, lambda x: aten.transpose_copy.int(x, 1, 0), f(6, 5))
case(aten.numpy_T.default, lambda x: aten.numpy_T.default(x), f(6, 5))

# --- slicing --------------------------------------------------------------------------------------

case(aten.slice.Tensor, lambda x: aten.slice.Tensor(x, 0, 1, 5), f(6, 5), partial=True)
case(aten.narrow.default, lambda x: aten.narrow.default(x, 1, 1, 3), f(6, 5))
case(aten.select.int, lambda x: aten.select.int(x, 0, 2), f(6, 5))
case(aten.gather.default, lambda x, i: aten.gather.default(x, 1, i), f(6, 5), ints(5, 6, 3))
case(
    aten.index_select.default, lambda x, i: aten.index_select.default(x, 0, i), f(6, 5), ints(6, 4)
)
case(aten.cat.default, lambda x, y: aten.cat.default([x, y], 0), f(6, 5), f(3, 5), partial=True)
case(aten.stack.default, lambda x, y: aten.stack.default([x, y], 1), f(6, 5), f(6, 5))
case(aten.constant_pad_nd.default, lambda x: aten.constant_pad_nd.default(x, [1, 2], 0.0), f(6, 5))
case(aten.tril.default, lambda x: aten.tril.default(x, 0), f(6, 5))
case(aten.triu.default, lambda x: aten.triu.default(x, 1), f(6, 5))

# --- reductions -----------------------------------------------------------------------------------

R = {"tol": "reduction"}
case(aten.sum.default, lambda x: aten.sum.default(x), f(6, 5), partial=True, **R)
case(aten.sum.dim_IntList, lambda x: aten.sum.dim_IntList(x, [1], True), f(6, 5), partial=True, **R)
case(aten.mean.default, lambda x: aten.mean.default(x), f(6, 5), partial=True, **R)
case(aten.mean.dim, lambda x: aten.mean.dim(x, [0]), f(7, 5), partial=True, **R)
case(aten.amax.default, lambda x: aten.amax.default(x, [1]), f(6, 5))
case(aten.amin.default, lambda x: aten.amin.default(x, [0], True), f(7, 5))
case(
    aten.any.default, lambda x: aten.any.default(x), lambda g: torch.rand(7, 5, generator=g) < 0.03
)
case(aten.any.dim, lambda x: aten.any.dim(x, 1), lambda g: torch.rand(7, 5, generator=g) < 0.2)
case(aten.any.dims, lambda x: aten.any.dims(x, [0]), lambda g: torch.rand(7, 5, generator=g) < 0.2)
case(
    aten.all.default, lambda x: aten.all.default(x), lambda g: torch.rand(7, 5, generator=g) < 0.97
)
case(aten.all.dim, lambda x: aten.all.dim(x, 1), lambda g: torch.rand(7, 5, generator=g) < 0.8)
case(aten.all.dims, lambda x: aten.all.dims(x, [0]), lambda g: torch.rand(7, 5, generator=g) < 0.8)
case(aten.argmax.default, lambda x: aten.argmax.default(x, 1), f(6, 5))
case(aten.argmin.default, lambda x: aten.argmin.default(x, 0), f(7, 5))
case(aten.max.dim, lambda x: aten.max.dim(x, 1), f(6, 5))
case(aten.min.dim, lambda x: aten.min.dim(x, 0, True), f(7, 5))
case(aten.var.correction, lambda x: aten.var.correction(x, [1], correction=1), f(6, 5), **R)
case(aten.var.dim, lambda x: aten.var.dim(x, [0], True, True), f(7, 5), **R)
case(
    aten.var_mean.correction, lambda x: aten.var_mean.correction(x, [1], correction=0), f(6, 5), **R
)
case(aten.std.correction, lambda x: aten.std.correction(x, [0], correction=1), f(7, 5), **R)
case(aten.std.dim, lambda x: aten.std.dim(x, [1], True), f(6, 5), **R)
case(aten.prod.dim_int, lambda x: aten.prod.dim_int(x, 1), pos(6, 5), **R)
case(aten.cumsum.default, lambda x: aten.cumsum.default(x, 1), f(6, 5), partial=True, **R)
case(aten.cumprod.default, lambda x: aten.cumprod.default(x, 0), pos(7, 5), **R)
case(aten.logcumsumexp.default, lambda x: aten.logcumsumexp.default(x, 1), f(6, 5), **R)
case(aten.sort.default, lambda x: aten.sort.default(x, 1), f(6, 5))
case(aten.sort.stable, lambda x: aten.sort.stable(x, stable=True, dim=0), small_ints_f(7, 5))
case(aten.topk.default, lambda x: aten.topk.default(x, 2, 1), f(6, 5))
case(aten.softmax.int, lambda x: aten.softmax.int(x, 1), f(6, 5), **R)
case(aten._softmax.default, lambda x: aten._softmax.default(x, 1, False), f(6, 5), **R)
case(aten._safe_softmax.default, lambda x: aten._safe_softmax.default(x, 0), f(7, 5), **R)
case(aten.log_softmax.int, lambda x: aten.log_softmax.int(x, 1), f(6, 5), **R)
case(aten._log_softmax.default, lambda x: aten._log_softmax.default(x, 0, False), f(7, 5), **R)
case(
    aten._softmax_backward_data.default,
    lambda g, x: aten._softmax_backward_data.default(g, x.softmax(1), 1, torch.float32),
    f(6, 5),
    f(6, 5),
    **R,
)
case(
    aten._log_softmax_backward_data.default,
    lambda g, x: aten._log_softmax_backward_data.default(g, x.log_softmax(1), 1, torch.float32),
    f(6, 5),
    f(6, 5),
    **R,
)

# --- creation (no tensor input, or only a shape/dtype source) -------------------------------------

CASES_NO_INPUT = [
    (aten.full.default, lambda: aten.full.default([6, 5], 2.5)),
    (aten.zeros.default, lambda: aten.zeros.default([7, 5])),
    (aten.ones.default, lambda: aten.ones.default([6, 5])),
    (aten.arange.default, lambda: aten.arange.default(7)),
    (aten.arange.start, lambda: aten.arange.start(2, 9, dtype=torch.float32)),
    (aten.arange.start_step, lambda: aten.arange.start_step(1, 14, 2)),
    (aten.scalar_tensor.default, lambda: aten.scalar_tensor.default(3.0) * torch.ones(5)),
    (aten.eye.default, lambda: aten.eye.default(6)),
]
for _op, _fn in CASES_NO_INPUT:
    case(_op, _fn)

case(aten.full_like.default, lambda x: aten.full_like.default(x, 3.0), f(6, 5))
case(aten.zeros_like.default, lambda x: aten.zeros_like.default(x), f(6, 5))
case(aten.ones_like.default, lambda x: aten.ones_like.default(x), f(7, 5))
case(aten.new_full.default, lambda x: aten.new_full.default(x, [7, 5], 3.0), f(6, 5))
case(aten.new_zeros.default, lambda x: aten.new_zeros.default(x, [6, 5]), f(6, 5))
case(aten.new_ones.default, lambda x: aten.new_ones.default(x, [5, 6]), f(6, 5))
for _op, _fn, _mks in [
    (aten.empty.memory_format, lambda: aten.empty.memory_format([6, 5]), ()),
    (aten.empty_like.default, lambda x: aten.empty_like.default(x), (f(6, 5),)),
    (aten.empty_permuted.default, lambda: aten.empty_permuted.default([6, 5], [1, 0]), ()),
    (aten.empty_strided.default, lambda: aten.empty_strided.default([6, 5], [5, 1]), ()),
    (aten.new_empty.default, lambda x: aten.new_empty.default(x, [7, 5]), (f(6, 5),)),
    (
        aten.new_empty_strided.default,
        lambda x: aten.new_empty_strided.default(x, [7, 5], [5, 1]),
        (f(6, 5),),
    ),
]:
    case(_op, _fn, *_mks, meta_only=True)

# --- random (compared under the same seed) --------------------------------------------------------

RND = {"random": True}
case(
    aten.bernoulli.default,
    lambda p: aten.bernoulli.default(p),
    lambda g: torch.rand(6, 5, generator=g),
    **RND,
)
case(aten.bernoulli.p, lambda x: aten.bernoulli.p(x, 0.5), f(6, 5), **RND)
case(aten.bernoulli_.float, lambda x: aten.bernoulli_.float(x * 1, 0.5), f(6, 5), **RND)
case(
    aten.native_dropout.default, lambda x: aten.native_dropout.default(x, 0.5, True), f(6, 5), **RND
)
case(aten.normal_.default, lambda x: aten.normal_.default(x * 1), f(6, 5), **RND)
case(
    aten.normal_functional.default,
    lambda x: aten.normal_functional.default(x, 0.5, 2.0),
    f(7, 5),
    **RND,
)
case(aten.uniform.default, lambda x: aten.uniform.default(x, -1.0, 1.0), f(7, 5), **RND)
case(aten.uniform_.default, lambda x: aten.uniform_.default(x * 1, -1.0, 1.0), f(6, 5), **RND)
case(aten.rand_like.default, lambda x: aten.rand_like.default(x), f(6, 5), **RND)
case(aten.randn_like.default, lambda x: aten.randn_like.default(x), f(7, 5), **RND)
case(aten.randint_like.default, lambda x: aten.randint_like.default(x, 10), f(6, 5), **RND)
case(aten.rand.default, lambda: aten.rand.default([6, 5]), **RND)
case(aten.randn.default, lambda: aten.randn.default([7, 5]), **RND)
case(aten.randint.default, lambda: aten.randint.default(10, [6, 5]), **RND)
case(aten.randint.low, lambda: aten.randint.low(3, 10, [6, 5]), **RND)
case(aten.randperm.default, lambda: aten.randperm.default(7), **RND)
# generator=None (diffusers' randn_tensor): the global generator, as the overloads above.
case(aten.rand.generator, lambda: aten.rand.generator([6, 5], generator=None), **RND)
case(aten.randn.generator, lambda: aten.randn.generator([7, 5], generator=None), **RND)
case(aten.randint.generator, lambda: aten.randint.generator(10, [6, 5], generator=None), **RND)
case(
    aten.randint.low_generator,
    lambda: aten.randint.low_generator(3, 10, [6, 5], generator=None),
    **RND,
)
case(aten.randperm.generator, lambda: aten.randperm.generator(7, generator=None), **RND)
case(
    aten.normal.float_float,
    lambda: aten.normal.float_float(0.5, 2.0, [7, 5], generator=None),
    **RND,
)
# Draws whose tensors are the distribution's parameters (read whole, then each device its tile).
case(
    aten.binomial.default,
    lambda c, p: aten.binomial.default(c, p),
    lambda g: torch.randint(0, 9, (6, 5), generator=g).float(),
    lambda g: torch.rand(6, 5, generator=g),
    **RND,
)
case(
    aten.multinomial.default,
    lambda p: aten.multinomial.default(p, 3, False),
    lambda g: torch.rand(6, 5, generator=g) + 0.1,
    **RND,
)
case(
    aten.normal.Tensor_Tensor,
    lambda m, s: aten.normal.Tensor_Tensor(m, s.abs()),
    f(6, 5),
    f(5),
    **RND,
)
case(aten.normal.Tensor_float, lambda m: aten.normal.Tensor_float(m, 0.5), f(7, 5), **RND)
case(aten.normal.float_Tensor, lambda s: aten.normal.float_Tensor(1.0, s.abs()), f(6, 5), **RND)
case(aten.poisson.default, lambda r: aten.poisson.default(r.abs() * 3), f(6, 5), **RND)
case(
    aten.rrelu_with_noise_functional.default,
    lambda x, n: aten.rrelu_with_noise_functional.default(x, n, 0.1, 0.3, True),
    f(6, 5),
    f(6, 5),
    **RND,
)
case(
    aten.rrelu_with_noise_backward.default,
    lambda g, x, n: aten.rrelu_with_noise_backward.default(g, x, n, 0.1, 0.3, True, False),
    f(6, 5),
    f(6, 5),
    f(6, 5),
)

# --- norms ----------------------------------------------------------------------------------------

N = {"tol": "loose"}
case(
    aten.native_layer_norm.default,
    lambda x, w, b: aten.native_layer_norm.default(x, [5], w, b, 1e-5),
    f(2, 6, 5),
    f(5),
    f(5),
    **N,
)


def _layer_norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    _, mean, rstd = aten.native_layer_norm.default(x, [5], w, b, 1e-5)
    return aten.native_layer_norm_backward.default(g, x, [5], mean, rstd, w, b, [True, True, True])


case(
    aten.native_layer_norm_backward.default,
    _layer_norm_backward,
    f(2, 6, 5),
    f(2, 6, 5),
    f(5),
    f(5),
    **N,
)

BN = (f(6, 3, 5), pos(3), f(3), f(3), pos(3))  # x, weight, bias, running_mean, running_var
case(
    aten.native_batch_norm.default,
    lambda x, w, b, rm, rv: aten.native_batch_norm.default(
        x, w, b, rm * 1, rv * 1, True, 0.1, 1e-5
    ),
    *BN,
    **N,
)
case(
    aten._native_batch_norm_legit.default,
    lambda x, w, b, rm, rv: aten._native_batch_norm_legit.default(
        x, w, b, rm * 1, rv * 1, True, 0.1, 1e-5
    ),
    *BN,
    **N,
)
case(
    aten._native_batch_norm_legit.no_stats,
    lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
    *BN[:3],
    **N,
)
case(
    aten._native_batch_norm_legit_functional.default,
    lambda x, w, b, rm, rv: aten._native_batch_norm_legit_functional.default(
        x, w, b, rm, rv, True, 0.1, 1e-5
    ),
    *BN,
    **N,
)
case(
    aten._native_batch_norm_legit_no_training.default,
    lambda x, w, b, rm, rv: aten._native_batch_norm_legit_no_training.default(
        x, w, b, rm, rv, 0.1, 1e-5
    ),
    *BN,
    **N,
)


def _batch_norm_backward(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor
) -> Any:
    _, save_mean, save_invstd = aten.native_batch_norm.default(
        x, w, None, rm * 1, rv * 1, True, 0.1, 1e-5
    )
    return aten.native_batch_norm_backward.default(
        g, x, w, rm, rv, save_mean, save_invstd, True, 1e-5, [True, True, True]
    )


case(
    aten.native_batch_norm_backward.default,
    _batch_norm_backward,
    f(6, 3, 5),
    f(6, 3, 5),
    pos(3),
    f(3),
    pos(3),
    **N,
)
case(
    aten.native_group_norm.default,
    lambda x, w, b: aten.native_group_norm.default(x, w, b, 2, 6, 5, 3, 1e-5),
    f(2, 6, 5),
    pos(6),
    f(6),
    **N,
)


def _group_norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    _, mean, rstd = aten.native_group_norm.default(x, w, b, 2, 6, 5, 3, 1e-5)
    return aten.native_group_norm_backward.default(
        g, x, mean, rstd, w, 2, 6, 5, 3, [True, True, True]
    )


case(
    aten.native_group_norm_backward.default,
    _group_norm_backward,
    f(2, 6, 5),
    f(2, 6, 5),
    pos(6),
    f(6),
    **N,
)

# --- conv / pool ----------------------------------------------------------------------------------

CONV = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1])
case(
    aten.convolution.default,
    lambda x, w, b: aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    f(2, 3, 7, 6),
    f(4, 3, 3, 3),
    f(4),
    partial=True,
    **N,
)
case(
    aten.convolution_backward.default,
    lambda g, x, w: aten.convolution_backward.default(
        g, x, w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
    ),
    f(2, 4, 7, 6),
    f(2, 3, 7, 6),
    f(4, 3, 3, 3),
    partial=True,
    **N,
)
case(
    aten.max_pool2d_with_indices.default,
    lambda x: aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2], [0, 0], [1, 1], False),
    f(2, 3, 7, 6),
)


def _max_pool_backward(g: torch.Tensor, x: torch.Tensor) -> Any:
    _, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2], [0, 0], [1, 1], False)
    return aten.max_pool2d_with_indices_backward.default(
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx
    )


case(
    aten.max_pool2d_with_indices_backward.default, _max_pool_backward, f(2, 3, 3, 3), f(2, 3, 7, 6)
)
case(
    aten.avg_pool2d.default,
    lambda x: aten.avg_pool2d.default(x, [3, 3], [2, 2], [1, 1], False, True, None),
    f(2, 3, 7, 6),
    partial=True,
)
case(
    aten.avg_pool2d_backward.default,
    lambda g, x: aten.avg_pool2d_backward.default(g, x, [3, 3], [2, 2], [1, 1], False, True, None),
    f(2, 3, 4, 3),
    f(2, 3, 7, 6),
    partial=True,
)

# --- embedding / loss -----------------------------------------------------------------------------

case(
    aten.embedding.default,
    lambda w, i: aten.embedding.default(w, i),
    f(10, 5),
    ints(10, 2, 3),
    partial=True,
)
case(
    aten.embedding_dense_backward.default,
    lambda g, i: aten.embedding_dense_backward.default(g, i, 10, -1, False),
    f(2, 3, 5),
    ints(10, 2, 3),
    partial=True,
    **R,
)
case(
    aten.nll_loss_forward.default,
    lambda x, t: aten.nll_loss_forward.default(x.log_softmax(1), t, None, 1, -100),
    f(6, 5),
    ints(5, 6),
    **R,
)


def _nll_backward(x: torch.Tensor, t: torch.Tensor) -> Any:
    logp = x.log_softmax(1)
    loss, total = aten.nll_loss_forward.default(logp, t, None, 1, -100)
    return aten.nll_loss_backward.default(torch.ones_like(loss), logp, t, None, 1, -100, total)


case(aten.nll_loss_backward.default, _nll_backward, f(6, 5), ints(5, 6), **R)

# --- attention ------------------------------------------------------------------------------------

QKV = (f(2, 3, 6, 4), f(2, 3, 5, 4), f(2, 3, 5, 4))
case(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v),
    *QKV,
    **N,
)


def _flash_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        g, q, k, v, out, lse, 0.0, False
    )


case(
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    _flash_backward,
    f(2, 3, 6, 4),
    *QKV,
    **N,
)
case(
    torch.ops.partita.sdpa.default,
    lambda q, k, v: partita_ops.sdpa(q, k, v, None, 0.0, False, None),
    *QKV,
    **N,
)


def _sdpa_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    out, lse = partita_ops.sdpa(q, k, v, None, 0.0, True, None)
    return partita_ops.sdpa_backward(g, q, k, v, out, lse, None, 0.0, True, None)


case(
    torch.ops.partita.sdpa_backward.default,
    _sdpa_backward,
    f(2, 3, 6, 4),
    f(2, 3, 6, 4),
    f(2, 3, 6, 4),
    f(2, 3, 6, 4),
    **N,
)

# --- annotate (an annotation in the middle of the program, on the example's mesh) -----------------

case(
    torch.ops.partita.annotate.default,
    lambda x: x,
    f(6, 5),
    mesh_fn=lambda mesh: lambda x: _annotate(x.exp(), mesh, P(mesh.axis_names[-1], None)) * 2,
    partial=True,
)
import op_cases_bits  # noqa: E402,F401
import op_cases_indexing  # noqa: E402,F401
import op_cases_more  # noqa: E402,F401
