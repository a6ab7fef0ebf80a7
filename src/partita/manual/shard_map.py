"""``partita.shard_map``: run a function on each device's local blocks, inside or outside jit.

Inside a traced program (``partita.jit``, ``train_step``) a call puts a *manual region* in the
graph: each input is annotated with its in_spec and enters the region as its local block
(``partita.capture.manual``), the body is traced on local shapes with its collectives
(:mod:`partita.manual.collectives`), and each output leaves as the global value its out_spec
describes. Propagation treats the region as fixed and the partitioner copies it verbatim onto
every device. Called on virtual-device tensors (``partita.use_spmd``), the same code runs on lazy
tensors: the region's ops are recorded like any others and the step's sync compiles them through
the same path (``partita.virtual.manual``). Called on ShardedTensors (or plain tensors) outside a
trace, shard_map compiles itself with ``partita.jit`` and runs on the simulated mesh.

Mistakes are errors, never a silent collective: a missing in_spec or out_spec, a spec that does
not divide a shape, a spec over a mesh axis the region is not manual over, and an out_spec that
calls an output replicated over an axis it varies over (:mod:`partita.manual.vma`).

``axes=`` makes the region manual over some mesh axes only (*partially manual*): specs and
collectives may then name only those axes, and the other (auto) axes keep propagating through
the body as through any code (``partita.rules.manual``), so the body's blocks may be split
further along them. Its inputs and outputs are then not annotated on the auto axes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx.traceback as fx_traceback
from torch import Tensor
from torch.utils import _pytree as pytree

from partita.capture.annotate import is_tracing, record
from partita.capture.manual import REGION_TAG, Boundary, enter, exit_region, new_boundary
from partita.capture.source import format_source, user_frame
from partita.capture.trace import broadcast_specs
from partita.errors import ReplicationError, ShardMapError
from partita.manual.vma import current_region, region_scope, set_vma, vma
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, Sharding

__all__ = ["shard_map"]

#: How a region annotates a global value with its spec: ``(t, mesh, spec, source=) -> t``.
Annotate = Callable[..., Tensor]


def shard_map(
    fn: Callable[..., Any],
    *,
    mesh: Mesh,
    in_specs: Any = None,
    out_specs: Any,
    axes: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Wrap ``fn`` to run per device on local blocks.

    Args:
        fn: per-device code over local blocks; may call partita.psum and the other collectives
            over the manual axes.
        mesh: the mesh.
        in_specs: a prefix of the args pytree of ``P`` leaves; a None leaf takes the
            ShardedTensor's own sharding (outside jit). Only manual axes may appear.
        out_specs: a prefix of the result pytree of ``P`` leaves, required.
        axes: the mesh axes the region is manual over (default: all).

    Example:
        >>> def body(x, w):                        # doctest: +SKIP
        ...     return partita.psum(x @ w, "model")
        >>> f = partita.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model")),
        ...                       out_specs=P())   # doctest: +SKIP
    """
    manual = tuple(mesh.axis_names) if axes is None else tuple(mesh.axis_name(a) for a in axes)
    name = f"shard_map({getattr(fn, '__name__', repr(fn))})"
    eager_cache: dict[Any, Any] = {}

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        if is_tracing():
            return _traced(fn, name, mesh, manual, in_specs, out_specs, args)
        if any(_on_virtual_device(a) for a in pytree.tree_leaves(args)):
            from partita.virtual import manual as virtual

            args = virtual.on_device(name, mesh, args)
            specs = virtual.in_specs_from_data(name, in_specs, args)
            return _traced(fn, name, mesh, manual, specs, out_specs, args, virtual.annotate_pending)
        return _eager(traced, name, mesh, in_specs, args, eager_cache)

    def traced(specs: Any, *args: Any) -> Any:
        return _traced(fn, name, mesh, manual, specs, out_specs, args)

    return wrapped


