"""The value of a multi-process run: a ShardedTensor of which this process holds one shard.

:class:`DistributedShardedTensor` keeps only this rank's padded shard (``addressable_data``:
``[1, *local_shape]``); ``full()`` (and printing) gathers the global value from every process,
so it is a collective that every process must call on the same value (checked first; a
replicated value is read locally, without communication). :func:`local_shard` cuts this
rank's shard out of a global value.

This module does not run programs (``runtime.distributed`` does) and does not create groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from partita.errors import DistributedError
from partita.runtime.comm import call_collective, gather_flat
from partita.values.layout import (
    index_ranges,
    local_shape,
    replica_ids,
    shard_tensor,
    unshard_tensor,
)
from partita.values.spec import Sharding
from partita.values.tensor import Shard, ShardedTensor

__all__ = ["DistributedShardedTensor", "is_computed", "local_shard"]


class RankedExecutor(Protocol):
    """What a shard's constructor reads of its executor (``runtime.distributed``'s
    ``DistributedMesh``, which imports this module)."""

    @property
    def rank(self) -> int: ...


def local_shard(value: Tensor, sharding: Sharding, position: int) -> Tensor:
    """The padded shard of the global ``value`` that mesh position ``position`` holds."""
    if sharding.partial:
        return shard_tensor(value, sharding)[position]
    if sharding.is_replicated:
        return value
    ranges = index_ranges(sharding, value.shape)[position].tolist()
    piece = value[tuple(slice(a, b) for a, b in ranges)]
    shape = local_shape(sharding, value.shape)
    if tuple(piece.shape) == shape:
        return piece.contiguous()
    out = value.new_zeros(shape)
    out[tuple(slice(0, n) for n in piece.shape)] = piece
    return out


class DistributedShardedTensor(ShardedTensor):
    """A ShardedTensor of which this process holds only its own device's shard.

    ``addressable_data`` is ``[1, *local_shape]`` (this rank's padded shard);
    ``addressable_devices`` the device ids it belongs to. ``full()`` and ``print`` gather the
    global value from every process (a collective: call them on every process; a replicated
    value is read locally). ``local_shards`` lists only the addressable shards.

    Build one with :meth:`from_local`.
    """

    __slots__ = ("_computed", "_devices", "_local", "_shard")

    def __init__(
        self,
        local: Tensor,
        sharding: Sharding,
        shape: Sequence[int],
        device: int,
        computed: bool = False,
    ) -> None:
        # Internal: use from_local (validated). The base class keeps the same one-shard
        # storage, so its dtype / local_shape / sharding / shape work unchanged.
        stacked = local.unsqueeze(0)
        super().__init__(stacked, sharding, shape)
        self._local = stacked
        # the shard itself, as the next program reads it (``addressable_shard``): a program's
        # outputs are the next step's inputs, so no view of it is made per input per step
        self._shard = local
        self._devices = (device,)
        # An output of a partita program: equal on its replicas by construction, so the
        # replica check (runtime.plan_check) skips it.
        self._computed = computed

    @classmethod
    def from_local(
        cls,
        local: Tensor,
        sharding: Sharding,
        shape: Sequence[int],
        executor: RankedExecutor,
        *,
        computed: bool = False,
    ) -> DistributedShardedTensor:
        """Wrap this rank's padded shard of a global value of ``shape`` under ``sharding``
        (``computed``: an output of a program run by ``executor``, not the user's value)."""
        expected = local_shape(sharding, shape)
        if tuple(local.shape) != expected:
            raise DistributedError(
                f"rank {executor.rank} holds a shard of shape {tuple(local.shape)}, but global "
                f"shape {tuple(shape)} under {sharding} needs {expected}: the shard was cut "
                f"for another global shape or sharding. Build it with "
                f"partita.data.make_global(rows, mesh, spec, global_shape=...)."
            )
        return cls(local, sharding, shape, executor.rank, computed)

    @property
    def addressable_data(self) -> Tensor:
        """This process's padded shards, ``[len(addressable_devices), *local_shape]``."""
        return self._local

    @property
    def addressable_shard(self) -> Tensor:
        """This process's padded shard, ``local_shape``: ``addressable_data[0]``."""
        return self._shard

    @property
    def addressable_devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def stacked(self) -> Tensor:
        raise DistributedError(
            "This ShardedTensor lives on a DistributedMesh: this process holds only the shard "
            f"of device {self._devices[0]} (.addressable_data), not the stacked storage of "
            "every device. Use .full() for the global value (a collective) or .local_shards."
        )

    def full(self) -> Tensor:
        sharding, shape = self.sharding, self.shape
        if sharding.is_replicated:  # every device holds the whole value
            return self._local[0][tuple(slice(0, n) for n in shape)].clone()
        mesh = self.mesh
        self._check_same_value()
        local = self._local[0].contiguous()
        gathered = gather_flat(
            local, dist.get_world_size(), None, "", "ShardedTensor.full", mesh.axis_names, None
        )
        stacked = gathered[torch.tensor(mesh.device_ids, device=local.device)]
        return unshard_tensor(stacked, sharding, shape)

    def _check_same_value(self) -> None:
        """Every process must gather the same value: compare a fixed-size digest of it first.

        Without this, two processes printing different values (``print(x)`` on one, ``print(y)``
        on another) would gather buffers of different sizes: Gloo aborts the process, or one
        side reads the other's bytes as its tensor.
        """
        what = f"shape {tuple(self.shape)}, dtype {self.dtype}, sharding {self.sharding}"
        digest = hashlib.sha256(what.encode()).digest()
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        world, axes = dist.get_world_size(), self.mesh.axis_names
        every = gather_flat(mine, world, None, "", "ShardedTensor.full", axes, None)
        if bool((every == every[0]).all()):
            return
        described: list[Any] = [None] * world
        call_collective("", "ShardedTensor.full", axes, None,
                        lambda: dist.all_gather_object(described, what))  # fmt: skip
        rank = dist.get_rank()
        other = next(r for r in range(world) if described[r] != what)
        raise DistributedError(
            f"ShardedTensor.full() (or print) was called on different values by different "
            f"processes: this rank ({rank}) gathers a value of {what}; rank {other} one of "
            f"{described[other]}. full() and printing a sharded value are collectives: every "
            f"process must call them on the same value, in the same order. To print on one "
            f"process, use partita.distributed.log(x) on every process."
        )

    def _shards(self, *, copy: bool) -> list[Shard]:
        ranges = index_ranges(self.sharding, self.shape).tolist()
        replicas = replica_ids(self.sharding).tolist()
        shards = []
        for i, device in enumerate(self._devices):
            p = self.mesh.position(device)
            index = tuple(slice(a, b) for a, b in ranges[p])
            data = self._local[i].clone() if copy else self._local[i]
            unpadded = data[tuple(slice(0, b - a) for a, b in ranges[p])]
            shards.append(Shard(data, unpadded, device, index, replicas[p]))
        return shards


def is_computed(value: object) -> bool:
    """Whether ``value`` is an output of a partita program run under torch.distributed."""
    return isinstance(value, DistributedShardedTensor) and value._computed
