"""What an op's local call needs besides resharded operands: tables of per-op argument facts.

The generic lowering (``partition.lower``) emits an op with local shapes. A few ops carry
global facts in their *arguments*: a shape list (reshape, expand, full), an input size as an
int (group norm's ``N``), an index tensor whose padding must still be a valid index, or an
operand of which only the shape is read. This module lists them and rewrites shape arguments;
it emits nothing itself.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "INDEX_OPERANDS",
    "LOCAL_SIZE_ARGS",
    "SAME_DTYPE",
    "SHAPE_ONLY",
    "localize_shape_args",
]

#: Operands that hold indices (their padding must be a valid index): op -> operand positions.
INDEX_OPERANDS: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.gather.default: (1,),
    torch.ops.aten.index_select.default: (1,),
}
#: Ops that read only their operand's shape and dtype (no need to reduce a partial operand).
SHAPE_ONLY = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("empty_like", "full_like", "ones_like", "rand_like", "randn_like", "zeros_like")
)
#: Int arguments that are a size of an operand: op -> {arg position: (operand, dim)}.
LOCAL_SIZE_ARGS: dict[Any, dict[int, tuple[int, int]]] = {
    torch.ops.aten.native_group_norm.default: {3: (0, 0)},
    torch.ops.aten.native_group_norm_backward.default: {5: (0, 0)},
}

#: Ops whose floating-point operands must all have one dtype (no type promotion). Tracing does
#: not check it for some of them (the fake kernels of mm, addmm, mv and CPU attention accept
#: float64 @ float32), so without this table the per-device program would fail when it runs.
SAME_DTYPE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "addbmm",
        "addmm",
        "addmv",
        "baddbmm",
        "bmm",
        "convolution",
        "dot",
        "mm",
        "mv",
        "vdot",
    )
)


def localize_shape_args(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    global_shape: tuple[int, ...],
    local: tuple[int, ...],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Replace the shape argument (a list of ints of the result's rank) by the local shape."""

    def is_shape(a: Any) -> bool:
        return (
            isinstance(a, (list, tuple))
            and len(a) == len(global_shape)
            and all(isinstance(x, int) for x in a)
        )

    new_args = list(args)
    for i, a in enumerate(new_args):
        if is_shape(a):
            new_args[i] = list(local)
            return tuple(new_args), kwargs
    for k, a in kwargs.items():
        if is_shape(a):
            return tuple(new_args), {**kwargs, k: list(local)}
    return tuple(new_args), kwargs
