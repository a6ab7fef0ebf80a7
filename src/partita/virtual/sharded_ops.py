"""Torch operations on ShardedTensors outside ``partita.jit``, run through the virtual device.

``x + 1``, ``torch.relu(x)`` or ``model(x)`` with ``x`` a :class:`~partita.ShardedTensor`
wrap each ShardedTensor as data of the virtual device, record the call, sync, and return
ShardedTensors (plain tensors among the arguments, a model's weights say, are replicated
inputs). The first such call switches the virtual device on for the ShardedTensor's mesh.
Results carry no autograd history. This module only converts; recording and compiling are
:mod:`dispatch` and :mod:`step`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.errors import VirtualDeviceError
from partita.spec import Sharding
from partita.tensor import ShardedTensor
from partita.virtual import step
from partita.virtual.lazy import LazyTensor, full_value, new_data
from partita.virtual.switch import switch_on

__all__ = ["eager_op"]


def eager_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func(*args, **kwargs)`` where some arguments are ShardedTensors.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> x = partita.mark_sharding(torch.ones(8, 4), mesh, P("data", None))
        >>> (x + 1).full().sum().item()
        64.0
    """
    sharded = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedTensor)]
    mesh = sharded[0].mesh
    current = step.current_mesh()
    if current is not None and current != mesh:
        raise VirtualDeviceError(
            f"{getattr(func, '__name__', func)} on a ShardedTensor of {mesh!r}, but the virtual "
            f"device runs on {current!r}: operations outside partita.jit run on the virtual "
            f"device's mesh. Reshard onto {current!r}, or use partita.jit with mesh={mesh!r}."
        )
    if current is None:
        switch_on(mesh)  # ShardedTensor ops run no backward(): no check for one

    def to_lazy(x: Any) -> Any:
        return new_data(x) if isinstance(x, ShardedTensor) else x

    with torch.no_grad():
        out = func(*pytree.tree_map(to_lazy, args), **pytree.tree_map(to_lazy, kwargs))
    return pytree.tree_map(_to_sharded, out)


def _to_sharded(x: Any) -> Any:
    if not isinstance(x, LazyTensor):
        return x
    value = full_value(x)  # syncs a pending result
    data = x._cell.data
    if isinstance(data, ShardedTensor) and data.shape == x.shape:
        return data
    return ShardedTensor.from_global(value, Sharding.replicated(step.mesh(), x.ndim))
