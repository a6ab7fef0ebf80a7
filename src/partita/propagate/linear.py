"""Which ops keep a partial sum partial, from their ``OpFacts.linear`` (declared by the rules).

A *partial* value is a sum pending over some mesh axes: each device holds one addend. A linear
op commutes with that sum, ``f(a1 + ... + an) = f(a1) + ... + f(an)``, so it can run on the
addends and the sum be taken once, later. This is what makes the gradient of a weight used at
every step of a recurrent loop cost one reduction per sequence, not one per step: autograd adds
the per-step contributions, each a partial sum over the batch axes, with ``add``.

Which operands may be partial (``OpFacts.linear``):

* ``"addends"`` (``add``, ``sub``): both tensor operands, partial over the same axes;
  ``p + r`` with ``r`` whole is not a partial sum (``r`` would be counted once per device).
* ``"scaled"`` (``mul``): exactly one tensor operand; the others are whole (a factor).
* ``"first"`` (``div``, ``neg``, views and reshapes, ``sum``, ``clone``): the first operand
  only; the others (a divisor) are whole.

Partita keeps a partial value partial through such an op only when no tensor of the op has a
split dim: every device then holds whole-shaped addends and runs the op with its global
arguments, and the sum is a plain ``sum`` (not ``max``). Each partial operand must have no
other user: one that needs the operand whole would reduce it anyway, and the kept sum would be
a second reduction (AdamW reads a gradient in two ops). Not in float16: two addends of one
device can overflow where their reduced values would not (``bfloat16`` has float32's range).
Propagation decides it
(``propagate.pending``) and the partitioner lowers it (``partition.pending``), both with
:func:`kept_partial`, each reading its own view of the operands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from partita.rules.factor import FactorRule
from partita.rules.opinfo import is_tensor

__all__ = ["Look", "kept_partial"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.complex128)

#: What a stage knows of a tensor operand: (partial axes, reduce op, has a split dim), or None
#: when it cannot say (a value it does not track): the op then reduces as usual.
Look = Callable[[fx.Node], "tuple[tuple[str, ...], str, bool] | None"]


def kept_partial(node: fx.Node, rule: FactorRule, look: Look) -> tuple[str, ...]:
    """The mesh axes the result of ``node`` stays partial over (empty: none, reduce first).

    Example: ``add(a, b)`` with ``a`` and ``b`` both ``P(None, None) partial[sum](data)`` gives
    ``("data",)``; ``add(a, w)`` with ``w`` replicated gives ``()``.
    """
    kind = rule.facts.linear
    val = node.meta.get("val")
    if not kind or len(rule.results) != 1 or not isinstance(val, torch.Tensor):
        return ()
    if val.dtype not in _DTYPES:
        return ()
    if any(isinstance(a, fx.Node) for a in node.kwargs.values()):
        return ()  # a tensor passed by keyword: not a form the table describes
    tensors = [
        (i, a)
        for i, a in enumerate(node.args)
        if isinstance(a, fx.Node) and is_tensor(a.meta.get("val"))
    ]
    states = [look(a) for _, a in tensors]
    if not tensors or any(s is None or s[2] for s in states):
        return ()
    known = [s for s in states if s is not None]
    partial = [i for (i, _), s in zip(tensors, known, strict=True) if s[0]]
    if not partial:
        return ()
    axes = {(s[0], s[1]) for s in known if s[0]}
    if len(axes) != 1 or next(iter(axes))[1] != "sum":
        return ()
    if any(len(a.users) > 1 for (i, a) in tensors if i in partial):
        return ()  # another user reduces it anyway: reduce once, before both
    if kind == "addends":
        ok = partial == [0, 1] and len(tensors) == 2
    elif kind == "scaled":
        ok = len(partial) == 1
    else:
        ok = partial == [0]
    return next(iter(axes))[0] if ok else ()
