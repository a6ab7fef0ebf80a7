"""The public entry points that tie the stages together.

``mark_sharding`` is one name for two things, as in PyTorch/XLA: on a concrete tensor it shards
the data (``partita.values.tensor``); on a tensor being traced inside a captured function it
records an
annotation node (``partita.capture``). ``propagate_program`` traces and propagates a function
and returns the program with every value's sharding, for inspection before anything runs.

This module holds no sharding logic of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from partita import capture
from partita.errors import ArgumentError
from partita.frontend.pipeline import propagated_program
from partita.report.explain import format_program
from partita.values import tensor
from partita.values.annotations import clear_parameter, mark_parameter
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, as_spec
from partita.virtual.lazy import LazyTensor
from partita.virtual.marking import clear_in_place, mark_in_place

__all__ = ["clear_sharding", "format_program", "mark_sharding", "propagate_program"]


def mark_sharding(
    t: torch.Tensor | tensor.ShardedTensor,
    mesh: Mesh,
    spec: PartitionSpec | tuple[Any, ...] | list[Any] | None,
    *,
    priority: int = 0,
    gradient: bool = False,
) -> Any:
    """Shard data, or annotate a traced tensor, over ``mesh`` as ``spec`` says.

    * Outside a captured function: ``t`` is concrete data and the result is a
      :class:`~partita.ShardedTensor` (see :func:`partita.values.tensor.mark_sharding`).
    * On a tensor of the virtual device (``partita.use_spmd``): in place, and returns ``t``
      itself (an ``nn.Parameter`` stays that Parameter). Data is laid out over the mesh now; a
      pending value (not computed yet) gets an annotation in the recorded step.
    * Inside a function being captured (``partita.jit``, ``partita.capture.trace``): records an
      annotation node and returns the annotated tensor; propagation never overrides it.
      ``priority`` (lower wins, default 0) decides conflicts between annotations.
      ``gradient=True`` annotates the gradient that flows back through the value as well
      (same sharding and priority; PyTorch/XLA's ``mark_sharding_with_gradients``, JAX's
      ``with_sharding_constraint``); by default the backward is left to propagation. On the
      virtual device too (the gradient is marked in place when the backward computes it).
    * Inside a module's forward run eagerly on plain tensors (``model(x)`` on the CPU, the
      unsharded reference; not traced, not on the device): returns ``t`` itself, unchanged,
      so the forward keeps its autograd graph, as PyTorch/XLA's call does off an XLA device.
    * On an ``nn.Parameter`` (a module's weight, off the device): also remembers the sharding
      for that parameter, so ``partita.jit(model)`` and ``partita.train_step`` shard it so
      (another sharding later raises until ``clear_sharding(param)``).

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
        return mark_in_place(t, mesh, spec, gradient=gradient)
    if capture.is_tracing() and not isinstance(t, tensor.ShardedTensor):
        return capture.annotate(t, mesh, spec, priority=priority, gradient=gradient)
    if priority:
        raise ArgumentError("priority only applies to annotations inside a captured function")
    eager_forward = isinstance(t, torch.Tensor) and in_eager_forward()
    if gradient and not eager_forward:
        raise ArgumentError(
            f"mark_sharding(gradient=True) on concrete data (a {type(t).__name__}, outside a "
            f"captured function): only a traced tensor has a gradient to annotate. Call it "
            f"inside the function you pass to partita.jit (or a module's forward that "
            f"partita.train_step traces, or on a tensor of the virtual device), or drop "
            f"gradient=True to lay the data out."
        )
    if eager_forward:
        if not isinstance(mesh, Mesh):
            return tensor.mark_sharding(t, mesh, spec)  # its error for a wrong mesh
        as_spec(spec).to_sharding(mesh, t.ndim).check_shape(t.shape)  # still a valid spec
        return t
    if isinstance(t, nn.Parameter) and isinstance(mesh, Mesh):
        mark_parameter(t, as_spec(spec).to_sharding(mesh, t.ndim))
    return tensor.mark_sharding(t, mesh, spec)


def clear_sharding(t: Any) -> Any:
    """Remove the annotation of ``t`` in place and return ``t``: a ShardedTensor
    (:func:`partita.values.tensor.clear_sharding`) or a tensor of the virtual device; the next
    ``mark_sharding`` may then choose any sharding and re-lays ``t`` out in place.

    Example:
        >>> mesh = Mesh.create((2,), ("x",))
        >>> x = mark_sharding(torch.zeros(4, 2), mesh, P("x", None))
        >>> clear_sharding(x).is_annotated
        False
    """
    if isinstance(t, LazyTensor):
        return clear_in_place(t)
    if isinstance(t, nn.Parameter) and clear_parameter(t):  # a module weight's mark
        return t
    return tensor.clear_sharding(t)


#: The code of ``nn.Module``'s call: a frame running it means a module's forward is running.
_MODULE_CALLS = frozenset(
    getattr(nn.Module, name).__code__ for name in ("_call_impl", "_wrapped_call_impl")
)


def in_eager_forward(depth: int = 64) -> bool:
    """Whether the caller runs inside an ``nn.Module``'s forward (``model(x)``): a frame of
    ``Module.__call__`` among the ``depth`` innermost. Asked only off the device and outside
    tracing, so such a forward runs eagerly on plain tensors."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in _MODULE_CALLS:
            return True
        frame = frame.f_back
    return False


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

    ``print(partita.frontend.annotate.format_program(prog.graph_module))`` shows every value. This
    is an
    internal step of ``partita.jit(...).lower()``.
    """
    return propagated_program(
        fn, args, kwargs, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
        replicate_unsupported=replicate_unsupported,
    )  # fmt: skip
