"""Ops of the virtual device that run at once instead of being recorded.

``.item()`` and ``.cpu()`` (sync, then read), uploads (``copy_`` of a CPU tensor into a new
device tensor: what ``tensor.to(dev)`` does), ``detach``/``alias`` (the result shares the
cell), factories writing into a new device tensor, and ``zeros_like``/``fill_`` on data (so the
optimizer's state initialisation is data, not a second program). Everything else is recorded
by :mod:`partita.virtual.dispatch`; this module does not record (an op it turns into another,
an in-place view say, goes back through :func:`partita.virtual.lazy.dispatch`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from partita.errors import VirtualDeviceError
from partita.runtime.dist_tensor import DistributedShardedTensor
from partita.values.tensor import ShardedTensor
from partita.virtual import lazy, state
from partita.virtual.cell import Cell
from partita.virtual.lazy import LazyTensor, full_value, lazies, new_data
from partita.virtual.peek import peek
from partita.virtual.shapes import to_meta
from partita.virtual.state import DEVICE_NAME

__all__ = ["RUNS_NOW", "returns_values", "run_now", "runs_now"]

aten = torch.ops.aten
_SHARE_CELL = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh.default})
_LIKE = {
    aten.zeros_like.default: 0,
    aten.ones_like.default: 1,
    aten.empty_like.default: 0,
}
_FILLS = frozenset({aten.zero_.default, aten.fill_.Scalar})
#: torch.optim's fused kernels (``fused=True``): refused with the fix, at the step.
_FUSED = frozenset(
    getattr(getattr(aten, name), overload)
    for name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_", "_fused_adagrad_")
    if hasattr(aten, name)
    for overload in getattr(aten, name).overloads()
)
_META = torch.device("meta")
#: Ops whose result's shape depends on the values (``nonzero``, ``unique``; ``x[mask]`` is
#: ``index`` with a boolean index): no program can hold them, so they read their arguments'
#: values (syncing pending ones, as ``.item()`` does) and run now on the CPU.
_VALUE_SHAPED = frozenset(
    getattr(getattr(aten, name), overload)
    for name in (
        "nonzero", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim",
        "unique_consecutive", "unique_dim_consecutive",
    )
    if hasattr(aten, name)
    for overload in getattr(aten, name).overloads()
)  # fmt: skip
#: Indexing ops, whose boolean-mask indices are turned into integer positions (``x[mask]``):
#: only the mask's value is needed now, the indexing itself is recorded.
_INDEXING = frozenset(
    {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
    | {aten._index_put_impl_.default}
)
#: In-place view ops and the view each does in place (``x.transpose_(0, 1)``: PyTorch changes
#: the wrapper's shape and strides itself; :func:`run_now` records the view and rebinds the cell).
_INPLACE_VIEWS = {
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.as_strided_.default: aten.as_strided.default,
    aten.swapdims_.default: aten.swapdims.default,
    aten.swapaxes_.default: aten.swapaxes.default,
}
#: In-place random fills with no sharding rule (``torch.randint(..., device=dev)`` fills a new
#: tensor with ``random_``): on a value known now, drawn now from the CPU generator.
_RANDOM_FILLS = frozenset(getattr(aten.random_, o) for o in aten.random_.overloads())
#: While a compiled step records (:mod:`partita.virtual.compiled`), ``DeviceState.uploads``
#: gets ``(source, cell)`` per CPU tensor copied into a new device tensor, so a replay can upload
#: the next call's argument, and ``(None, cell)`` when an op here overwrites a cell's data (it
#: no longer holds the upload).
#: Every op :func:`run_now` may run (besides factories writing into an ``out=`` tensor).
RUNS_NOW = frozenset(
    {aten._local_scalar_dense.default, aten._to_copy.default, aten.copy_.default}
    | {aten.clone.default}
    | _SHARE_CELL
    | set(_LIKE)
    | _FILLS
    | _FUSED
    | _VALUE_SHAPED
    | _RANDOM_FILLS
    | _INDEXING
    | set(_INPLACE_VIEWS)
    | {aten.set_.source_Tensor}
)


#: The attribute an op's :func:`runs_now` answer is kept in (reading it does not hash the op).
_ATTRIBUTE = "_partita_runs_now"
_RUNS_NOW_MEMO: dict[Any, bool] = {}


def runs_now(func: Any) -> bool:
    """Whether ``func`` may run at once (:func:`run_now`), read once per op.

    Example:
        >>> runs_now(torch.ops.aten.detach.default), runs_now(torch.ops.aten.mm.default)
        (True, False)
    """
    answer = getattr(func, _ATTRIBUTE, None)
    if answer is not None:
        return answer
    answer = _RUNS_NOW_MEMO.get(func)
    if answer is None:
        answer = _RUNS_NOW_MEMO[func] = func in RUNS_NOW or returns_values(func)
        try:
            setattr(func, _ATTRIBUTE, answer)
        except (AttributeError, TypeError):  # an op object that takes no attributes
            pass
    return answer


def _is_clean_data(cell: Cell, rec: Any, unused: bool = False) -> bool:
    """Data whose value is known now (and, with ``unused``, not read by this recording yet, so
    changing it at once cannot reach an op recorded before)."""
    if not cell.has_value or cell.base.dirty:
        return False
    return not unused or cell.epoch != rec.epoch


def run_now(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rec: Any) -> Any:
    """Run ``func`` now if it is one of the ops above, else return ``NotImplemented``.

    ``rec`` is the current :class:`~partita.virtual.recording.Recording`.
    """
    if func not in RUNS_NOW and "out" not in kwargs:
        if returns_values(func):
            return _python_result(func, args, kwargs)
        return NotImplemented  # most ops: decided without the checks below
    if func is aten._local_scalar_dense.default:
        if args[0].dtype == torch.bool and args[0]._cell.is_pending:
            # A branch on a condition (``if mask.all():``) in a library's forward: computed on
            # the side when it can be, so the step is not cut in two programs.
            value = peek(args[0]._cell)
            if value is not None:
                return value.item()
        return full_value(args[0]).item()
    if func is aten.set_.source_Tensor and isinstance(args[1], LazyTensor):
        args[0].data = args[1]  # t.set_(x): t stands for x's value, as t.data = x
        return args[0]
    if func in _INPLACE_VIEWS:
        view = lazy.dispatch(_INPLACE_VIEWS[func], args, kwargs)
        args[0]._cell = view._cell
        if not view._cell.has_value:  # an output of the step while this tensor is alive
            rec.live.append((weakref.ref(args[0]), view._cell))
        # The wrapper's own shape and strides, changed the way PyTorch's subclasses do it
        # (torch.utils._python_dispatch.return_and_correct_aliasing): the op again with
        # dispatch off, as if on the meta device (no storage to check against).
        with torch.utils._mode_utils.no_dispatch():
            meta_in_tls = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
        return args[0]
    if func in _VALUE_SHAPED:
        result = func(*_values(args), **_values(kwargs))
        if isinstance(result, tuple):  # unique: values, inverse, counts
            return tuple(new_data(r) for r in result)
        return new_data(result)
    if func in _INDEXING and any(_is_mask(i) for i in args[1]):
        return lazy.dispatch(func, (args[0], _positions(args[1]), *args[2:]), kwargs)
    if func in _RANDOM_FILLS and _is_clean_data(args[0]._cell, rec, unused=True):
        value = torch.empty(args[0].shape, dtype=args[0].dtype)
        func(value, *args[1:], **kwargs)
        _set_data(args[0]._cell, value)
        return args[0]
    if func in _FUSED:
        n = len(args[0]) if args and isinstance(args[0], (list, tuple)) else "?"
        raise VirtualDeviceError(
            f"{func} on the virtual device: the optimizer was built with fused=True, and its "
            f"fused kernel (one op updating all {n} parameters and their state) has no "
            f"per-tensor replay, so the step could not be sharded. Drop fused=True: on the "
            f"virtual device torch.optim uses its foreach kernels by default, which are "
            f"recorded and sharded per parameter (or pass foreach=True)."
        )
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != DEVICE_NAME:
            return aten._to_copy.default(full_value(args[0]), **kwargs)
        converted = _convert_data(args[0], kwargs, rec)
        if converted is not None:
            return converted
    if func is aten.clone.default and state.get().copying and _is_clean_data(args[0]._cell, rec):
        copied = _copied_data(args[0], args[0].dtype)  # copy.deepcopy of data: data
        if copied is not None:
            return copied
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if not isinstance(dst, LazyTensor):
            return dst.copy_(full_value(src))
        if not isinstance(src, LazyTensor) and _is_clean_data(dst._cell, rec, unused=True):
            value = src.detach().to(dst.dtype).expand(dst.shape).clone()
            state.get().metrics.upload_bytes += src.numel() * src.element_size()
            uploads = state.get().uploads
            if uploads:
                uploads[-1].append((src, dst._cell))
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
            rec.live.append((weakref.ref(shared), args[0]._cell))
        return shared
    if func in _LIKE and _is_clean_data(args[0]._cell, rec) and kwargs.get("device") is None:
        src = args[0]
        value = torch.full(src.shape, _LIKE[func], dtype=kwargs.get("dtype") or src.dtype)
        old = src._cell.data
        if isinstance(old, ShardedTensor):
            return new_data(ShardedTensor.from_global(value, old.sharding))
        return new_data(value)
    out = kwargs.get("out")
    if isinstance(out, LazyTensor) and not lazies(args) and _is_clean_data(out._cell, rec, True):
        # A factory writing into a new device tensor (torch.arange(n, device=dev)): data now.
        # The kernel resizes its ``out`` (empty for a factory); a wrapper cannot be resized,
        # so the result is a new device tensor.
        value = torch.empty(out.shape, dtype=out.dtype)
        func(*args, **{**kwargs, "out": value})
        if value.shape == out.shape:
            uploads = state.get().uploads
            if uploads:
                uploads[-1].append((None, out._cell))
            out._cell.data = value
            return out
        return new_data(value)
    if func in _FILLS and _is_clean_data(args[0]._cell, rec, unused=True):
        value = torch.full(args[0].shape, args[1] if len(args) > 1 else 0, dtype=args[0].dtype)
        _set_data(args[0]._cell, value)
        return args[0]
    return NotImplemented


#: Schema types of results that are Python values, not tensors.
_VALUE_TYPES = frozenset(
    {"bool", "int", "float", "complex", "Scalar", "SymInt", "SymFloat", "SymBool"}
)


def returns_values(func: Any) -> bool:
    """Whether every result of ``func`` is a Python value (``aten.equal``, ``aten.allclose``,
    ``aten.is_nonzero``): a recorded step cannot hand one back to the Python code branching
    on it, so such an op runs at once (:func:`_python_result`)."""
    returns = getattr(getattr(func, "_schema", None), "returns", None)
    if not returns:
        return False
    return all(str(r.type) in _VALUE_TYPES for r in returns)


def _python_result(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The Python value ``func`` returns: from the shapes alone when its meta kernel gives it
    (``is_same_size``), else from the values, syncing pending ones as ``.item()`` does."""
    try:
        return func(*to_meta(args), **to_meta(kwargs))
    except (RuntimeError, NotImplementedError):  # the meta kernel needs values, or has none
        return func(*_values(args), **_values(kwargs))


