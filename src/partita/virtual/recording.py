"""Recording: every op on the virtual device appends to the current step's op list.

:func:`dispatch` is what ``LazyTensor.__torch_dispatch__`` calls. Most ops are *recorded*: their
output shapes come from running the op on meta tensors, and the op joins the current
:class:`Recording` as ``(op, argument template, output slots)``, where a template refers to
earlier values by slot, to lifted Python floats by index, and holds every other argument as a
constant. Tensors enter a recording as *inputs*: a data cell of the virtual device, or a CPU
tensor used by an op (copied when recorded, so a later in-place change, such as a scheduler
updating a tensor learning rate, does not reach this step).

A few ops run at once instead: ``.item()`` and ``.cpu()`` (sync, then read), uploads
(``copy_`` of a CPU tensor into a new device tensor: what ``tensor.to(dev)`` does), and
``zeros_like``/``fill_`` on data (so the optimizer's state initialisation is data, not a second
program). The structural key of a recording (:meth:`Recording.key`) holds ops, constants,
shapes, dtypes and input shardings but not the lifted floats, so a learning rate or Adam's bias
corrections that change every step leave the key unchanged. This module does not compile.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from partita.tensor import ShardedTensor
from partita.virtual.device import DEVICE_NAME, VirtualDeviceError
from partita.virtual.lazy import Cell, LazyTensor, full_value
from partita.virtual.lift import liftable_positions

__all__ = ["Recording", "current", "dispatch", "new_data", "record_annotation", "reset"]

aten = torch.ops.aten
_SHARE_CELL = frozenset({aten.detach.default, aten.alias.default})
_LIKE = {
    aten.zeros_like.default: 0,
    aten.ones_like.default: 1,
    aten.empty_like.default: 0,
}
_FILLS = frozenset({aten.zero_.default, aten.fill_.Scalar})
_CPU = torch.device("cpu")
_META = torch.device("meta")


@dataclass
class Recording:
    """The ops recorded since the last sync (one step of the program).

    Attributes:
        epoch: distinguishes this recording's slots from earlier ones.
        ops: ``(op, args template, kwargs template, output slots)`` in program order.
        inputs: ``(slot, value)`` per input: a data Cell or a copied CPU tensor.
        scalars: the lifted Python floats, in order.
        live: weak references to the tensors created here (the candidate outputs).
    """

    epoch: int
    ops: list[tuple[Any, Any, Any, tuple[int | None, ...]]] = field(default_factory=list)
    inputs: list[tuple[int, Cell | torch.Tensor]] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    live: list[tuple[weakref.ref[LazyTensor], Cell]] = field(default_factory=list)
    n_slots: int = 0
    _key: list[Any] = field(default_factory=list)
    _snapshots: dict[tuple[int, int], int] = field(default_factory=dict)

    def new_slot(self) -> int:
        self.n_slots += 1
        return self.n_slots - 1

    def slot_of(self, cell: Cell) -> int:
        """The cell's slot here; a data cell not used yet becomes an input."""
        if cell.epoch == self.epoch and cell.slot is not None:
            return cell.slot
        if not cell.has_value:
            raise VirtualDeviceError(
                "partita.sync: a pending value of an earlier step was used after that step ran "
                "without being kept (it was not alive at the sync). This is a partita bug; "
                "please report the loop that triggers it."
            )
        cell.epoch, cell.slot = self.epoch, self.new_slot()
        self.inputs.append((cell.slot, cell))
        return cell.slot

    def snapshot(self, t: torch.Tensor) -> int:
        """A slot for a CPU tensor, copied now (one copy per tensor version)."""
        ident = (id(t), t._version)
        if ident not in self._snapshots:
            slot = self.new_slot()
            self.inputs.append((slot, t.detach().clone()))
            self._snapshots[ident] = slot
        return self._snapshots[ident]

    def template(self, x: Any, lift: bool) -> Any:
        if isinstance(x, LazyTensor):
            return ("t", self.slot_of(x._cell))
        if isinstance(x, torch.Tensor):
            return ("t", self.snapshot(x))
        if isinstance(x, ShardedTensor):
            raise VirtualDeviceError(
                f"An op on the virtual device got a ShardedTensor of shape {tuple(x.shape)} "
                f"({x.spec}) inside a list argument, where it cannot be converted: ops mix "
                f"device tensors with ShardedTensors only as direct arguments. Pass x.full(), "
                f"or move the value to the device (x.full().to(dev)) and mark_sharding it."
            )
        if lift and type(x) is float:
            self.scalars.append(x)
            return ("s", len(self.scalars) - 1)
        if isinstance(x, (list, tuple)):
            return ("l", tuple(self.template(v, lift) for v in x))
        if isinstance(x, torch.device) and x.type == DEVICE_NAME:
            return ("c", _CPU)
        return ("c", x)

    def key(self) -> tuple[Any, ...]:
        """The structural key: ops, constants and input shapes/dtypes/shardings."""
        described = []
        for _, value in self.inputs:
            if isinstance(value, Cell):
                data = value.data
                # A plain tensor is replicated: the same input as a replicated ShardedTensor.
                sharding = data.sharding if isinstance(data, ShardedTensor) else "replicated"
                if getattr(sharding, "is_replicated", False) and not sharding.partial:
                    sharding = "replicated"
                described.append((tuple(value.meta.shape), value.meta.dtype, sharding))
            else:
                described.append(("cpu", tuple(value.shape), value.dtype))
        return (tuple(self._key), tuple(described))


