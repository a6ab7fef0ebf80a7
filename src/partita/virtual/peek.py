"""Branching on a small pending condition without cutting the step: its ops replayed on the CPU.

Library code branches on values in the middle of a forward: Hugging Face's masks check
``(position_ids[:, -1] == 0).all()``. Reading a pending value syncs, which cuts the step in two
programs (a second run per step, the first part's values materialised). For a boolean read as a
Python ``bool`` (:mod:`partita.virtual.immediate`; ``.item()``, ``.cpu()`` and ``print`` of any
other value still sync, as documented), when the value depends
only on a few deterministic ops over small inputs (an ``arange``, the batch's ids, a mask),
:func:`peek` computes it from the recording instead: those ops run again on the CPU, on the
inputs' whole values, and the recording goes on untouched (the step's program computes the
value again, the same way). Anything else (more than :data:`MAX_OPS` ops, an input larger than
:data:`MAX_ELEMENTS`, a random op, an in-place update, an annotation) returns None and the
caller syncs. This module does not compile or record.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from partita.values.tensor import ShardedTensor
from partita.virtual import recording
from partita.virtual.cell import Cell
from partita.virtual.lift import replay_op
from partita.virtual.shapes import op_info

__all__ = ["MAX_ELEMENTS", "MAX_OPS", "peek"]

#: At most this many recorded ops are replayed for one read.
MAX_OPS = 64
#: Each input of those ops holds at most this many elements.
MAX_ELEMENTS = 1 << 16

_SEEDED = torch.Tag.nondeterministic_seeded


def _slots(template: Any, out: set[int]) -> None:
    kind, value = template
    if kind == "t":
        out.add(value)
    elif kind == "l":
        for v in value:
            _slots(v, out)


def _replayable(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith("aten::"):
        return False  # an annotation, a custom op
    return _SEEDED not in func.tags and not op_info(func).writes


def peek(cell: Cell) -> torch.Tensor | None:
    """The value of pending ``cell`` computed on the side, or None when the step must sync."""
    rec = recording.current()
    if cell.epoch != rec.epoch or cell.slot is None or cell.base is not cell:
        return None  # a view, or a value of no current slot: sync
    needed, chosen = {cell.slot}, list[int]()
    for index in range(len(rec.ops) - 1, -1, -1):
        func, targs, tkwargs, outs = rec.ops[index]
        writes = op_info(func).writes if hasattr(func, "_schema") else ()
        if any(targs[i][0] == "t" and targs[i][1] in needed for i in writes if i < len(targs)):
            return None  # a needed value is updated in place later on
        if not any(o in needed for o in outs if o is not None):
            continue
        if len(chosen) == MAX_OPS or not _replayable(func):
            return None
        chosen.append(index)
        needed.difference_update(outs)
        for t in (*targs, *(t for _, t in tkwargs)):
            _slots(t, needed)
    inputs = dict(rec.inputs)
    env: dict[int, Any] = {}
    for slot in needed:
        value: Cell | torch.Tensor | ShardedTensor | None = inputs.get(slot)
        if isinstance(value, Cell):
            if value.base.dirty:
                return None
            value = value.data
        if value is None or math.prod(value.shape) > MAX_ELEMENTS:  # a ShardedTensor too
            return None
        env[slot] = value.full() if isinstance(value, ShardedTensor) else value
    for index in reversed(chosen):
        func, targs, tkwargs, outs = rec.ops[index]
        args = tuple(recording.build(t, env, rec.scalars) for t in targs)
        kwargs = {k: recording.build(t, env, rec.scalars) for k, t in tkwargs}
        result = replay_op(func, args, kwargs)
        flat = result if isinstance(result, (list, tuple)) else [result]
        for out_slot, out in zip(outs, flat, strict=False):
            if out_slot is not None:
                env[out_slot] = out
    return env[cell.slot]
