"""The SPMD virtual device: an unchanged PyTorch training loop, sharded by annotating tensors.

``dev = partita.use_spmd(mesh)`` returns ``torch.device("spmd", 0)``. Tensors moved there are
lazy (:mod:`lazy`): their ops are recorded (:mod:`recording`), ``partita.sync()`` compiles and
runs the step (:mod:`step`), ``partita.compile(step_fn)`` replays a captured step
(:mod:`compiled`), and ``partita.mark_sharding`` lays a tensor out over the mesh in
place. See docs/virtual-device.md.
"""

from __future__ import annotations

import os

import torch

from partita.errors import ArgumentTypeError
from partita.mesh import Mesh
from partita.spec import Sharding
from partita.tensor import ShardedTensor, set_eager_ops
from partita.virtual import disk_cache, step
from partita.virtual.compiled import CompiledStep, compile
from partita.virtual.device import (
    MIN_TORCH,
    VirtualDeviceError,
    activate,
    check_torch,
    register,
)
from partita.virtual.lazy import LazyTensor, full_value
from partita.virtual.recording import new_data
from partita.virtual.sharded_ops import eager_op
from partita.virtual.step import Metrics, metrics, set_mesh, sync

__all__ = [
    "MIN_TORCH",
    "CompiledStep",
    "LazyTensor",
    "Metrics",
    "VirtualDeviceError",
    "check_torch",
    "compile",
    "metrics",
    "sharded",
    "sync",
    "use_spmd",
]


set_eager_ops(eager_op)

#: Set to "1" to keep ``import partita`` from registering the virtual device.
NO_DEVICE_ENV = "PARTITA_NO_VIRTUAL_DEVICE"


def _factory(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    return new_data(torch.zeros(shape, dtype=dtype or torch.get_default_dtype()))


def sharded(t: torch.Tensor) -> ShardedTensor:
    """The value of a virtual-device tensor as a ShardedTensor (syncs if it is pending), for
    :func:`partita.visualize_sharding` and the other ShardedTensor tools.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> w = torch.ones(8, 4).to(partita.use_spmd(mesh))
        >>> partita.virtual.sharded(partita.mark_sharding(w, mesh, P("data", None))).spec
        P('data', None)
    """
    if not isinstance(t, LazyTensor):
        raise ArgumentTypeError(
            f"partita.virtual.sharded takes a tensor of the virtual device (spmd), got a "
            f"{type(t).__name__} on {getattr(t, 'device', None)}; move it with .to(dev) first."
        )
    value = full_value(t)
    data = t._cell.data
    if isinstance(data, ShardedTensor):
        return data
    return ShardedTensor.from_global(value, Sharding.replicated(step.mesh(), t.ndim))


def _register_early() -> None:
    """Register the device when partita is imported, if it can be.

    PyTorch's autograd engine sizes its per-device queues at the process's first ``backward()``;
    a device registered after that aborts every later backward on it with an internal assert.
    So the device is registered at import (cheap: no memory, no threads) unless torch is too
    old, another PrivateUse1 backend owns the slot, or ``PARTITA_NO_VIRTUAL_DEVICE=1``; then
    ``use_spmd`` registers it (or says why it cannot).
    """
    if os.environ.get(NO_DEVICE_ENV) == "1":
        return
    try:
        check_torch()
    except VirtualDeviceError:
        return
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        register(_factory, new_data)


def use_spmd(mesh: Mesh, *, cache_dir: str | os.PathLike[str] | None = None) -> torch.device:
    """Switch the virtual device on for ``mesh`` and return it (``torch.device("spmd", 0)``).

    ``cache_dir`` keeps compiled steps on disk for later processes (plain JSON; see
    :mod:`partita.virtual.disk_cache`; the ``PARTITA_COMPILE_CACHE`` environment variable does
    the same).

    Example:
        >>> dev = partita.use_spmd(Mesh.create((2, 4), ("data", "model")))
        >>> torch.ones(2, device=dev).device
        device(type='spmd', index=0)
    """
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError(f"partita.use_spmd needs a partita.Mesh, got {type(mesh).__name__}")
    register(_factory, new_data)
    activate()
    _use_foreach_kernels()
    set_mesh(mesh)
    if cache_dir is not None:
        disk_cache.set_directory(cache_dir)
    return torch.device("spmd", 0)


def _use_foreach_kernels() -> None:
    """Let ``torch.optim`` pick its foreach kernels for the device's parameters by default, as
    it does on any accelerator that has them.

    torch.optim takes them only for parameters whose type is exactly ``Tensor`` or
    ``Parameter`` (``optimizer._foreach_supported_types``), which the device's tensor subclass
    is not; it then runs one op per parameter per update (AdamW: about ten per parameter), and
    recording those was most of a step's recording time. The recorded foreach ops are replayed
    per tensor (:mod:`partita.virtual.lift`), so the program is the same.
    """
    from torch.optim import optimizer

    types = getattr(optimizer, "_foreach_supported_types", None)
    if isinstance(types, list) and LazyTensor not in types:
        types.append(LazyTensor)


_register_early()
