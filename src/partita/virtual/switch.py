"""Switching the virtual device on: :func:`use_spmd`, and everything it changes in torch.

Importing partita registers no device and changes none of torch's settings (it adds its own
``torch.ops.partita`` ops and allows its value classes in ``torch.load``). The first
``use_spmd`` (or :func:`register_device`) registers the device (:mod:`partita.virtual.device`:
PyTorch's PrivateUse1 backend renamed ``spmd``, its hooks, device guard and kernels), and
``use_spmd`` also reports it available and lets ``torch.optim`` pick its foreach kernels for the
device's parameters. Both are process-global and stay for the rest of the process.
"""

from __future__ import annotations

import os

import torch

from partita.errors import ArgumentTypeError
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor
from partita.virtual import disk_cache, state, step
from partita.virtual.device import activate, check_backward, register
from partita.virtual.lazy import LazyTensor, full_value, new_data

__all__ = ["register_device", "sharded", "switch_on", "use_spmd"]


def _factory(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    return new_data(torch.zeros(shape, dtype=dtype or torch.get_default_dtype()))


def register_device() -> None:
    """Register the virtual device with torch now, without switching it on.

    ``use_spmd`` does this itself. Call it first only in a process that runs a ``backward()``
    before its first ``use_spmd`` (a CPU warm-up, a test session): PyTorch's autograd engine
    sizes its per-device queues at a process's first ``backward()``, and ``use_spmd`` raises
    :class:`~partita.VirtualDeviceError` when that came before the device was registered.

    Example:
        >>> partita.virtual.register_device()
        >>> torch._C._get_privateuse1_backend_name()
        'spmd'
    """
    register(_factory, new_data)
    check_backward()


def use_spmd(
    mesh: Mesh, *, cache_dir: str | os.PathLike[str] | None = None, auto: bool = False
) -> torch.device:
    """Switch the virtual device on for ``mesh`` and return it (``torch.device("spmd", 0)``).

    ``cache_dir`` keeps compiled steps on disk for later processes, in a directory only you
    can write (plain JSON, checked when read; see :mod:`partita.virtual.disk_cache`; the
    ``compile_cache`` option, environment variable ``PARTITA_COMPILE_CACHE``, does the same).

    ``auto=True`` lets auto-sharding choose how each step lays out its inputs that
    ``mark_sharding`` did not annotate (docs/auto.md): annotated values keep their sharding;
    ``partita.last_plan()`` (or the metrics) shows the choice as ``plan.auto``. Such steps are
    not kept in the on-disk cache.

    Example:
        >>> dev = partita.use_spmd(Mesh.create((2, 4), ("data", "model")))
        >>> torch.ones(2, device=dev).device
        device(type='spmd', index=0)
    """
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError(f"partita.use_spmd needs a partita.Mesh, got {type(mesh).__name__}")
    register_device()
    device = switch_on(mesh, cache_dir=cache_dir)
    dev_state = state.get()
    if dev_state.auto != auto:
        dev_state.programs.clear()  # programs compiled the other way
        dev_state.auto = auto
    return device


def switch_on(mesh: Mesh, *, cache_dir: str | os.PathLike[str] | None = None) -> torch.device:
    """:func:`use_spmd` without the check that a ``backward()`` can run on the device, for
    ShardedTensor operations outside jit (:mod:`partita.virtual.sharded_ops`): they run no
    backward, so a process that ran one before still runs them."""
    register(_factory, new_data)
    activate()
    _use_foreach_kernels()
    step.set_mesh(mesh)
    if cache_dir is not None:
        disk_cache.set_directory(cache_dir)
    return torch.device(state.DEVICE_NAME, 0)


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
