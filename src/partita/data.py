"""Global batches from per-process data.

Shapes in partita are **global**: a training step is written for the global batch. Under
``torchrun`` each process loads only the rows its device holds (its *per-process batch*) and
:func:`make_global` wraps them as a ShardedTensor of the global shape, without communication.
In a single process (the simulated LocalMesh) the one process holds every device, so it loads
the whole global batch and :func:`make_global` shards it.

==========================  ===========================================================
name                        meaning
==========================  ===========================================================
``global_batch_size``       rows of the batch the step sees (the model's batch dim)
``per_process_batch_size``  rows one process loads: ``global_batch_size`` / the number
                            of tiles of the batch dim (= ``global_batch_size`` in a
                            single process)
``process_slice(...)``      which rows of the global batch this process must load
==========================  ===========================================================

Devices that differ only along mesh axes the spec does not use (e.g. ``model`` for
``P("data")``) hold the same rows: their processes must load the same data. Nothing here checks
that (it would need communication); seed the loaders by ``process_slice``, not by rank.

This module does not read files or shuffle: wrap any iterable (a ``DataLoader`` whose sampler
yields this process's rows) with :class:`GlobalBatchLoader`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.errors import ShardingError
from partita.values.layout import index_ranges, local_shape
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, as_spec
from partita.values.tensor import ShardedTensor, mark_sharding

__all__ = ["GlobalBatchLoader", "make_global", "process_slice"]

SpecLike = PartitionSpec | Sequence[Any] | None


def _dist_position(mesh: Mesh) -> int | None:
    """This process's mesh position under torch.distributed, or None in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return mesh.position(dist.get_rank())


def process_slice(global_shape: Sequence[int], mesh: Mesh, spec: SpecLike) -> tuple[slice, ...]:
    """The part of a global value of ``global_shape`` this process must load.

    Under torch.distributed: its device's tile (padding excluded). In a single process: all of
    it.

    Example (in one process, the whole value; rank 2 of the same mesh under torchrun would
    get ``(slice(4, 8, None), slice(0, 128, None))``):
        >>> mesh = Mesh.create((2, 2), ("data", "model"))
        >>> process_slice((8, 128), mesh, P("data"))
        (slice(0, 8, None), slice(0, 128, None))
    """
    shape = tuple(int(n) for n in global_shape)
    position = _dist_position(mesh)
    if position is None:
        return tuple(slice(0, n) for n in shape)
    sharding = as_spec(spec).to_sharding(mesh, len(shape))
    ranges = index_ranges(sharding, shape)[position].tolist()
    return tuple(slice(a, b) for a, b in ranges)


