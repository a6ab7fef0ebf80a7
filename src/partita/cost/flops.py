"""The FLOPs and the memory traffic of one fx node, from the shapes its meta values carry.

:func:`node_flops` uses torch's own formulas (``torch.utils.flop_counter``: matmuls,
convolutions, attention, their backwards; partita's own ``sdpa`` / ``sdpa_backward`` with the
formulas torch's counter applies to its fused attention kernels) and counts one FLOP per
output element for any other op that computes; views, getitems and partita's mesh ops count
zero. :func:`node_bytes`
is the bytes an op reads and writes (its tensor operands and results), zero for a view. The
values come from ``node.meta["val"]`` (fake or meta tensors), so nothing is computed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

__all__ = ["first_read", "is_view", "is_view_of", "node_bytes", "node_flops", "value_bytes"]


def _val(x: Any, vals: Mapping[fx.Node, Any] | None = None) -> Any:
    if not isinstance(x, fx.Node):
        return x
    return vals[x] if vals is not None and x in vals else x.meta.get("val")


def _tensors(x: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(x)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def value_bytes(val: Any) -> int:
    """Bytes of a value: a tensor, or a list/tuple of them (nested); 0 for anything else."""
    if isinstance(val, torch.Tensor):
        return _nbytes(val)
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    return 0


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s result shares its first input's storage (a view or a getitem)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def is_view_of(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` is a view of ``node`` (its first operand, sharing its storage)."""
    return bool(user.args) and user.args[0] is node and is_view(user)


def first_read(node: fx.Node, pos: Mapping[fx.Node, float], end: float) -> float:
    """Where ``node``'s result is first read, by the positions ``pos``: a view of it (a
    bucket's getitem, a transpose or reshape of a gradient on its way to the optimizer) reads
    nothing, its users do; ``end`` when nothing reads it. The runtime waits for an
    asynchronous collective there, and the step estimate charges its wait there."""
    uses = [first_read(u, pos, end) if is_view_of(u, node) else pos[u] for u in node.users]
    return min(uses, default=end)


#: partita's ops that compute (the others move data between devices or name an index).
_PARTITA_COMPUTE = ("sdpa", "sdpa_backward")


def _partita_name(node: fx.Node) -> str | None:
    """``sdpa`` for ``partita::sdpa.default`` and so on; None for any other namespace."""
    if getattr(node.target, "namespace", "") != "partita":
        return None
    schema = node.target._schema  # type: ignore[union-attr]
    return str(schema.name).split("::")[-1]


def _computes(node: fx.Node) -> bool:
    if node.op != "call_function" or is_view(node):
        return False
    name = _partita_name(node)
    return name is None or name in _PARTITA_COMPUTE


def _bhsd(shape: Any) -> tuple[int, int, int, int]:
    """An attention operand's shape as torch's counter takes it, ``(batch, heads, length,
    dim)``: leading dims beyond the heads folded into the batch, no heads dim counted as 1."""
    dims = [int(d) for d in shape]
    while len(dims) < 4:
        dims.insert(0, 1)
    return math.prod(dims[:-3]), dims[-3], dims[-2], dims[-1]


def _attention_flops(name: str, args: tuple[Any, ...]) -> int:
    """FLOPs of ``partita::sdpa`` (``args``: query, key, value, ...) or ``sdpa_backward``
    (grad_out, query, key, value, ...): torch's ``sdpa_flop_count`` and
    ``sdpa_backward_flop_count``, the formulas ``flop_counter`` registers for aten's fused
    attention (two batched matmuls forward, five backward; a causal mask is not discounted)."""
    shapes = [_bhsd(a.shape) for a in args[:4] if isinstance(a, torch.Tensor)]
    if name == "sdpa":
        return int(sdpa_flop_count(*shapes[:3]))
    return int(sdpa_backward_flop_count(*shapes[:4]))


def node_flops(node: fx.Node, vals: Mapping[fx.Node, Any] | None = None) -> int:
    """Floating-point operations of ``node`` (0 for a placeholder, view or mesh op); the
    values are ``vals[node]`` where given, else ``node.meta["val"]``."""
    if not _computes(node):
        return 0
    out = _val(node, vals)
    if (name := _partita_name(node)) is not None:
        return _attention_flops(name, tuple(_val(a, vals) for a in node.args))
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is not None:  # torch's formulas take the tensors and the result (``out_val``)
        args = tree_map(lambda x: _val(x, vals), node.args)
        kwargs = tree_map(lambda x: _val(x, vals), node.kwargs)
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments
            pass
    return sum(math.prod(t.shape) for t in _tensors(out))


def node_bytes(node: fx.Node, vals: Mapping[fx.Node, Any] | None = None) -> int:
    """Bytes ``node`` reads and writes: its tensor operands and results (0 for a view)."""
    if not _computes(node):
        return 0
    ins = sum(_nbytes(t) for a in node.all_input_nodes for t in _tensors(_val(a, vals)))
    return ins + sum(_nbytes(t) for t in _tensors(_val(node, vals)))
