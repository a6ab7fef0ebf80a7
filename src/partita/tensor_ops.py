"""The torch-operator surface of a ShardedTensor: ``x + 1``, ``torch.exp(x)``, ``model(x)``.

Every torch function called on a :class:`~partita.tensor.ShardedTensor` (and the arithmetic
operators, which call them) goes to one handler, installed with :func:`set_eager_ops`;
``partita.virtual`` installs the virtual device's at import (this stage cannot import that
later one). Without a handler, torch functions return ``NotImplemented``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EagerOps", "set_eager_ops"]

#: The function that runs a torch operation on ShardedTensors outside ``partita.jit``.
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
        return self.full()  # type: ignore[attr-defined]

    __add__, __radd__ = _torch_binary("add"), _torch_binary("add", reverse=True)
    __sub__, __rsub__ = _torch_binary("sub"), _torch_binary("sub", reverse=True)
    __mul__, __rmul__ = _torch_binary("mul"), _torch_binary("mul", reverse=True)
    __truediv__, __rtruediv__ = _torch_binary("div"), _torch_binary("div", reverse=True)
    __matmul__, __rmatmul__ = _torch_binary("matmul"), _torch_binary("matmul", reverse=True)

    def __neg__(self) -> Any:
        return torch.neg(self)
