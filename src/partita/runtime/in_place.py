"""Elementwise ops of a rank's program written into an operand that dies there.

A traced program is functional: every elementwise op returns a new tensor. The functional
AdamW update of one parameter tile makes 14 of them (``p * decay``, ``g - m``, its scaling,
``m + ...``, ...), of which 3 live on (the new parameter and moments) and 11 die at their next
op. Interleaved with the survivors, the dead ones leave tile-sized holes in glibc's heap that
the next step's activations do not fit in: on 4 Gloo processes a rank's heap held 90-140 MB
free beside 140 MB in use and kept growing for steps (docs/performance.md, Memory).

:func:`reuse_dead_operands` rewrites ``op(a, b)`` as ``a.op_(b)`` when ``a`` is a temporary
this op reads last: a new tensor (made by an aten op that returns fresh memory, not a view or
an input) whose only reader is this op, of the result's shape, dtype and (contiguous) layout.
For ``add`` and ``mul`` the dead operand may be either one (IEEE addition and multiplication
are commutative, so ``b + a`` has the bits of ``a + b``). On the CPU the in-place op runs the
same kernel on the same elements, so every result is the same bit for bit; the AdamW update
then makes 6 tensors per tile instead of 14, its results in its first temporaries' memory.

Only aten ops are rewritten and only aten results reused: a collective's input or result, a
graph input (the caller's parameters and optimizer state) and anything a view shares are never
written. This module does not group ops (``runtime.flat_foreach``) or order them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["fresh", "reuse_dead_operands"]

aten = torch.ops.aten

#: op -> its in-place form, for ops whose first operand is written.
_IN_PLACE = {
    aten.add.Tensor: aten.add_.Tensor,
    aten.sub.Tensor: aten.sub_.Tensor,
    aten.mul.Tensor: aten.mul_.Tensor,
    aten.div.Tensor: aten.div_.Tensor,
    aten.add.Scalar: aten.add_.Scalar,
    aten.sub.Scalar: aten.sub_.Scalar,
    aten.mul.Scalar: aten.mul_.Scalar,
    aten.div.Scalar: aten.div_.Scalar,
    aten.sqrt.default: aten.sqrt_.default,
    aten.rsqrt.default: aten.rsqrt_.default,
    aten.neg.default: aten.neg_.default,
    aten.exp.default: aten.exp_.default,
    aten.abs.default: aten.abs_.default,
    aten.reciprocal.default: aten.reciprocal_.default,
    aten.tanh.default: aten.tanh_.default,
    aten.sigmoid.default: aten.sigmoid_.default,
}
_WRITES = frozenset(_IN_PLACE.values())
#: Tensor-tensor ops whose operands may swap (without ``alpha``): the dead one may be second.
_COMMUTATIVE = frozenset((aten.add.Tensor, aten.mul.Tensor))
#: Returns a view of its input although its schema declares no alias.
_HIDDEN_VIEWS = frozenset((aten._unsafe_view.default,))


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def fresh(node: fx.Node) -> bool:
    """Whether ``node``'s result is new memory nothing else shares: an aten op with one
    return that neither aliases nor mutates (``_unsafe_view`` aside), or an in-place op of
    this module's table on such a result (a chain ``a * 2 + b`` then ``sqrt``). An
    ``all_reduce`` of such a result may reduce it in place (``runtime.donate``)."""
    while node.target in _WRITES and isinstance(node.args[0], fx.Node):
        if len(node.args[0].users) != 1:  # what it wrote is read elsewhere too
            return False
        node = node.args[0]
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if target.namespace != "aten" or target in _HIDDEN_VIEWS or schema.is_mutable:
        return False
    return len(schema.returns) == 1 and schema.returns[0].alias_info is None


def _dead_here(operand: Any, node: fx.Node) -> bool:
    """Whether ``node`` can write its result into ``operand``: a fresh temporary that only
    ``node`` reads (once), laid out as ``node``'s result."""
    a, out = _val(operand), _val(node)
    if a is None or out is None or not fresh(operand) or len(operand.users) != 1:
        return False
    if sum(x is operand for x in (*node.args, *node.kwargs.values())) != 1:
        return False
    same = a.shape == out.shape and a.dtype == out.dtype and a.device == out.device
    return same and a.is_contiguous() and out.is_contiguous()


def _rewrite(node: fx.Node) -> bool:
    in_place = _IN_PLACE.get(node.target)  # type: ignore[call-overload]
    if in_place is None or not node.args:
        return False
    if _dead_here(node.args[0], node):
        node.target = in_place
        return True
    swappable = node.target in _COMMUTATIVE and not node.kwargs and len(node.args) == 2
    if swappable and _val(node.args[0]) is not None and _dead_here(node.args[1], node):
        node.args = (node.args[1], node.args[0])
        node.target = in_place
        return True
    return False


def reuse_dead_operands(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s elementwise ops as in-place ops on a dead operand (see the module
    docstring); returns how many were rewritten. Needs each node's ``meta["val"]``.

    Example (``t = a * 2`` dies at ``t + b``, which becomes ``t.add_(b)``):
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda a, b: a * 2 + b, tracing_mode="fake")(
        ...     torch.ones(3), torch.ones(3))
        >>> reuse_dead_operands(gm)
        1
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-1]
        <OpOverload(op='aten.add_', overload='Tensor')>
    """
    count = sum(_rewrite(node) for node in gm.graph.nodes)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
