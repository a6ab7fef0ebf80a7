"""The torch-operator surface of a ShardedTensor: ``x + 1``, ``torch.exp(x)``, ``model(x)``,
``x.sum().item()``.

Every torch function called on a :class:`~partita.values.tensor.ShardedTensor` (and the operators
and
``torch.Tensor`` methods, which call them) goes to one handler, installed with
:func:`set_eager_ops`; ``partita.virtual`` installs the virtual device's at import (this stage
cannot import that later one). Without a handler, torch functions return ``NotImplemented``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from partita.errors import ArgumentTypeError

__all__ = ["EagerOps", "set_eager_ops"]


#: The function that runs a torch operation on ShardedTensors outside ``partita.jit``.
def _as_tensor(value: Any) -> torch.Tensor:
    """``value`` (a ShardedTensor) where torch's signatures want a Tensor: torch functions
    dispatch it through ``__torch_function__``."""
    return cast(torch.Tensor, value)


_EAGER_OPS: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = []


def set_eager_ops(handler: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
    """Install ``handler(func, args, kwargs)``, which runs torch functions on ShardedTensors
    (``x + 1``, ``model(x)``); partita installs the virtual device's at import."""
    _EAGER_OPS[:] = [handler]


def _torch_binary(name: str, reverse: bool = False) -> Callable[[Any, Any], Any]:
    """An operator method that calls ``torch.<name>`` (run by the eager-ops handler)."""
    fn = getattr(torch, name)

    def method(self: Any, other: Any) -> Any:
        return fn(other, self) if reverse else fn(self, other)

    return method


class EagerOps:
    """The operators and ``__torch_function__`` of ShardedTensor (a mixin: no state)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        if not _EAGER_OPS:
            return NotImplemented
        return _EAGER_OPS[0](func, args, kwargs or {})

    def cpu(self) -> torch.Tensor:
        """The global value as a plain CPU tensor (the same as ``full()``)."""
        return self.full()

    __add__, __radd__ = _torch_binary("add"), _torch_binary("add", reverse=True)
    __sub__, __rsub__ = _torch_binary("sub"), _torch_binary("sub", reverse=True)
    __mul__, __rmul__ = _torch_binary("mul"), _torch_binary("mul", reverse=True)
    __truediv__, __rtruediv__ = _torch_binary("div"), _torch_binary("div", reverse=True)
    __matmul__, __rmatmul__ = _torch_binary("matmul"), _torch_binary("matmul", reverse=True)

    __pow__, __rpow__ = _torch_binary("pow"), _torch_binary("pow", reverse=True)
    __floordiv__ = _torch_binary("floor_divide")
    __mod__ = _torch_binary("remainder")
    __and__, __or__, __xor__ = (
        _torch_binary(n) for n in ("bitwise_and", "bitwise_or", "bitwise_xor")
    )
    __lt__, __le__ = _torch_binary("lt"), _torch_binary("le")
    __gt__, __ge__ = _torch_binary("gt"), _torch_binary("ge")
    # ``==`` and ``!=`` stay identity (a ShardedTensor is a dict key and a list member inside
    # partita, as a torch.Tensor is hashed by identity); ``torch.eq(x, y)`` compares values.

    def __neg__(self) -> Any:
        return torch.neg(_as_tensor(self))

    def __abs__(self) -> Any:
        return torch.abs(_as_tensor(self))

    def __invert__(self) -> Any:
        return torch.bitwise_not(_as_tensor(self))

    def __getitem__(self, index: Any) -> Any:
        return self._tensor_method(torch.Tensor.__getitem__, index)

    def __len__(self) -> int:
        if not self.shape:
            raise ArgumentTypeError(
                "len() of a 0-d ShardedTensor: it has no first dim; use .item()"
            )
        return int(self.shape[0])

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return self.full().__index__()

    # Metadata: read from the global shape and dtype, on any mesh (no op runs).
    def size(self, dim: int | None = None) -> Any:
        shape = torch.Size(self.shape)
        return shape if dim is None else shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    ndimension = dim

    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    nelement = numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.dtype.is_complex

    def item(self) -> Any:
        """The value of a one-element tensor as a Python number (gathers it)."""
        return self.full().item()

    def tolist(self) -> Any:
        """The global value as nested Python lists (gathers it)."""
        return self.full().tolist()

    def numpy(self) -> Any:
        """The global value as a NumPy array (gathers it)."""
        return self.full().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __iter__(self) -> Iterator[Any]:
        if not self.shape:
            raise ArgumentTypeError(
                "iteration over a 0-d ShardedTensor: it has no first dim; use .item()"
            )
        return iter(torch.unbind(_as_tensor(self)))  # one op, not one per element

    # ``torch.as_tensor(x)`` / ``torch.from_dlpack(x)`` read the global value through DLPack.
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.full().__dlpack_device__()

    def __getattr__(self, name: str) -> Any:
        # Any other public torch.Tensor method (``x.sum()``, ``x.view(2, -1)``, ``x.max(0)``)
        # runs as the matching torch function does: through the eager-ops handler. Private
        # names and attributes that are not methods stay missing (``hasattr`` answers False).
        method = getattr(torch.Tensor, name, None) if not name.startswith("_") else None
        if method is None or not callable(method):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        if name in _NO_AUTOGRAD:
            raise AttributeError(
                f"ShardedTensor.{name}: a ShardedTensor carries no autograd history, so it has "
                f"no gradient to compute or hook. Differentiate inside the sharded program: "
                f"torch.autograd.grad or loss.backward() in a function given to partita.jit, "
                f"or partita.train_step for a training step."
            )
        return functools.partial(self._tensor_method, method)

    def _tensor_method(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if not _EAGER_OPS:
            raise ArgumentTypeError(
                f"ShardedTensor.{method.__name__} needs partita.virtual (eager tensor methods on "
                f"a ShardedTensor run through it), which is not loaded: it needs torch>=2.9. Call "
                f"the op inside a function given to partita.jit instead."
            )
        return _EAGER_OPS[0](method, (self, *args), kwargs)


#: torch.Tensor methods of autograd, which a ShardedTensor (a value) does not have.
_NO_AUTOGRAD = frozenset(
    {"backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad"}
)
