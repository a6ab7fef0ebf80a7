"""What one device holds of a ShardedTensor: its padded tile, where it sits, which replica."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Shard"]


@dataclass(frozen=True, slots=True, eq=False)
class Shard:
    """What one device holds of a :class:`ShardedTensor`.

    Attributes:
        data: the padded local tensor (every device has the same shape): a copy from
            ``local_shards``, a read-only view of the storage from ``local_shard_views``.
        unpadded_data: ``data`` without its padding: exactly ``global_tensor[index]``.
        device: the mesh device id (``mesh.device_ids[position]``).
        index: one ``slice`` per dim into the global tensor; a device holding only padding
            along a dim gets an empty slice ``n:n``.
        replica_id: distinct among the devices holding the same tile (see
        ``partita.values.layout``).

    Example:
        >>> x = partita.mark_sharding(torch.arange(4.0), Mesh.create((2,), ("x",)), P("x"))
        >>> s = x.local_shards[1]
        >>> s.device, s.index, s.data.tolist()
        (1, (slice(2, 4, None),), [2.0, 3.0])
    """

    data: torch.Tensor
    unpadded_data: torch.Tensor
    device: int
    index: tuple[slice, ...]
    replica_id: int