def _on_virtual_device(x: Any) -> bool:
    # The virtual device's tensors record every op, the region's too (partita.virtual.manual).
    return isinstance(x, Tensor) and x.device.type == "spmd"


def _eager(
    traced: Callable[..., Any],
    name: str,
    mesh: Mesh,
    in_specs: Any,
    args: tuple[Any, ...],
    cache: dict[Any, Any],
) -> Any:
    """Compile the region with jit, taking missing in_specs from the ShardedTensors given."""
    from partita.frontend.jit import jit
    from partita.values.tensor import ShardedTensor

    leaves, tree = pytree.tree_flatten(args)
    given = broadcast_specs(in_specs, args, "in_specs", name) if in_specs is not None else None
    specs = []
    for i, leaf in enumerate(leaves):
        spec = given[i] if given is not None else None
        if spec is None and isinstance(leaf, ShardedTensor):
            spec = leaf.sharding.with_partial(()).spec
        specs.append(spec)
    spec_tree = pytree.tree_unflatten(specs, tree)
    key = repr(spec_tree)
    if key not in cache:
        cache[key] = jit(functools.partial(traced, spec_tree), mesh=mesh, in_specs=spec_tree)
    return cache[key](*args)


def _divides(
    what: str, name: str, shape: tuple[int, ...], sharding: Sharding, spec: PartitionSpec
) -> None:
    for d, (n, k) in enumerate(zip(shape, sharding.tile_shape, strict=True)):
        if n % k:
            raise ShardMapError(
                f"{name}: {what} of shape {shape} cannot be split by {spec} on "
                f"{sharding.mesh!r}: dim {d} has size {n}, which {k} devices do not divide. A "
                f"shard_map body sees equal blocks on every device; pad the value to a multiple "
                f"of {k} or shard another dim."
            )


def _check_axes(
    what: str, name: str, spec: PartitionSpec, manual: tuple[str, ...], mesh: Mesh
) -> None:
    bad = [mesh.axis_name(a) for a in spec.mesh_axes if mesh.axis_name(a) not in manual]
    if bad:
        raise ShardMapError(
            f"{name}: {what} has spec {spec}, which uses mesh axes {bad} that the region is "
            f"not manual over (manual: {manual} of {mesh!r}). Add them to axes=, or drop them "
            f"from the spec and leave that split to propagation outside the region."
        )


