"""Torch operations on ShardedTensors outside ``partita.jit``, run through the virtual device.

``x + 1``, ``torch.relu(x)`` or ``model(x)`` with ``x`` a :class:`~partita.ShardedTensor`
wrap each ShardedTensor as data of the virtual device, record the call, sync, and return
ShardedTensors (plain tensors among the arguments, a model's weights say, are replicated
inputs). The first such call switches the virtual device on for the ShardedTensor's mesh.
Results carry no autograd history. ``x.to(dev)`` puts a ShardedTensor on the device as it is
(:func:`upload`). This module only converts; recording and compiling are :mod:`dispatch` and
:mod:`step`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from partita.errors import VirtualDeviceError
from partita.runtime.dist_tensor import DistributedShardedTensor
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor
from partita.virtual import state, step
from partita.virtual.lazy import LazyTensor, full_value, new_data
from partita.virtual.state import DEVICE_NAME
from partita.virtual.switch import switch_on

__all__ = ["eager_op", "upload"]


def eager_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func(*args, **kwargs)`` where some arguments are ShardedTensors.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> x = partita.mark_sharding(torch.ones(8, 4), mesh, P("data", None))
        >>> (x + 1).full().sum().item()
        64.0
    """
    if func is torch.Tensor.to and args and isinstance(args[0], ShardedTensor):
        moved = _moved_to_device(args[0], args[1:], kwargs)
        if moved is not None:
            return moved
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


def _moved_to_device(
    x: ShardedTensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> LazyTensor | None:
    """``x.to(dev)`` (and ``x.to(dev, dtype)``) with ``dev`` the virtual device: a copy of
    ``x``'s storage becomes the device tensor's data, in its layout, with no gather; None for
    any other ``to``."""
    try:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    except TypeError:  # x.to(other_tensor) with a ShardedTensor: the ordinary path
        return None
    if device is None or device.type != DEVICE_NAME:
        return None
    moved = upload(x)
    if dtype is not None and dtype != x.dtype:
        with torch.no_grad():
            return cast(LazyTensor, moved.to(dtype))
    return moved


def upload(x: ShardedTensor) -> LazyTensor:
    """``x`` as a tensor of the virtual device: a copy of the storage this process holds of it
    (under torch.distributed only its own shard: the rows a per-host loader gave it) becomes
    the device tensor's data, in its layout (no gather), and counts in
    ``partita.metrics().upload_bytes``. An annotated ShardedTensor gives an annotated device
    tensor.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> dev = partita.use_spmd(mesh)
        >>> x = partita.mark_sharding(torch.ones(8, 4), mesh, P("data", None)).to(dev)
        >>> x.device, x.sharding
        (device(type='spmd', index=0), P('data', None))
    """
    mesh = step.mesh()
    if x.mesh != mesh:
        raise VirtualDeviceError(
            f"ShardedTensor.to('{DEVICE_NAME}'): the tensor of shape {tuple(x.shape)} lives on "
            f"{x.mesh!r}, but the virtual device runs on {mesh!r}. Build it over the device's "
            f"mesh (partita.data.make_global(rows, mesh, spec, device=dev) with the mesh given "
            f"to partita.use_spmd)."
        )
    held: ShardedTensor  # a copy, as torch's .to(device) makes: x may change afterwards
    if isinstance(x, DistributedShardedTensor):
        local = x.addressable_data[0].clone()
        held = DistributedShardedTensor(local, x.sharding, x.shape, x.addressable_devices[0])
        nbytes = local.numel() * local.element_size()
    elif x.held is not None:
        value, axes = x.held
        held = ShardedTensor.from_held(value.clone(), axes, x.sharding, x.shape)
        nbytes = value.numel() * value.element_size()
    else:
        held = ShardedTensor.from_stacked(x.stacked.clone(), x.sharding, x.shape)
        nbytes = x.stacked.numel() * x.stacked.element_size()
    t = new_data(held)
    if x.is_annotated:
        t._cell.annotation = x.sharding
    state.get().metrics.upload_bytes += nbytes
    return t


def _to_sharded(x: Any) -> Any:
    if not isinstance(x, LazyTensor):
        return x
    value = full_value(x)  # syncs a pending result
    data = x._cell.data
    if isinstance(data, ShardedTensor) and data.shape == x.shape:
        return data
    return ShardedTensor.from_global(value, Sharding.replicated(step.mesh(), x.ndim))
