"""Ops and torch constants found by their exact names, for names read from data.

Names that come from a file or a string argument (the compile cache, the random-draw op) are
looked up here, never by walking attributes: ``getattr`` chains over ``torch.ops`` reach
``torch.ops.load_library`` and anything else Python can reach from there. An op is found only
when its namespace is one the caller allows, each part is a plain identifier, the dispatcher
knows an op of exactly that name and overload, and the object found is that
``torch._ops.OpOverload``. A torch constant (dtype, layout, memory format) is found in a table
built from ``torch``'s own names.

This module computes nothing; it names.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

__all__ = ["TORCH_CONSTANTS", "find_op", "torch_constant"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Every dtype, layout and memory format by its name in ``torch`` (``"float32"``, ``"strided"``).
TORCH_CONSTANTS: dict[str, torch.dtype | torch.layout | torch.memory_format] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}


def find_op(
    namespace: Any, name: Any, overload: Any, namespaces: Collection[str]
) -> torch._ops.OpOverload | None:
    """The op ``namespace::name.overload`` if ``namespace`` is in ``namespaces`` and the
    dispatcher has exactly that op, else None (nothing else is looked up or called)."""
    parts = (namespace, name, overload)
    if not all(isinstance(p, str) and _IDENTIFIER.match(p) for p in parts):
        return None
    if namespace not in namespaces:
        return None
    try:  # the dispatcher's own table: no Python attribute is involved
        torch._C._get_schema(f"{namespace}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if (op.namespace, op._opname, op._overloadname) != parts:
        return None
    return op


def torch_constant(name: Any, kind: type | tuple[type, ...]) -> Any:
    """The torch constant named ``name`` if it is a ``kind``, else None."""
    value = TORCH_CONSTANTS.get(name) if isinstance(name, str) else None
    return value if isinstance(value, kind) else None
