"""The SPMD virtual device: an unchanged PyTorch training loop, sharded by annotating tensors.

``dev = partita.use_spmd(mesh)`` returns ``torch.device("spmd", 0)``. Tensors moved there are
lazy (:mod:`lazy`): their ops are recorded (:mod:`recording`), ``partita.sync()`` compiles and
runs the step (:mod:`step`), and ``partita.mark_sharding`` lays a tensor out over the mesh in
place. See docs/virtual-device.md.
"""

from __future__ import annotations

import os

import torch

from partita.mesh import Mesh
from partita.tensor import set_eager_ops
from partita.virtual import disk_cache
from partita.virtual.device import MIN_TORCH, VirtualDeviceError, check_torch, register
from partita.virtual.lazy import LazyTensor
from partita.virtual.recording import new_data
from partita.virtual.sharded_ops import eager_op
from partita.virtual.step import Metrics, metrics, set_mesh, sync

__all__ = [
    "MIN_TORCH",
    "LazyTensor",
    "Metrics",
    "VirtualDeviceError",
    "check_torch",
    "metrics",
    "sync",
    "use_spmd",
]


set_eager_ops(eager_op)


def _factory(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    return new_data(torch.zeros(shape, dtype=dtype or torch.get_default_dtype()))


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
        raise TypeError(f"partita.use_spmd needs a partita.Mesh, got {type(mesh).__name__}")
    register(_factory, new_data)
    set_mesh(mesh)
    if cache_dir is not None:
        disk_cache.set_directory(cache_dir)
    return torch.device("spmd", 0)