_STATE: dict[str, Any] = {"epoch": 0, "recording": None}


def current() -> Recording:
    """The recording of the step being recorded now."""
    rec = _STATE["recording"]
    if rec is None:
        _STATE["epoch"] += 1
        rec = _STATE["recording"] = Recording(_STATE["epoch"])
    return rec


def reset() -> Recording | None:
    """End the current recording (a sync does this) and return it."""
    rec, _STATE["recording"] = _STATE["recording"], None
    return rec


def new_data(value: torch.Tensor | ShardedTensor, requires_grad: bool = False) -> LazyTensor:
    """A LazyTensor holding ``value`` as data."""
    meta = torch.empty(tuple(value.shape), dtype=value.dtype, device=_META)
    return LazyTensor(Cell(meta, value), requires_grad=requires_grad)


def _to_meta(x: Any) -> Any:
    if isinstance(x, LazyTensor):
        return x._cell.meta if x._cell.meta.shape == x.shape else x._cell.meta.view(x.shape)
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, torch.device) and x.type == DEVICE_NAME:
        return _META
    return x


def _lazies(x: Any) -> list[LazyTensor]:
    if isinstance(x, LazyTensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _lazies(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _lazies(v)]
    return []


def _is_clean_data(cell: Cell, unused: bool = False) -> bool:
    """Data whose value is known now (and, with ``unused``, not read by this recording yet, so
    changing it at once cannot reach an op recorded before)."""
    if not cell.has_value or cell.base.dirty:
        return False
    return not unused or cell.epoch != current().epoch


def _eager(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops that run now rather than being recorded (see the module docstring)."""
    if func is aten._local_scalar_dense.default:
        return full_value(args[0]).item()
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != DEVICE_NAME:
            return aten._to_copy.default(full_value(args[0]), **kwargs)
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if not isinstance(dst, LazyTensor):
            return dst.copy_(full_value(src))
        if not isinstance(src, LazyTensor) and _is_clean_data(dst._cell, unused=True):
            value = src.detach().to(dst.dtype).expand(dst.shape).clone()
            old = dst._cell.data
            dst._cell.data = (
                ShardedTensor.from_global(value, old.sharding)
                if isinstance(old, ShardedTensor)
                else value
            )
            return dst
    if func in _SHARE_CELL:
        shared = LazyTensor(args[0]._cell)
        if not args[0]._cell.has_value:  # pending: this tensor may outlive the original
            current().live.append((weakref.ref(shared), args[0]._cell))
        return shared
    if func in _LIKE and _is_clean_data(args[0]._cell) and kwargs.get("device") is None:
        src = args[0]
        value = torch.full(src.shape, _LIKE[func], dtype=kwargs.get("dtype") or src.dtype)
        old = src._cell.data
        if isinstance(old, ShardedTensor):
            return new_data(ShardedTensor.from_global(value, old.sharding))
        return new_data(value)
    out = kwargs.get("out")
    if isinstance(out, LazyTensor) and not _lazies(args) and _is_clean_data(out._cell, True):
        # A factory writing into a new device tensor (torch.arange(n, device=dev)): data now.
        # The kernel resizes its ``out`` (empty for a factory); a wrapper cannot be resized,
        # so the result is a new device tensor.
        value = torch.empty(out.shape, dtype=out.dtype)
        func(*args, **{**kwargs, "out": value})
        if value.shape == out.shape:
            out._cell.data = value
            return out
        return new_data(value)
    if func in _FILLS and _is_clean_data(args[0]._cell, unused=True):
        cell = args[0]._cell
        value = torch.full(args[0].shape, args[1] if len(args) > 1 else 0, dtype=args[0].dtype)
        old = cell.data
        cell.data = (
            ShardedTensor.from_global(value, old.sharding)
            if isinstance(old, ShardedTensor)
            else value
        )
        return args[0]
    return NotImplemented


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run (rarely) or record (usually) one aten op on LazyTensors."""
    result = _eager(func, args, kwargs)
    if result is not NotImplemented:
        return result
    return _record(func, args, kwargs)


def record_annotation(t: LazyTensor, annotate: Any, mesh: Any, spec: Any) -> None:
    """Record ``annotate(t, mesh, spec)`` on a pending tensor: its later uses see the
    annotated value (``mark_sharding`` in place on a value being computed)."""
    rec = current()
    slot = rec.slot_of(t._cell)
    entry = (annotate, (("t", slot), ("c", mesh), ("c", spec)), (), (slot,))
    rec.ops.append(entry)
    rec._key.append(entry)


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[LazyTensor]:
    """The LazyTensors an op writes to (its ``(a!)`` arguments; batch norm's running stats,
    which its schema does not mark)."""
    positions = [
        i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write
    ]
    if func is aten.native_batch_norm.default and args[5]:
        positions += [3, 4]
    names = [a.name for a in func._schema.arguments if a.alias_info and a.alias_info.is_write]
    found = [t for i in positions if i < len(args) for t in _lazies(args[i])]
    return found + [t for name in names for t in _lazies(kwargs.get(name))]


#: Output metadata by (op, argument metadata): shape inference on meta tensors costs far more
#: than the rest of recording, and a training loop repeats the same calls every step.
_META_MEMO: dict[Any, Any] = {}
_MEMO_LIMIT = 100_000


def _meta_key(x: Any, lifted: bool = False) -> Any:
    if isinstance(x, LazyTensor):
        return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, torch.Tensor):
        return ("C", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_meta_key(v) for v in x)
    if lifted and type(x) is float:
        return "float"  # a lifted number never decides a shape
    hash(x)  # an unhashable argument: no memo (TypeError)
    return (type(x), x)


def _infer(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lifted: Any) -> Any:
    """The op's output as meta tensors (an input's meta where the op returns its argument)."""
    lazies = _lazies((args, kwargs))
    try:
        key: Any = (
            func,
            tuple(_meta_key(a, i in lifted) for i, a in enumerate(args)),
            tuple((k, _meta_key(v, k in lifted)) for k, v in kwargs.items()),
        )
        memo = _META_MEMO.get(key)
    except TypeError:
        key, memo = None, None
    if memo is None:
        with _disable_current_modes():
            out = func(*_to_meta(args), **_to_meta(kwargs))
        if key is not None:
            if len(_META_MEMO) > _MEMO_LIMIT:
                _META_MEMO.clear()
            index = {id(t._cell.meta): i for i, t in enumerate(lazies)}
            _META_MEMO[key] = _describe(out, index)
        return out
    return _rebuild(memo, lazies)


def _describe(out: Any, index: dict[int, int]) -> Any:
    if isinstance(out, torch.Tensor):
        if id(out) in index:
            return ("arg", index[id(out)])
        return ("new", tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
    if isinstance(out, (list, tuple)):
        return ("seq", type(out), tuple(_describe(o, index) for o in out))
    return ("value", out)


def _rebuild(memo: Any, lazies: list[LazyTensor]) -> Any:
    kind = memo[0]
    if kind == "arg":
        return lazies[memo[1]]._cell.meta
    if kind == "new":
        _, shape, stride, offset, dtype = memo
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META).as_strided(
            shape, stride, offset
        )
    if kind == "seq":
        return memo[1](_rebuild(m, lazies) for m in memo[2])
    return memo[1]


def _record(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rec = current()
    lifted = liftable_positions(func)
    targs = tuple(rec.template(a, i in lifted) for i, a in enumerate(args))
    tkwargs = tuple((k, rec.template(v, k in lifted)) for k, v in kwargs.items())
    meta_out = _infer(func, args, kwargs, lifted)
    by_meta = {id(t._cell.meta): t for t in _lazies((args, kwargs))}
    view_base = _view_base(func, args)
    outs: list[int | None] = []

    def wrap(m: Any) -> Any:
        if not isinstance(m, torch.Tensor):
            outs.append(None)
            return m
        same = by_meta.get(id(m))
        if same is not None:  # an in-place op returns its argument
            outs.append(same._cell.slot)
            return same
        cell = Cell(m, base=view_base)
        cell.epoch, cell.slot = rec.epoch, rec.new_slot()
        t = LazyTensor(cell)
        rec.live.append((weakref.ref(t), cell))
        outs.append(cell.slot)
        return t

    if isinstance(meta_out, (list, tuple)):
        result: Any = type(meta_out)(wrap(m) for m in meta_out)
    else:
        result = wrap(meta_out)
    for t in _mutated(func, args, kwargs):
        t._cell.base.dirty = True
    rec.ops.append((func, targs, tkwargs, tuple(outs)))
    rec._key.append((func, targs, tkwargs, tuple(outs)))
    return result


def _view_base(func: Any, args: tuple[Any, ...]) -> Cell | None:
    """The input cell a view op's result aliases (None for ops returning new values)."""
    returns = func._schema.returns
    if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        first = _lazies(args[:1])
        return first[0]._cell if first else None
    return None
