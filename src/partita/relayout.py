"""The one public ``reshard``: a ShardedTensor's data moved to another sharding.

``partita.reshard(x, spec)`` compiles the identity program from ``x``'s sharding to ``spec``
with :func:`partita.jit`, so the move is the one the partitioner's reshard planner chooses
(the cheapest collectives, the same as inside any program) and it runs on whichever executor
holds ``x``: the simulated LocalMesh, or under torch.distributed each rank's own shard only.
The compiled moves are kept (an LRU of :data:`CACHE_SIZE` ``(mesh, from, to)`` triples).

Only two cases take the whole value instead, because no single program covers them: a target
sharding on another mesh, and a value with partial (un-reduced) axes.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from partita import tensor
from partita.errors import RematerializationWarning
from partita.jit import Jitted, jit
from partita.mesh import Mesh
from partita.spec import PartitionSpec, Sharding
from partita.tensor import ShardedTensor

__all__ = ["CACHE_SIZE", "reshard"]

#: How many compiled moves are kept (each is a jit with its own per-shape cache).
CACHE_SIZE = 64

_MOVES: OrderedDict[tuple[Mesh, PartitionSpec, PartitionSpec], Jitted] = OrderedDict()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _move(mesh: Mesh, src: PartitionSpec, dst: PartitionSpec) -> Jitted:
    key = (mesh, src, dst)
    move = _MOVES.get(key)
    if move is None:
        move = _MOVES[key] = jit(_identity, mesh=mesh, in_specs=(src,), out_specs=dst)
        if len(_MOVES) > CACHE_SIZE:
            _MOVES.popitem(last=False)
    else:
        _MOVES.move_to_end(key)
    return move


def reshard(x: ShardedTensor, spec: PartitionSpec | Sharding | Any) -> ShardedTensor:
    """A new ShardedTensor with the value of ``x`` under ``spec`` (on ``x``'s mesh).

    The move is planned like any reshard inside a program (``x.sharding -> spec``: all_gather,
    all_to_all, a local slice, ...; ``partita.jit(lambda t: t, ...).lower(x).explain()`` shows
    it) and runs on each device's shard, under torch.distributed too. ``spec`` may also be a
    :class:`~partita.Sharding`, possibly on another mesh: that move, and one from a partial
    value, go through the whole value. To ``x``'s own sharding the result shares ``x``'s data
    (as ``DTensor.redistribute`` returns its input).

    Example:
        >>> mesh = Mesh.create((2,), ("x",))
        >>> y = partita.reshard(partita.mark_sharding(torch.zeros(4, 2), mesh, P("x", None)),
        ...                     P(None, "x"))
        >>> y.sharding, y.local_shape
        (P(None, 'x'), (4, 1))
    """
    target = tensor.reshard_target(x, spec)
    if target.mesh != x.mesh or x.sharding.partial or target.partial:
        return tensor.reshard(x, target)
    move = _move(x.mesh, x.sharding.spec, target.spec)
    with warnings.catch_warnings():
        # The user asked for this move: a gather it needs is not "involuntary".
        warnings.simplefilter("ignore", RematerializationWarning)
        return move(x)
