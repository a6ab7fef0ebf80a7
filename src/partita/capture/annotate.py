"""Sharding annotations inside a traced program.

``annotate(t, mesh, spec)`` records ``Annotation(sharding, priority, source)`` in a
module-level table under a fresh integer key and returns ``partita::annotate(t, key)``: an
identity op that survives tracing, so the captured graph holds one annotate node per
annotation and :func:`partita.capture.trace` can map each node back to its Annotation. Its
gradient passes through unchanged (no annotate node appears in the backward), unless the
annotation was made with ``gradient=True``: then a second Annotation, of the same sharding and
priority, is recorded for the gradient, and the op's backward is an annotate node of it (as
JAX's ``with_sharding_constraint`` constrains the cotangent, and PyTorch/XLA's
``mark_sharding_with_gradients``).

An annotate node whose result is never used is kept in the graph (capture does not remove it
as dead code): the annotation still constrains its *input*, which gives PyTorch/XLA-style
``mark_sharding(t, ...)`` calls that ignore the return value their meaning.

All annotations of one program must use the same Mesh (checked as they are recorded). This
module does not propagate or check shardings against each other; that is ``propagate``'s job.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.capture.ops import GRADIENT_KEYS, annotate_op
from partita.capture.source import format_source, user_frame
from partita.errors import InternalError, ShardingConflictError
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, Sharding, as_spec

__all__ = ["ANNOTATE_OP", "Annotation", "annotate", "is_tracing", "new_key", "record"]

#: The op that marks an annotation in a captured graph.
ANNOTATE_OP = torch.ops.partita.annotate.default


@dataclass(frozen=True, slots=True)
class Annotation:
    """A user's sharding annotation on one value of a program.

    Attributes:
        sharding: the normalised sharding the value must have.
        priority: lower numbers win in propagation conflicts (user annotations default to 0).
        source: where it was written, ``"file.py:LINE in func"``, or a description such as
            ``"in_specs for args[0]['w']"``.
    """

    sharding: Sharding
    priority: int = 0
    source: str | None = None


@dataclass
class _TraceState:
    """The annotations recorded by one trace() call."""

    table: dict[int, Annotation] = field(default_factory=dict)
    mesh: Mesh | None = None
    mesh_source: str | None = None


_KEYS = itertools.count()
_TABLE: dict[int, Annotation] = {}
_STATE: contextvars.ContextVar[_TraceState | None] = contextvars.ContextVar(
    "partita_capture_state", default=None
)


def is_tracing() -> bool:
    """True inside :func:`partita.capture.trace` (while the user function runs)."""
    return _STATE.get() is not None


@contextmanager
def tracing_scope(
    mesh: Mesh | None = None, mesh_source: str | None = None
) -> Iterator[_TraceState]:
    """Mark a trace in progress; yields the state that collects its annotations."""
    state = _TraceState(mesh=mesh, mesh_source=mesh_source)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)
        for key in state.table:
            _TABLE.pop(key, None)
            GRADIENT_KEYS.pop(key, None)


def lookup(key: int) -> Annotation | None:
    """The annotation recorded under ``key`` (during the trace that recorded it)."""
    return _TABLE.get(key)


def _check_mesh(state: _TraceState, mesh: Mesh, source: str | None) -> None:
    if state.mesh is None:
        state.mesh, state.mesh_source = mesh, source
    elif state.mesh != mesh:
        raise ShardingConflictError(
            f"One program uses two meshes: {state.mesh!r} (annotated at "
            f"{state.mesh_source or 'an unknown line'}) and {mesh!r} (annotated at "
            f"{source or 'an unknown line'}). Every annotation of a program must use the same "
            f"Mesh; build the mesh once and pass it everywhere."
        )


def record(
    t: torch.Tensor,
    mesh: Mesh,
    spec: PartitionSpec | Any,
    *,
    priority: int = 0,
    source: str | None = None,
    gradient: bool = False,
) -> torch.Tensor:
    """Like :func:`annotate` with an explicit ``source`` (used for in_specs / out_specs)."""
    if _STATE.get() is None:  # eager: nothing to record, keep the value semantics
        as_spec(spec).to_sharding(mesh, t.ndim)  # still check the spec
        return annotate_op(t, -1)
    key = new_key(mesh, spec, t.ndim, priority=priority, source=source)
    if gradient:
        where = f"{source}, on its gradient" if source else "the gradient of an annotation"
        GRADIENT_KEYS[key] = new_key(mesh, spec, t.ndim, priority=priority, source=where)
    return annotate_op(t, key)


def new_key(
    mesh: Mesh, spec: PartitionSpec | Any, ndim: int, *, priority: int = 0, source: str | None
) -> int:
    """Record an annotation of a value with ``ndim`` dims in the current trace; its key.

    What :func:`record` does short of adding the op: trace inserts the annotate nodes of
    ``in_specs`` and ``out_specs`` into the graph itself, after tracing (an op dispatched
    while tracing costs milliseconds; a node added to the graph, microseconds).
    """
    state = _STATE.get()
    if state is None:
        raise InternalError(
            f"capture.new_key was called outside a trace (no trace state is active). "
            f"{InternalError.REPORT}"
        )
    sharding = as_spec(spec).to_sharding(mesh, ndim)
    _check_mesh(state, mesh, source)
    key = next(_KEYS)
    ann = Annotation(sharding, priority, source)
    state.table[key] = ann
    _TABLE[key] = ann
    return key


def annotate(
    t: torch.Tensor,
    mesh: Mesh,
    spec: PartitionSpec | Any,
    *,
    priority: int = 0,
    gradient: bool = False,
) -> torch.Tensor:
    """Annotate a traced tensor with a sharding; returns the annotated value.

    ``spec`` is a ``P``, a tuple of entries, or None (replicated). Inside
    :func:`partita.capture.trace` this adds a ``partita::annotate`` node carrying
    ``Annotation(sharding, priority, source line)``; outside a trace it only returns a copy.
    ``gradient=True`` annotates the gradient that flows back through the value too (same
    sharding and priority), where a backward is traced.

    Example:
        >>> mesh = Mesh.create((2, 4), ("x", "y"))
        >>> def fn(a, b):
        ...     return annotate(a @ b, mesh, P("x", None))
        >>> program = trace(fn, (torch.ones(8, 4), torch.ones(4, 8)))   # doctest: +SKIP
    """
    source = format_source(user_frame())
    return record(t, mesh, spec, priority=priority, source=source, gradient=gradient)
