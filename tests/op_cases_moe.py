"""Op cases of the grouped products (rules/grouped.py): ``aten._grouped_mm`` in its four forms.

The offsets are constants of the function (lifted as replicated inputs) and end at the last
row, so that no row of the result is left uninitialised by the kernel; sizes are multiples of
64 (the CPU kernel wants 16-byte strides, also of a tile split 8 ways). The operands are
bfloat16 (the op's meta kernel, which tracing runs, takes no other dtype) holding -1, 0 or 1:
every product and sum is exact, so a sharded contraction equals the unsharded one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from op_cases import case  # isort: skip

aten = torch.ops.aten

_ROWS = torch.tensor([3, 7, 12], dtype=torch.int32)  # 3 groups of 12 rows


def _small(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(-1, 2, shape, generator=g).to(torch.bfloat16)


def _grouped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in 3 groups, each times its expert's matrix (the MoE forward). The other
    forms, in the backward, are checked by tests/test_moe_rules.py."""
    return aten._grouped_mm.default(x, w, _ROWS)


case(aten._grouped_mm.default, _grouped, _small(12, 64), _small(3, 64, 64))
