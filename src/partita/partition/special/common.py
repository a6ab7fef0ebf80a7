"""What the special handlers read about an op: its fake values, the mesh axes a rule's factor
assignment gives an operand dim, an operand's sharding and the accumulation dtype. (What they
emit goes through ``partition.emit``.)"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partita.partition.lowering_api import LoweringAPI
from partita.rules import FactorRule
from partita.values.spec import Sharding

__all__ = ["acc_dtype", "axes_of", "fake_value", "operand_sharding"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


def fake_value(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def axes_of(rule: FactorRule, tensor: int, dim: int, assign: Assign) -> tuple[str, ...]:
    factors = rule.operands[tensor]
    if factors is None:
        return ()
    return tuple(a for f in factors[dim] for a in assign.get(f, ()))


def operand_sharding(low: LoweringAPI, rule: FactorRule, i: int, assign: Assign) -> Sharding:
    factors = rule.operands[i]
    assert factors is not None
    return Sharding(low.mesh, low.dims_of(factors, assign))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
