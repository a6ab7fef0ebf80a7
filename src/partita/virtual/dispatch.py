"""What ``LazyTensor.__torch_dispatch__`` does with an op: run it now, or record it.

:func:`dispatch` is the entry. A pending ``nonzero`` is recorded with a static bound
(:mod:`partita.virtual.bounded`). A few ops run at once (:mod:`partita.virtual.immediate`); a
random op that repeats an earlier draw reads it again (:mod:`partita.virtual.draws`); the
others are *recorded*: the op joins the current :class:`~partita.virtual.recording.Recording`
with its results, which come from shape inference on meta tensors
(:mod:`partita.virtual.shapes`) or, on the fast path, from the guide the recording follows.
This module does not compile or run a step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from partita.virtual import draws
from partita.virtual.bounded import dispatch_bounded
from partita.virtual.cell import Cell
from partita.virtual.immediate import run_now, runs_now
from partita.virtual.lazy import LazyTensor, lazies
from partita.virtual.lift import lift_extras
from partita.virtual.recording import Recording, current
from partita.virtual.shapes import infer, op_info
from partita.virtual.sources import op_source

__all__ = ["dispatch"]


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run (rarely) or record (usually) one aten op on LazyTensors; a pending ``nonzero`` and
    the uses of its padded indices go through :mod:`partita.virtual.bounded` first."""
    out = dispatch_bounded(_unbounded, func, args, kwargs)
    if out is not NotImplemented:
        return out
    return _unbounded(func, args, kwargs)


def _unbounded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if runs_now(func) or "out" in kwargs:
        result = run_now(func, args, kwargs, current())
        if result is not NotImplemented:
            return result
    if draws.is_random(func):  # a draw checkpoint's recomputation repeats (virtual/draws.py)
        return draws.record_draw(func, args, kwargs, _record)
    return _record(func, args, kwargs)


def _record(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rec = current()
    info = op_info(func)
    lifted = info.lifted
    like = torch.float64
    if lifted:
        first = args[0][0] if type(args[0]) in (list, tuple) and args[0] else args[0]  # foreach
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            like = first.dtype  # a Python number meets a float tensor in the tensor's dtype
    targs = tuple(rec.template(a, i in lifted, like) for i, a in enumerate(args))
    tkwargs = tuple((k, rec.template(v, k in lifted, like)) for k, v in kwargs.items())
    if lifted:
        tkwargs += lift_extras(func, args, kwargs)
    view_base: Cell | None = None
    if info.is_view and args:
        first = args[0] if isinstance(args[0], LazyTensor) else next(iter(lazies(args[0])), None)
        view_base = None if first is None else first._cell
    entry = rec.follow(func, targs, tkwargs)
    if entry is not None:
        description = rec.guide.results[len(rec.ops)]  # type: ignore[union-attr]
        result = _from_description(description, rec, args, kwargs, view_base)
    else:
        result, outs, description = _infer_results(rec, func, args, kwargs, lifted, view_base)
        entry = (func, targs, tkwargs, tuple(outs))
        rec.sources.append(op_source(rec.forward_sources))  # the fast path's are its guide's
    for t in info.mutated(func, args, kwargs):
        t._cell.base.dirty = True
    rec.ops.append(entry)
    rec.results.append(description)
    return result


def _new_result(rec: Recording, meta: Any, desc: Any, view_base: Cell | None) -> LazyTensor:
    cell = Cell(meta, base=view_base, desc=desc)
    cell.epoch, cell.slot = rec.epoch, rec.new_slot()
    t = LazyTensor(cell)
    rec.live.append((weakref.ref(t), cell))
    return t


def _infer_results(
    rec: Recording,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lifted: frozenset[int | str],
    view_base: Cell | None,
) -> tuple[Any, list[int | None], Any]:
    """The op's results by shape inference: the results, their slots and their description
    (how the fast path makes them again: ``("new", desc)``, ``("arg", i)`` for the i-th
    LazyTensor argument returned by an in-place op, ``("value", v)``, ``("seq", type, ...)``)."""
    meta_out = infer(func, args, kwargs, lifted)
    found = lazies((args, kwargs))
    by_meta = {id(t._cell.meta): (i, t) for i, t in enumerate(found)}
    outs: list[int | None] = []

    def wrap(m: Any) -> tuple[Any, Any]:
        if not isinstance(m, torch.Tensor):
            outs.append(None)
            return m, ("value", m)
        same = by_meta.get(id(m))
        if same is not None:  # an in-place op returns its argument
            outs.append(same[1]._cell.slot)
            return same[1], ("arg", same[0])
        t = _new_result(rec, m, None, view_base)
        outs.append(t._cell.slot)
        return t, ("new", t._cell.desc)

    if isinstance(meta_out, (list, tuple)):
        pairs = [wrap(m) for m in meta_out]
        result: Any = type(meta_out)(r for r, _ in pairs)
        description: Any = ("seq", type(meta_out), tuple(d for _, d in pairs))
    else:
        result, description = wrap(meta_out)
    return result, outs, description


def _from_description(
    description: Any,
    rec: Recording,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    view_base: Cell | None,
) -> Any:
    """The op's results made again from the guide (the slots come out as the guide's)."""
    kind = description[0]
    if kind == "new":
        return _new_result(rec, None, description[1], view_base)
    if kind == "arg":  # an in-place op: almost always its first argument
        if description[1] == 0 and isinstance(args[0], LazyTensor):
            return args[0]
        return lazies((args, kwargs))[description[1]]
    if kind == "seq":
        return description[1](
            _from_description(d, rec, args, kwargs, view_base) for d in description[2]
        )
    return description[1]
