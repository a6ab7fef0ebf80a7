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


def _half_sum(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    out = dtype if dtype is not None else x.dtype
    if out not in _HALF or not x.dtype.is_floating_point:
        return NotImplemented
    return aten.sum.dim_IntList(x, dim, keepdim, dtype=torch.float32).to(out)


def _half_sum_default(x: torch.Tensor, *, dtype: Any = None) -> Any:
    return _half_sum(x, None, False, dtype=dtype)


def _half_mean(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> Any:
    out = dtype if dtype is not None else x.dtype
    if out not in _HALF or not x.dtype.is_floating_point:
        return NotImplemented
    return aten.mean.dim(x, dim, keepdim, dtype=torch.float32).to(out)


def _half_mean_default(x: torch.Tensor, *, dtype: Any = None) -> Any:
    return _half_mean(x, None, False, dtype=dtype)


#: The entries: ``sum`` and ``mean`` (every overload a program records) of float16/bfloat16.
HALF_REDUCTION_OPS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.sum.default: _half_sum_default,
    aten.sum.dim_IntList: _half_sum,
    aten.mean.default: _half_mean_default,
    aten.mean.dim: _half_mean,
}
