"""The public entry points that tie the stages together.

``mark_sharding`` is one name for two things, as in PyTorch/XLA: on a concrete tensor it shards
the data (``partita.tensor``); on a tensor being traced inside a captured function it records an
annotation node (``partita.capture``). ``propagate_program`` traces and propagates a function
and returns the program with every value's sharding, for inspection before anything runs.

This module holds no sharding logic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from partita import capture, propagate, tensor
from partita.errors import ArgumentError
from partita.explain import format_program
from partita.mesh import Mesh
from partita.spec import PartitionSpec
from partita.virtual.lazy import LazyTensor
from partita.virtual.marking import mark_in_place

__all__ = ["format_program", "mark_sharding", "propagate_program"]


def mark_sharding(
    t: torch.Tensor | tensor.ShardedTensor,
    mesh: Mesh,
    spec: PartitionSpec | tuple[Any, ...] | list[Any] | None,
    *,
    priority: int = 0,
) -> Any:
    """Shard data, or annotate a traced tensor, over ``mesh`` as ``spec`` says.

    * Outside a captured function: ``t`` is concrete data and the result is a
      :class:`~partita.ShardedTensor` (see :func:`partita.tensor.mark_sharding`).
    * On a tensor of the virtual device (``partita.use_spmd``): in place, and returns ``t``
      itself (an ``nn.Parameter`` stays that Parameter). Data is laid out over the mesh now; a
      pending value (not computed yet) gets an annotation in the recorded step.
    * Inside a function being captured (``partita.jit``, ``partita.capture.trace``): records an
      annotation node and returns the annotated tensor; propagation never overrides it.
      ``priority`` (lower wins, default 0) decides conflicts between annotations.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> x = mark_sharding(torch.ones(8, 32), mesh, P("data", None))   # data
        >>> def f(a):
        ...     h = mark_sharding(a * 2, mesh, P("data", None))             # annotation
        ...     return h.sum()
    """
    if isinstance(t, LazyTensor):
        if priority:
            raise ArgumentError(
                "mark_sharding(priority=...) only applies to annotations inside a captured "
                "function; a virtual-device tensor's annotation always has priority 0."
            )
        return mark_in_place(t, mesh, spec)
    if capture.is_tracing() and not isinstance(t, tensor.ShardedTensor):
        return capture.annotate(t, mesh, spec, priority=priority)
    if priority:
        raise ArgumentError("priority only applies to annotations inside a captured function")
    return tensor.mark_sharding(t, mesh, spec)


def propagate_program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    mesh: Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    replicate_unsupported: bool = False,
) -> capture.Program:
    """Trace ``fn`` and propagate shardings; the program's nodes carry ``node_meta.sharding``.

    ``print(partita.api.format_program(prog.graph_module))`` shows every value. This is an
    internal step of ``partita.jit(...).lower()``.
    """
    prog = capture.trace(fn, args, kwargs, in_specs=in_specs, out_specs=out_specs, mesh=mesh)
    propagate.propagate(prog.graph_module, mesh, replicate_unsupported=replicate_unsupported)
    return prog
