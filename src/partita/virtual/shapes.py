"""Output metadata of an op on lazy tensors: shapes, strides and dtypes, never values.

:func:`infer` answers what a recorded op returns by running it on meta tensors, memoised by
the op and its arguments' metadata (a training loop repeats the same calls every step, and
running an op on meta tensors costs far more than the rest of recording). :func:`op_info` holds
what an op's schema says once per op: which arguments it writes, whether it returns a view.
This module does not record ops; :mod:`partita.virtual.dispatch` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from partita.virtual.lazy import LazyTensor, lazies
from partita.virtual.lift import liftable_positions
from partita.virtual.state import DEVICE_NAME

__all__ = ["OpInfo", "infer", "op_info", "to_meta"]

aten = torch.ops.aten
_META = torch.device("meta")


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What recording needs from an op's schema, read once per op.

    Attributes:
        lifted: the arguments whose Python floats become program inputs.
        writes: positions of the arguments the op writes (``(a!)``; batch norm's running
            stats, which its schema does not mark, are added by :meth:`mutated`).
        write_names: the names of those arguments (when passed by keyword).
        is_view: the first result aliases the first argument (a view).
    """

    lifted: frozenset[int | str]
    writes: tuple[int, ...]
    write_names: tuple[str, ...]
    is_view: bool

    def mutated(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The LazyTensors the op writes to."""
        if not self.writes and func is not aten.native_batch_norm.default:
            return []
        positions = list(self.writes)
        if func is aten.native_batch_norm.default and args[5]:
            positions += [3, 4]
        found = [t for i in positions if i < len(args) for t in lazies(args[i])]
        return found + [t for name in self.write_names for t in lazies(kwargs.get(name))]


_INFO: dict[Any, OpInfo] = {}
#: The attribute an op's OpInfo is also kept in: reading it does not hash the op (an
#: OpOverload's ``__hash__`` is Python code, paid on every dict lookup).
_ATTRIBUTE = "_partita_op_info"


def op_info(func: Any) -> OpInfo:
    """The :class:`OpInfo` of ``func`` (computed on first use).

    Example:
        >>> op_info(torch.ops.aten.add_.Tensor).writes
        (0,)
    """
    info = getattr(func, _ATTRIBUTE, None)
    if info is not None:
        return info
    info = _INFO.get(func)
    if info is None:
        arguments = func._schema.arguments
        returns = func._schema.returns
        writes = [i for i, a in enumerate(arguments) if a.alias_info and a.alias_info.is_write]
        info = _INFO[func] = OpInfo(
            lifted=liftable_positions(func),
            writes=tuple(writes),
            write_names=tuple(arguments[i].name for i in writes),
            is_view=bool(
                returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write
            ),
        )
        try:
            setattr(func, _ATTRIBUTE, info)
        except (AttributeError, TypeError):  # an op object that takes no attributes
            pass
    return info


def to_meta(x: Any) -> Any:
    if isinstance(x, LazyTensor):
        return x._cell.meta if x._cell.meta.shape == x.shape else x._cell.meta.view(x.shape)
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
    if isinstance(x, (list, tuple)):
        return type(x)(to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    if isinstance(x, torch.device) and x.type == DEVICE_NAME:
        return _META
    return x


#: Output metadata by (op, argument metadata).
_MEMO: dict[Any, Any] = {}
_MEMO_LIMIT = 100_000


def _meta_key(x: Any, lifted: bool = False) -> Any:
    if isinstance(x, LazyTensor):
        return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, torch.Tensor):
        return ("C", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_meta_key(v, lifted) for v in x)  # a foreach op's list of lifted floats
    if lifted and type(x) is float:
        return "float"  # a lifted number never decides a shape
    hash(x)  # an unhashable argument: no memo (TypeError)
    return (type(x), x)


def infer(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lifted: frozenset[int | str]
) -> Any:
    """The op's output as meta tensors (an input's own meta where the op returns its
    argument, so the caller can tell an in-place result by identity)."""
    found = lazies((args, kwargs))
    try:
        key: Any = (
            func,
            tuple(_meta_key(a, i in lifted) for i, a in enumerate(args)),
            tuple((k, _meta_key(v, k in lifted)) for k, v in kwargs.items()),
        )
        memo = _MEMO.get(key)
    except TypeError:
        key, memo = None, None
    if memo is None:
        with _disable_current_modes():
            out = func(*to_meta(args), **to_meta(kwargs))
        if key is not None:
            if len(_MEMO) > _MEMO_LIMIT:
                _MEMO.clear()
            index = {id(t._cell.meta): i for i, t in enumerate(found)}
            _MEMO[key] = _describe(out, index)
        return out
    return _rebuild(memo, found)


def _describe(out: Any, index: dict[int, int]) -> Any:
    if isinstance(out, torch.Tensor):
        if id(out) in index:
            return ("arg", index[id(out)])
        return ("new", tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
    if isinstance(out, (list, tuple)):
        return ("seq", type(out), tuple(_describe(o, index) for o in out))
    return ("value", out)


def _rebuild(memo: Any, found: list[LazyTensor]) -> Any:
    kind = memo[0]
    if kind == "arg":
        return found[memo[1]]._cell.meta
    if kind == "new":
        _, shape, stride, offset, dtype = memo
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META).as_strided(
            shape, stride, offset
        )
    if kind == "seq":
        return memo[1](_rebuild(m, found) for m in memo[2])
    return memo[1]