def make_global(
    local: torch.Tensor,
    mesh: Mesh,
    spec: SpecLike,
    *,
    global_shape: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """A ShardedTensor of the global shape from this process's own part (no communication).

    With ``device`` the virtual device (``dev = partita.use_spmd(mesh)``), the result is that
    device's tensor, annotated with ``spec``: each process puts only its own part there (no
    gather; ``partita.metrics().upload_bytes`` counts it).

    Args:
        local: under torch.distributed, the rows this process's device holds
            (``global[process_slice(global_shape, mesh, spec)]``); in a single process, the
            whole global value.
        mesh, spec: where the global value lives.
        global_shape: needed only when a dim does not divide evenly; by default each dim is
            ``local`` size times the number of tiles along it.
        device: None (a ShardedTensor) or the virtual device (a tensor on it).

    Raises ShardingError when ``local`` does not have the shape this process's device holds.

    Example (4 processes under torchrun, ``P("data")``, a per-process batch of 4 rows):
        >>> mesh = Mesh.create((4,), ("data",))
        >>> x = make_global(torch.randn(4, 128), mesh, P("data"))  # doctest: +SKIP
        >>> x.shape  # doctest: +SKIP
        torch.Size([16, 128])
    """
    out = _make_global(local, mesh, spec, global_shape)
    return out if device is None else out.to(device)


def _make_global(
    local: torch.Tensor, mesh: Mesh, spec: SpecLike, global_shape: Sequence[int] | None
) -> ShardedTensor:
    if not isinstance(local, torch.Tensor):
        raise ShardingError(
            f"make_global expects a torch.Tensor (this process's part of the batch), got "
            f"{type(local).__name__}."
        )
    sharding = as_spec(spec).to_sharding(mesh, local.ndim)
    position = _dist_position(mesh)
    if position is None:
        if global_shape is not None and tuple(global_shape) != tuple(local.shape):
            raise ShardingError(
                f"make_global in a single process takes the whole global value: got shape "
                f"{tuple(local.shape)}, but global_shape={tuple(global_shape)}. On the "
                f"simulated mesh one process holds every device, so load the global batch."
            )
        return mark_sharding(local, mesh, spec)
    if global_shape is None:
        shape = tuple(n * k for n, k in zip(local.shape, sharding.tile_shape, strict=True))
    else:
        shape = tuple(int(n) for n in global_shape)
    if len(shape) != local.ndim:
        raise ShardingError(
            f"make_global: global_shape {shape} has {len(shape)} dims, the local part "
            f"{tuple(local.shape)} has {local.ndim}."
        )
    sharding.check_shape(shape)
    ranges = index_ranges(sharding, shape)[position].tolist()
    expected = tuple(b - a for a, b in ranges)
    if tuple(local.shape) != expected:
        device = mesh.device_ids[position]
        raise ShardingError(
            f"make_global: process {device} (mesh device {device}, coordinates "
            f"{mesh.coords(device)}) passed a part of shape {tuple(local.shape)}, but under "
            f"{sharding.spec} on {mesh!r} a global value of shape {shape} gives it rows "
            f"{[(a, b) for a, b in ranges]}, i.e. shape {expected}. Each process loads its own "
            f"part of the global batch (per-process batch = global batch / tiles of the batch "
            f"dim = {shape[0] if shape else 1} / "
            f"{sharding.tile_shape[0] if shape else 1}); use "
            f"partita.data.process_slice(global_shape, mesh, spec) to find it."
        )
    from partita.runtime.distributed import DistributedShardedTensor, distributed_executor

    padded_shape = local_shape(sharding, shape)
    data = local
    if tuple(local.shape) != padded_shape:
        data = local.new_zeros(padded_shape)
        data[tuple(slice(0, n) for n in local.shape)] = local
    executor = distributed_executor(mesh)
    assert executor is not None  # _dist_position returned a position
    return DistributedShardedTensor.from_local(data.contiguous(), sharding, shape, executor)


class GlobalBatchLoader:
    """Iterate ``dataloader`` (this process's batches) and yield global ShardedTensors.

    Args:
        dataloader: any iterable of batches: tensors, or tuples/lists/dicts of tensors of
            different shapes. Under torch.distributed each batch holds this process's rows
            (``per_process_batch_size`` of them); in a single process, the whole global batch.
        mesh: the mesh the step runs on.
        spec: one spec for every tensor of a batch (``P("data")``: batch dim over ``data``),
            or a tree of specs matching the batch's structure.
        device: None (yield ShardedTensors) or the virtual device (yield its tensors, each
            process putting only its rows there; see :func:`make_global`).

    ``per_process_batch_size`` and ``global_batch_size`` are known after the first batch (dim 0
    of the first tensor).

    Example:
        >>> loader = GlobalBatchLoader(my_loader, mesh, P("data"))  # doctest: +SKIP
        >>> for ids, targets in loader:  # doctest: +SKIP
        ...     loss = step((ids, targets))  # global [16, 128] each, 4 rows loaded here
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        mesh: Mesh,
        spec: Any,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.mesh = mesh
        self.spec = spec
        self.device = device
        self.per_process_batch_size: int | None = None
        self.global_batch_size: int | None = None

    def __len__(self) -> int:
        return len(self.dataloader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataloader:
            yield self.make_global(batch)

    def make_global(self, batch: Any) -> Any:
        """One batch of this process's data -> the global batch (same structure)."""
        leaves, tree = pytree.tree_flatten(batch)
        if _is_spec(self.spec):
            specs = [self.spec] * len(leaves)
        else:
            specs, spec_tree = pytree.tree_flatten(self.spec, is_leaf=_is_spec)
            if spec_tree != tree:
                raise ShardingError(
                    f"GlobalBatchLoader: the spec tree {spec_tree} does not match the batch "
                    f"structure {tree}. Pass one spec for every tensor, or a tree of specs of "
                    f"the same structure (None entries for replicated tensors)."
                )
        out = [
            make_global(leaf, self.mesh, spec, device=self.device)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf, spec in zip(leaves, specs, strict=True)
        ]
        first = next(
            (x for x in out if isinstance(x, ShardedTensor | torch.Tensor) and x.ndim), None
        )
        if first is not None:
            local = next(x for x in leaves if isinstance(x, torch.Tensor) and x.ndim)
            self.per_process_batch_size = int(local.shape[0])
            self.global_batch_size = int(first.shape[0])
        return pytree.tree_unflatten(out, tree)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)
