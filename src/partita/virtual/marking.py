"""``mark_sharding`` and ``clear_sharding`` on a virtual-device tensor: in place.

On a tensor holding data the bytes are laid out over the mesh now (sliced, short shards zero
padded; the Python object, an ``nn.Parameter`` included, stays the same); on a pending tensor
an annotation is recorded, which propagation treats as it treats ``mark_sharding`` inside
``partita.jit``. The annotation rules are a ShardedTensor's (docs/virtual-device.md, "Device
tensors and ShardedTensors"): the same sharding again is a no-op, another one raises until
``clear_sharding``, after which the next ``mark_sharding`` re-lays the tensor out in place.
``gradient=True`` also marks the tensor's gradient, through a tensor hook, when a backward
computes it. This module does not record other ops or compile.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from partita import capture
from partita.errors import VirtualDeviceError
from partita.values.annotations import annotation_conflict
from partita.values.mesh import Mesh
from partita.values.spec import as_spec
from partita.values.tensor import ShardedTensor
from partita.virtual import step
from partita.virtual.lazy import LazyTensor, full_value
from partita.virtual.recording import record_annotation

__all__ = ["clear_in_place", "mark_in_place"]


def mark_in_place(t: LazyTensor, mesh: Mesh, spec: Any, *, gradient: bool = False) -> LazyTensor:
    """Shard ``t`` over ``mesh`` as ``spec`` says, in place; returns ``t``. ``gradient``: its
    gradient too, when a backward computes it.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> w = torch.ones(8, 4, device=partita.use_spmd(mesh))
        >>> partita.mark_sharding(w, mesh, P("data", None)) is w
        True
    """
    device_mesh = step.mesh()
    if mesh != device_mesh:
        raise VirtualDeviceError(
            f"mark_sharding of a {list(t.shape)} tensor on the virtual device over {mesh!r}, "
            f"but the device was switched on for {device_mesh!r}: one step runs on one mesh. "
            f"Use the mesh given to partita.use_spmd (or call use_spmd again first)."
        )
    sharding = as_spec(spec).to_sharding(mesh, t.ndim)
    sharding.check_shape(t.shape)
    if gradient:
        _mark_gradient_once(t, mesh, spec)
    cell = t._cell
    if cell.annotation is not None:
        if cell.annotation == sharding:
            return t
        raise annotation_conflict(
            t.shape, cell.annotation, sharding, mesh, "mark a copy (x.clone()) instead"
        )
    if cell.is_pending:
        record_annotation(t, capture.annotate, mesh, sharding.spec)
    else:
        data = cell.data
        if not (isinstance(data, ShardedTensor) and data.sharding == sharding):
            # (already in this layout, e.g. a batch moved from make_global: nothing moves)
            cell.data = ShardedTensor.from_global(full_value(t), sharding)
    cell.annotation = sharding
    return t


def _mark_gradient_once(t: LazyTensor, mesh: Mesh, spec: Any) -> None:
    """Hook ``t`` so that its gradient is marked when a backward computes it: once per tensor
    (a parameter marked again every step keeps one hook)."""
    if t.requires_grad and not getattr(t, "_partita_marks_gradient", False):
        t._partita_marks_gradient = True  # type: ignore[attr-defined]
        t.register_hook(partial(_mark_gradient, mesh=mesh, spec=spec))


def _mark_gradient(grad: torch.Tensor, *, mesh: Mesh, spec: Any) -> torch.Tensor:
    """A ``mark_sharding(..., gradient=True)`` tensor's hook: annotate its gradient in place,
    as the captured path's annotate node of the gradient does."""
    return mark_in_place(grad, mesh, spec) if isinstance(grad, LazyTensor) else grad


def clear_in_place(t: LazyTensor) -> LazyTensor:
    """Remove ``t``'s annotation in place and return ``t``: no data moves, and the next
    ``mark_sharding`` may choose any sharding of the device's mesh.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> w = torch.ones(8, 4, device=partita.use_spmd(mesh))
        >>> _ = partita.mark_sharding(w, mesh, P("data", None))
        >>> partita.clear_sharding(w).is_annotated
        False
    """
    t._cell.annotation = None
    return t
