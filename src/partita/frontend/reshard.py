"""The one public ``reshard``: a ShardedTensor's data moved to another sharding.

``partita.reshard(x, spec)`` compiles the identity program from ``x``'s sharding to ``spec``
with the compile pipeline (:func:`partita.frontend.pipeline.compile_function`), so the move is the
one
the partitioner's reshard planner chooses (the cheapest collectives, the same as inside any
program) and it runs on whichever executor holds ``x``: the simulated LocalMesh, or under
torch.distributed each rank's own shard only. The compiled moves are kept (an LRU of
:data:`CACHE_SIZE` ``(mesh, from, to, shape, dtype, options)`` keys). A move is compiled with the
current options except ``strict`` and ``collectives``: the user asked for this move, so a
gather it needs is neither "involuntary" nor "implicit".

Only two cases take the whole value instead, because no single program covers them: a target
sharding on another mesh, and a value with partial (un-reduced) axes. :func:`write_back` copies
a program's new value of an input it updated in place into that input (``partita.jit``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from partita import options
from partita.errors import RematerializationWarning
from partita.frontend.pipeline import Compiled, compile_function
from partita.runtime.executor import executor_for
from partita.values import tensor
from partita.values.spec import PartitionSpec, Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["CACHE_SIZE", "reshard", "write_back"]

#: How many compiled moves are kept.
CACHE_SIZE = 64

_MOVES: OrderedDict[tuple[Any, ...], Compiled] = OrderedDict()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _move(x: ShardedTensor, dst: PartitionSpec) -> Compiled:
    opts = options.current().replace(strict=False, collectives="auto")
    key = (x.mesh, x.sharding.spec, dst, tuple(x.shape), x.dtype, opts.key())
    move = _MOVES.get(key)
    if move is None:
        with warnings.catch_warnings():
            # The user asked for this move: a gather it needs is not "involuntary".
            warnings.simplefilter("ignore", RematerializationWarning)
            move = compile_function(
                _identity, (x,), {}, mesh=x.mesh, specs=[x.sharding.spec], out_specs=dst,
                options=opts,
            )  # fmt: skip
        _MOVES[key] = move
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
    move = _move(x, target.spec)
    with torch.no_grad():
        (out,) = executor_for(x.mesh).run_compiled(move, [x, *move.program.constants])
    return out


def write_back(leaf: torch.Tensor | ShardedTensor, new: ShardedTensor) -> None:
    """Copy the program's new value of an input the function updated in place into it."""
    with torch.no_grad():
        if not isinstance(leaf, ShardedTensor):
            leaf.copy_(new.full())
            return
        if new.sharding != leaf.sharding:
            new = reshard(new, leaf.sharding)
        dst, src = leaf.stacked, new.stacked
        if dst.dim() and dst.stride(0) == 0:  # a replicated stride-0 stack: one copy for all
            dst, src = dst[0], src[0]
        dst.copy_(src)