def _convert_data(t: LazyTensor, kwargs: dict[str, Any], rec: Any) -> LazyTensor | None:
    """``t.to(dtype)`` under no_grad, of data held on the LocalMesh: the converted data now,
    in the same layout. ``module.half()`` / ``module.to(torch.bfloat16)`` swap each parameter
    with its converted value, and ``torch.utils.swap_tensors`` refuses a pending one (the
    recording holds a weak reference to every pending tensor)."""
    if torch.is_grad_enabled() or set(kwargs) - {"dtype", "device", "layout", "non_blocking"}:
        return None
    if kwargs.get("layout") not in (None, torch.strided) or not _is_clean_data(t._cell, rec):
        return None
    return _copied_data(t, kwargs.get("dtype") or t.dtype)


def _copied_data(t: LazyTensor, dtype: torch.dtype) -> LazyTensor | None:
    """A new device tensor holding a copy of ``t``'s data in ``dtype``, in the same layout and
    with its annotation (None where the layout is not one this process can copy as is)."""
    old = t._cell.data
    if isinstance(old, DistributedShardedTensor):  # this process's shard only
        local = old.addressable_data[0].to(dtype, copy=True)
        device = old.addressable_devices[0]
        out = new_data(DistributedShardedTensor(local, old.sharding, t.shape, device))
    elif type(old) is ShardedTensor:  # (one held per distinct tile is expanded here)
        stacked = old.stacked.to(dtype, copy=True)
        out = new_data(ShardedTensor.from_stacked(stacked, old.sharding, t.shape))
    elif type(old) is torch.Tensor and tuple(old.shape) == tuple(t.shape):
        out = new_data(old.to(dtype, copy=True))
    else:
        return None
    out._cell.annotation = t._cell.annotation  # model.half(), copy.deepcopy keep the marks
    return out


