"""partita shardings as DCP chunks: which tiles of a ShardedTensor this process writes or reads.

``torch.distributed.checkpoint`` (DCP) describes a saved tensor as its global size plus a list
of *chunks* (offsets and sizes into the global tensor), each written once. A partita
:class:`~partita.ShardedTensor` maps onto that directly: a device's tile is the box
``index_ranges`` gives (``[start, stop)`` per dim) *without* its ceil padding; devices holding
the same tile differ only by replica id, and only replica 0 writes it, so a replicated value is
stored once. A device that holds only padding along some dim owns an empty box and writes
nothing.

Which devices count as "this process":

* on the simulated LocalMesh, one process holds every device, so it writes every distinct tile
  and reads a value back whole (one chunk covering the tensor), then cuts it with
  ``ShardedTensor.from_global``;
* under ``torch.distributed`` (one process per device), a process writes and reads only the tile
  of its own device; DCP's load planner turns a saved chunk layout into reads of the overlapping
  pieces, which is the resharding.

:class:`Tiles` is the leaf the planners in :mod:`partita.checkpoint.planner` understand. This
module moves no data between processes and opens no files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from partita.errors import CheckpointError
from partita.runtime.dist_tensor import DistributedShardedTensor
from partita.runtime.distributed import distributed_executor
from partita.values.layout import index_ranges
from partita.values.tensor import ShardedTensor

__all__ = ["Tiles", "assemble", "tiles_to_read", "tiles_to_write"]


@dataclass
class Tiles:
    """A tensor of global ``size`` and ``dtype`` of which this process holds ``chunks``.

    ``chunks`` maps a chunk's offsets (one per dim) to its data: the tile to write, or the
    buffer a load fills.
    """

    size: torch.Size
    dtype: torch.dtype
    chunks: dict[torch.Size, torch.Tensor] = field(default_factory=dict)


def _one_process_per_device(t: ShardedTensor) -> bool:
    return isinstance(t, DistributedShardedTensor) or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() == t.mesh.size
    )


def _own_position(t: ShardedTensor) -> int:
    if isinstance(t, DistributedShardedTensor):
        return t.mesh.position(t.addressable_devices[0])
    return t.mesh.position(dist.get_rank())


def _check_not_partial(name: str, t: ShardedTensor) -> None:
    if t.sharding.partial:
        raise CheckpointError(
            f"checkpoint: {name!r} (shape {tuple(t.shape)}) has sharding {t.sharding}, partial "
            f"over {sorted(t.sharding.partial)}: its devices hold addends, not pieces of the "
            "value, so there is no chunk to write. Reduce it first: "
            "partita.reshard(t, t.spec) before saving."
        )


def tiles_to_write(name: str, t: ShardedTensor) -> Tiles:
    """The distinct, unpadded tiles of ``t`` this process writes (replica 0 of each)."""
    _check_not_partial(name, t)
    out = Tiles(torch.Size(t.shape), t.dtype)
    if t.shape.numel() == 0:  # nothing to cut: one empty chunk, written by device 0's process
        if not _one_process_per_device(t) or _own_position(t) == 0:
            out.chunks[torch.Size([0] * t.ndim)] = torch.empty(t.shape, dtype=t.dtype)
        return out
    shards = t.local_shard_views
    if _one_process_per_device(t) and not isinstance(t, DistributedShardedTensor):
        # a value still in LocalMesh storage (before the first distributed step): every
        # process has every tile, and writes only its own device's
        shards = [shards[_own_position(t)]]
    for shard in shards:
        sizes = [s.stop - s.start for s in shard.index]
        if shard.replica_id == 0 and all(n > 0 for n in sizes):
            offsets = torch.Size(s.start for s in shard.index)
            out.chunks[offsets] = shard.unpadded_data
    return out


def tiles_to_read(name: str, template: ShardedTensor) -> Tiles:
    """Empty buffers for what this process must read to rebuild ``template``'s layout."""
    _check_not_partial(name, template)
    out = Tiles(torch.Size(template.shape), template.dtype)
    if not _one_process_per_device(template):
        out.chunks[torch.Size([0] * template.ndim)] = torch.empty(
            template.shape, dtype=template.dtype
        )
        return out
    ranges = index_ranges(template.sharding, template.shape)[_own_position(template)].tolist()
    sizes = [stop - start for start, stop in ranges]
    if all(n > 0 for n in sizes):  # else this device holds only padding: nothing to read
        offsets = torch.Size(start for start, _ in ranges)
        out.chunks[offsets] = torch.empty(sizes, dtype=template.dtype)
    return out


def assemble(template: ShardedTensor, tiles: Tiles) -> ShardedTensor:
    """A ShardedTensor laid out like ``template`` holding the data read into ``tiles``."""
    sharding = template.sharding
    if not _one_process_per_device(template):
        (full,) = tiles.chunks.values()
        return ShardedTensor.from_global(full, sharding)
    local = torch.zeros(template.local_shape, dtype=template.dtype)
    for data in tiles.chunks.values():
        local[tuple(slice(0, n) for n in data.shape)] = data
    executor = distributed_executor(template.mesh)
    assert executor is not None  # _one_process_per_device: torch.distributed is initialised
    return DistributedShardedTensor.from_local(local, sharding, template.shape, executor)
