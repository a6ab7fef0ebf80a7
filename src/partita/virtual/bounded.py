"""``nonzero`` and the one-argument ``torch.where`` on the virtual device, with a static bound.

The hand-written mixture of experts (``tok, slot = torch.where(idx == e)`` then ``index_add``)
would make a step's shapes depend on the routing: each step a new program. On a *pending* mask
(computed in the step being recorded) ``nonzero`` is recorded as ``nonzero_static`` padded to
the mask's size, as :mod:`partita.capture.bounded` traces it, and the gathers and accumulating
scatters by the padded indices are recorded masked: the step's program no longer depends on
the data, is compiled once, and gives eager's numbers. A mask that is data (its value known
now) still runs at once, exactly as before.

Any other use of padded indices (arithmetic, a comparison, a select of one row, ``.cpu()``)
reads their exact value instead: the step syncs, the padding is dropped, and the op runs on the
true positions, as eagerly. What stays visible is the padded tensor's own shape (``tok.shape[0]``
is the bound, not the count) and its printed value (``tolist``, ``repr``: rows of -1 at the end).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.capture.bounded import BoundedIndices
from partita.virtual.lazy import LazyTensor, full_value, new_data
from partita.virtual.state import DEVICE_NAME

__all__ = ["dispatch_bounded"]

aten = torch.ops.aten
#: The attribute of a LazyTensor holding padded indices: ``(user line, bound)``.
_ATTRIBUTE = "_partita_padded"


class _RefusedError(Exception):
    """A use of padded indices that would let the padding reach the numbers."""


class _StepBounded(BoundedIndices):
    """The padded indices of the virtual device, marked on the tensors themselves (they
    outlive a step's recording)."""

    def __init__(self) -> None:
        super().__init__()
        # the padded tensors alive, by id (a WeakSet would compare tensors with ==, an op)
        self.live: dict[int, weakref.ref[LazyTensor]] = {}
        self._bound = 1

    def is_padded(self, t: Any) -> bool:
        return isinstance(t, LazyTensor) and getattr(t, _ATTRIBUTE, None) is not None

    def where_of(self, t: torch.Tensor) -> str:
        return str(getattr(t, _ATTRIBUTE)[0])

    def _mark(self, where: str, out: Any) -> Any:
        for t in pytree.tree_leaves(out):
            if isinstance(t, LazyTensor):
                setattr(t, _ATTRIBUTE, (where, self._bound))
                self.live[id(t)] = weakref.ref(t, functools.partial(self._forget, id(t)))
        return out

    def _forget(self, ident: int, ref: Any) -> None:
        if self.live.get(ident) is ref:
            del self.live[ident]

    def _refuse(self, func: Any, why: str) -> Any:
        raise _RefusedError(f"{func} {why}")


_BOUNDED = _StepBounded()


def dispatch_bounded(
    call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``func`` recorded with ``call`` (the device's dispatch without this step), bounded; or
    NotImplemented when neither a pending ``nonzero`` nor padded indices are involved."""
    if func is aten.nonzero.default:
        if not (isinstance(args[0], LazyTensor) and args[0]._cell.is_pending):
            return NotImplemented  # data: run now, exactly (partita.virtual.immediate)
        _BOUNDED._bound = max(args[0].numel(), 1)
        return _BOUNDED.dispatch(call, func, args, kwargs)
    if not _BOUNDED.live:  # the usual case: no padded indices alive, nothing to look at
        return NotImplemented
    padded = _first_padded(args)
    if padded is None:
        padded = _first_padded(kwargs.values())
    if padded is None:
        return NotImplemented
    _BOUNDED._bound = getattr(padded, _ATTRIBUTE)[1]
    device = kwargs.get("device")
    leaves_device = device is not None and torch.device(device).type != DEVICE_NAME
    if not (func is aten._to_copy.default and leaves_device):
        try:
            return _BOUNDED.dispatch(call, func, args, kwargs)
        except _RefusedError:
            pass
    exact = pytree.tree_map(lambda t: _exact(t) if _BOUNDED.is_padded(t) else t, (args, kwargs))
    return call(func, *exact)


def _first_padded(args: Iterable[Any]) -> LazyTensor | None:
    """The first padded indices among ``args`` and the lists in them (as ops take them)."""
    for a in args:
        if type(a) in (list, tuple):
            found = _first_padded(a)
            if found is not None:
                return found
        elif _BOUNDED.is_padded(a):
            return a
    return None


def _exact(t: LazyTensor) -> LazyTensor:
    """The true positions of padded indices ``t`` (syncs: their number is the data's)."""
    bound = getattr(t, _ATTRIBUTE)[1]
    value = full_value(t)
    if value.ndim == 0:
        return new_data(value)
    rows = next((d for d in range(value.ndim) if value.shape[d] == bound), 0)
    keep = (value >= 0).movedim(rows, 0).reshape(value.shape[rows], -1).all(1)
    return new_data(value.index_select(rows, keep.nonzero().flatten()))
