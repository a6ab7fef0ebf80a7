"""Rules of matrix products: ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``mv``, ``dot``.

The contracting dim is a reduction factor (``reduce_op="sum"``): sharding it leaves the result
partial. ``addmm``/``baddbmm`` add a broadcast input to the product; when the contracting factor
is sharded, that addend must be counted once (``handler="add_bias_once"``: the partitioner adds
it after the reduction, or on one member of each reduction group). This module does not cover
``convolution`` (``conv.py``) or attention (``attention.py``).
"""

from __future__ import annotations

from partita.rules.common import aten_ops, broadcast_dims, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("matmul")
#: Tracing does not check that mm's operands share a dtype (its fake kernel takes float64 @
#: float32): the partitioner does, or the per-device program would fail when it runs.
_SAME_DTYPE = OpFacts(same_dtype=True)

__all__ = ["addmm_rule", "bmm_rule", "mm_rule"]


@RULES.register(*aten_ops(["mm.default"]), facts=_SAME_DTYPE)
def mm_rule(info: OpInfo) -> FactorRule:
    """``m k, k n -> m n; reduction=k``."""
    return build(info, [["m", "k"], ["k", "n"]], [["m", "n"]], reduction="k")


@RULES.register(*aten_ops(["bmm.default"]), facts=_SAME_DTYPE)
def bmm_rule(info: OpInfo) -> FactorRule:
    """``b m k, b k n -> b m n; reduction=k``."""
    return build(info, [["b", "m", "k"], ["b", "k", "n"]], [["b", "m", "n"]], reduction="k")


@RULES.register(*aten_ops(["mv.default"]), facts=_SAME_DTYPE)
def mv_rule(info: OpInfo) -> FactorRule:
    """``m k, k -> m; reduction=k``."""
    return build(info, [["m", "k"], ["k"]], [["m"]], reduction="k")


@RULES.register(*aten_ops(["dot.default", "vdot.default"]), facts=_SAME_DTYPE)
def dot_rule(info: OpInfo) -> FactorRule:
    """``k, k -> ; reduction=k`` (a 0-d result)."""
    return build(info, [["k"], ["k"]], [[]], reduction="k")


@RULES.register(*aten_ops(["addmm.default", "baddbmm.default"]), facts=_SAME_DTYPE)
def addmm_rule(info: OpInfo) -> FactorRule:
    """``n, m k, k n -> m n; reduction=k; handler=add_bias_once`` for ``addmm(bias[n], a, b)``."""
    (out,) = info.results
    dims = ["m", "n"] if out.ndim == 2 else ["b", "m", "n"]
    mat1, mat2 = (["m", "k"], ["k", "n"]) if out.ndim == 2 else (["b", "m", "k"], ["b", "k", "n"])
    bias = broadcast_dims(info.operands[0], out.shape, dims)
    return build(info, [bias, mat1, mat2], [dims], reduction="k", handler=HandlerName.ADD_BIAS_ONCE)


@RULES.register(*aten_ops(["addmv.default"]), facts=_SAME_DTYPE)
def addmv_rule(info: OpInfo) -> FactorRule:
    """``m, m k, k -> m; reduction=k; handler=add_bias_once`` for ``addmv(bias, a, v)``."""
    (out,) = info.results
    bias = broadcast_dims(info.operands[0], out.shape, ["m"])
    return build(
        info, [bias, ["m", "k"], ["k"]], [["m"]], reduction="k", handler=HandlerName.ADD_BIAS_ONCE
    )


@RULES.register(*aten_ops(["addbmm.default"]), facts=_SAME_DTYPE)
def addbmm_rule(info: OpInfo) -> FactorRule:
    """``m n, b m k, b k n -> m n; reduction=b,k; handler=add_bias_once`` for
    ``addbmm(c, a, b)`` (the batch of products is summed too)."""
    (out,) = info.results
    bias = broadcast_dims(info.operands[0], out.shape, ["m", "n"])
    return build(
        info,
        [bias, ["b", "m", "k"], ["b", "k", "n"]],
        [["m", "n"]],
        reduction="b k",
        handler=HandlerName.ADD_BIAS_ONCE,
    )
