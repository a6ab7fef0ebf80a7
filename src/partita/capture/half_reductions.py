"""float16/bfloat16 ``sum`` and ``mean`` traced as eager computes them: in float32, rounded once.

Eager PyTorch accumulates a half-precision sum in float32 and rounds the result once. The
entries of :data:`HALF_REDUCTION_OPS` (in the table ``decomposition_table()`` of
:mod:`partita.capture.decompositions`) write that rounding into the program: ``x.sum()`` of a
float16 ``x`` becomes ``sum(x, dtype=float32).to(float16)``, the same value. A reduction
sharded over the mesh then adds its per-device partials in float32 (the all_reduce or
reduce_scatter moves float32, twice the bytes) and rounds after: partials that overflow
float16 on their own (+-80000 on two devices) do not turn a finite eager result into inf or
NaN. Other dtypes trace as themselves (the entries return ``NotImplemented``). This module
does not trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HALF_REDUCTION_OPS"]

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def _in_float32(reduce: torch._ops.OpOverload) -> Callable[..., Any]:
    """``reduce(x, dim, keepdim, dtype=float32).to(dtype)`` for a half-precision result, else
    ``NotImplemented`` (the op traces as itself)."""

    def half(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        out = dtype if dtype is not None else x.dtype
        if out not in _HALF or not x.dtype.is_floating_point:
            return NotImplemented
        return reduce(x, dim, keepdim, dtype=torch.float32).to(out)

    return half


_half_sum, _half_mean = _in_float32(aten.sum.dim_IntList), _in_float32(aten.mean.dim)


#: The entries: ``sum`` and ``mean`` (every overload a program records) of float16/bfloat16.
HALF_REDUCTION_OPS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.sum.default: lambda x, *, dtype=None: _half_sum(x, None, False, dtype=dtype),
    aten.sum.dim_IntList: _half_sum,
    aten.mean.default: lambda x, *, dtype=None: _half_mean(x, None, False, dtype=dtype),
    aten.mean.dim: _half_mean,
}
