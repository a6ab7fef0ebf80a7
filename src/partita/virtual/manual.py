"""``partita.shard_map`` called on virtual-device tensors: the region is recorded like any code.

On the virtual device a region needs no machinery of its own. ``shard_map`` runs the same code
as inside ``partita.jit`` (:func:`partita.manual.shard_map._traced`): the region's boundaries
(``partita::manual_enter`` / ``manual_exit``), its body on local-shaped lazy tensors, its
collectives and the identities the varying-axes tracking inserts are all ops, so they are
recorded one by one, and so are their gradients when ``loss.backward()`` runs (each boundary
and collective carries its transpose). ``partita.sync()`` replays the recording under
``capture.trace``, which rebuilds the graph ``jit`` would have traced: propagation and the
partitioner then treat the region exactly as in ``jit`` (copied verbatim when fully manual,
the auto axes propagated through it when partially manual). The user's mistakes are found when
the region is called, as in ``jit``.

This module supplies what differs: the arguments' device and mesh (:func:`on_device`), in_specs
taken from the arguments' data where they are left out (:func:`in_specs_from_data`), and how the
in_specs and out_specs of a fully manual region are attached to the program
(:func:`annotate_pending`). It does not compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.capture.annotate import record
from partita.capture.source import format_source, user_frame
from partita.capture.trace import broadcast_specs
from partita.errors import ShardMapError, VirtualDeviceError
from partita.values.mesh import Mesh
from partita.values.spec import P, as_spec
from partita.values.tensor import ShardedTensor
from partita.virtual import step
from partita.virtual.lazy import LazyTensor, new_data
from partita.virtual.recording import record_annotation
from partita.virtual.state import DEVICE_NAME

__all__ = ["annotate_pending", "in_specs_from_data", "on_device"]


@dataclass(frozen=True)
class _Annotate:
    """``capture.record`` with the region's source text, as a recorded op. Frozen and compared
    by value, so the same region recorded in every step keeps the step's structural key (and
    its plain repr keeps the step in the persistent cache)."""

    source: str

    def __call__(self, t: torch.Tensor, mesh: Mesh, spec: Any) -> torch.Tensor:
        return record(t, mesh, spec, source=self.source)


def annotate_pending(t: torch.Tensor, mesh: Mesh, spec: Any, *, source: str) -> torch.Tensor:
    """Attach ``spec`` to the global side of a fully manual region's boundary; returns ``t``.

    A value computed in this step (the body's result leaving the region, an activation entering
    it) is annotated in place, as ``mark_sharding`` does on a pending value: the program's later
    uses of it see the annotated value. For an output that is what ``jit`` does; for an input it
    goes a little further (in ``jit`` only the region reads the annotated copy), so it pins the
    in_spec on the value where ``jit`` would let propagation choose. Data
    (a parameter, a batch moved to the device, even one updated in place since the last sync)
    and views are left alone: data is an input of the step with its own layout, the region's
    entry reshards it to the in_spec anyway, and an annotation in place would redirect a later
    in-place update (the optimizer's) from the input to the annotated copy, losing it.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> x = torch.ones(8, 4, device=partita.use_spmd(mesh)) * 2   # pending
        >>> annotate_pending(x, mesh, P("data"), source="in_specs") is x
        True
    """
    as_spec(spec).to_sharding(mesh, t.ndim)  # the spec is checked either way
    if isinstance(t, LazyTensor) and not t._cell.has_value and t._cell.base is t._cell:
        record_annotation(t, _Annotate(source), mesh, spec)
    return t


def on_device(name: str, mesh: Mesh, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The region's arguments, all on the virtual device: a CPU tensor is uploaded (replicated
    data, as when it meets a device tensor in any op) and a ShardedTensor becomes device data
    with its layout. A region's entry is an op with one tensor argument, so a CPU tensor left
    there would run it on the CPU instead of being recorded. Raises unless ``mesh`` is the
    device's mesh (one step runs on one mesh).

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> dev = partita.use_spmd(mesh)
        >>> args = (torch.ones(2), torch.ones(2, device=dev))
        >>> [a.device.type for a in on_device("f", mesh, args)]
        ['spmd', 'spmd']
    """
    device_mesh = step.mesh()
    if mesh != device_mesh:
        raise VirtualDeviceError(
            f"{name} is called on virtual-device tensors with mesh={mesh!r}, but the device "
            f"was switched on for {device_mesh!r}: one step runs on one mesh. Build the region "
            f"with the mesh given to partita.use_spmd (or call use_spmd with this mesh first)."
        )
    device = torch.device(DEVICE_NAME, 0)

    def move(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            return new_data(x)
        if isinstance(x, torch.Tensor) and x.device.type != DEVICE_NAME:
            return x.to(device)
        return x

    return pytree.tree_map(move, args)


def in_specs_from_data(name: str, in_specs: Any, args: tuple[Any, ...]) -> Any:
    """``in_specs`` with each one left out (None) taken from its argument's data: a sharded
    tensor's spec, ``P()`` for replicated data; as ``shard_map`` does on ShardedTensors.

    A value computed in this step has no layout until the step compiles: leaving its in_spec
    out is a :class:`ShardMapError`.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> w = torch.ones(8, 4, device=partita.use_spmd(mesh))
        >>> in_specs_from_data("f", None, (partita.mark_sharding(w, mesh, P("data")),))
        (P('data', None),)
    """
    leaves, tree = pytree.tree_flatten(args)
    given = (
        broadcast_specs(in_specs, args, "in_specs", name)
        if in_specs is not None
        else [None] * len(leaves)
    )
    specs = []
    for i, (leaf, spec) in enumerate(zip(leaves, given, strict=True)):
        if spec is None and isinstance(leaf, LazyTensor):
            if leaf._cell.is_pending:
                where = format_source(user_frame()) or "an unknown line"
                raise ShardMapError(
                    f"{name} at {where}: input {i} (shape {tuple(leaf.shape)}) has no in_spec, "
                    f"and it is computed in this step, so its layout is not known until the "
                    f"step compiles. Give in_specs=P(...) for it (P() for replicated)."
                )
            data = leaf._cell.data
            spec = data.sharding.with_partial(()).spec if isinstance(data, ShardedTensor) else P()
        specs.append(spec)
    return pytree.tree_unflatten(specs, tree)