def _values(x: Any) -> Any:
    """``x`` with every device tensor replaced by its value on the CPU (syncing pending ones)."""
    if isinstance(x, LazyTensor):
        return full_value(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_values(v) for v in x)
    if isinstance(x, dict):
        return {k: _values(v) for k, v in x.items()}
    return x


def _set_data(cell: Cell, value: torch.Tensor) -> None:
    """Overwrite a cell's data with ``value``, in the layout it had."""
    uploads = state.get().uploads
    if uploads:
        uploads[-1].append((None, cell))
    old = cell.data
    cell.data = (
        ShardedTensor.from_global(value, old.sharding) if isinstance(old, ShardedTensor) else value
    )


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _positions(indices: Sequence[Any]) -> list[Any]:
    """``indices`` with each boolean mask replaced by the integer positions it selects (one
    index tensor per dimension it covers, as PyTorch reads a mask), computed from its value.

    A pending mask is computed on the side when it is small (:mod:`partita.virtual.peek`), else
    the step syncs to read it, as ``.item()`` does: the result's shape depends on it.
    """
    out: list[Any] = []
    for index in indices:
        if not _is_mask(index):
            out.append(index)
            continue
        mask = index
        if isinstance(index, LazyTensor):
            peeked = peek(index._cell) if index._cell.is_pending else None
            mask = peeked if peeked is not None else full_value(index)
        out.extend(mask.to(torch.bool).nonzero().unbind(1))
    return out