def _traced(
    fn: Callable[..., Any],
    name: str,
    mesh: Mesh,
    manual: tuple[str, ...],
    in_specs: Any,
    out_specs: Any,
    args: tuple[Any, ...],
    annotate: Annotate = record,
) -> Any:
    """Put the region in the program being traced (or recorded, on the virtual device):
    check the specs, enter each input, run the body on local blocks, check and exit each output;
    ``annotate`` attaches the in_specs/out_specs of a fully manual region to the global side."""
    where = format_source(user_frame()) or "an unknown line"
    name = f"{name} at {where}"
    outer = current_region()
    if outer is not None:
        raise ShardMapError(
            f"{name} is called inside the body of {outer.name}: shard_map regions do not nest. "
            f"Write the inner code directly in the outer body (it already runs per device), "
            f"or make the outer region manual over fewer axes with axes=."
        )
    leaves, tree = pytree.tree_flatten(args)
    specs = (
        broadcast_specs(in_specs, args, "in_specs", name)
        if in_specs is not None
        else [None] * len(leaves)
    )
    entered: list[tuple[Tensor, frozenset[str]]] = []
    inputs: list[Any] = []
    for i, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
        if not isinstance(leaf, Tensor):
            inputs.append(leaf)
            continue
        what = f"input {i}"
        if spec is None:
            raise ShardMapError(
                f"{name}: {what} (shape {tuple(leaf.shape)}) has no in_spec. Inside jit the "
                f"region cannot see how a value is sharded; give in_specs=P(...) for it (P() "
                f"for replicated)."
            )
        _check_axes(what, name, spec, manual, mesh)
        sharding = spec.to_sharding(mesh, leaf.ndim)
        shape = tuple(leaf.shape)
        _divides(what, name, shape, sharding, spec)
        local = tuple(n // k for n, k in zip(shape, sharding.tile_shape, strict=True))
        grad_key = new_boundary(Boundary(sharding, shape, local, manual, what=f"grad of {what}"))
        key = new_boundary(Boundary(sharding, shape, local, manual, what=what, transpose=grad_key))
        if set(manual) >= set(mesh.axis_names):  # partially manual: the auto axes stay free
            leaf = annotate(leaf, mesh, spec, source=f"{name} in_specs for {what}")
        block = enter(leaf, key)
        inputs.append(block)
        entered.append((block, frozenset(sharding.sharded_axes)))
    anchor = entered[0][0] if entered else None
    with region_scope(mesh, manual, name, anchor):
        for block, axes in entered:
            set_vma(block, axes)
        with fx_traceback.annotate({REGION_TAG: list(manual)}):
            result = fn(*pytree.tree_unflatten(inputs, tree))
        out_leaves, out_tree = pytree.tree_flatten(result)
        varying = [vma(o) if isinstance(o, Tensor) else frozenset() for o in out_leaves]
    if out_specs is None:
        raise ShardMapError(
            f"{name}: out_specs is missing. Say how each output is laid out: P() for a value "
            f"every device holds whole, P('x') for blocks along mesh axis 'x'. partita does not "
            f"guess (a guess would be a silent gather)."
        )
    outs = broadcast_specs(out_specs, result, "out_specs", name)
    final = []
    for j, (leaf, spec, var) in enumerate(zip(out_leaves, outs, varying, strict=True)):
        if not isinstance(leaf, Tensor):
            raise ShardMapError(f"{name}: output {j} is a {type(leaf).__name__}, not a tensor.")
        final.append(_exit(name, j, leaf, spec, var, mesh, manual, annotate))
    return pytree.tree_unflatten(final, out_tree)


def _exit(
    name: str,
    j: int,
    leaf: Tensor,
    spec: PartitionSpec | None,
    var: frozenset[str],
    mesh: Mesh,
    manual: tuple[str, ...],
    annotate: Annotate,
) -> Tensor:
    what = f"output {j}"
    if spec is None:
        raise ShardMapError(
            f"{name}: {what} (local shape {tuple(leaf.shape)}) has no out_spec, and it varies "
            f"over {sorted(var) or 'no mesh axis'}. Give one, e.g. "
            f"P({', '.join(repr(a) for a in sorted(var)) or ''}) along the dim those blocks "
            f"concatenate on."
        )
    _check_axes(what, name, spec, manual, mesh)
    sharding = spec.to_sharding(mesh, leaf.ndim)
    missing = sorted(var - set(sharding.sharded_axes))
    if missing:
        raise ReplicationError(
            f"{name}: out_specs says {what} (local shape {tuple(leaf.shape)}) is {spec}, i.e. "
            f"replicated over {missing}, but it varies over {missing}: the devices along "
            f"{missing} hold different values. Reduce it first (partita.psum(y, "
            f"{missing[0]!r})) or name the axis in the spec (e.g. P({missing[0]!r}))."
        )
    local = tuple(leaf.shape)
    shape = tuple(n * k for n, k in zip(local, sharding.tile_shape, strict=True))
    declared = set(sharding.sharded_axes) & set(manual)
    psum_axes = tuple(a for a in manual if a in declared and a not in var)
    grad_key = new_boundary(Boundary(sharding, shape, local, manual, what=f"grad of {what}"))
    key = new_boundary(
        Boundary(sharding, shape, local, manual, psum_axes, what=what, transpose=grad_key)
    )
    out = exit_region(leaf, key)
    if set(manual) < set(mesh.axis_names):  # partially manual: the auto axes stay free
        return out
    return annotate(out, mesh, spec, source=f"{name} out_specs for {what}")
