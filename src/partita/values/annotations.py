"""The annotation rules ``mark_sharding`` shares between ShardedTensors and the virtual
device's tensors, and the shardings it gave module weights off the device.

:func:`annotation_conflict` is the one error of marking an annotated tensor with another
sharding (``partita.values.tensor`` and ``partita.virtual.marking`` raise it). The weights a user
marked (``partita.mark_sharding(model.fc.weight, mesh, spec)`` on a module off the device) keep
their sharding in an attribute; ``partita.jit(model)`` and
``partita.train_step`` read them with :func:`marked_param_specs`. This module holds no data.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from partita.errors import AnnotationError, ShardingError
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, Sharding

__all__ = [
    "annotation_conflict",
    "clear_parameter",
    "mark_parameter",
    "marked_param_specs",
    "marks_made",
]


def annotation_conflict(
    shape: Sequence[int],
    current: Sharding,
    asked: Sharding,
    mesh: Mesh,
    other: str = "use partita.reshard(x, spec) for a new tensor",
) -> AnnotationError:
    """The error of ``mark_sharding`` with another sharding on an annotated tensor (the same
    for a ShardedTensor and a virtual-device tensor)."""
    return AnnotationError(
        f"Existing annotation must be cleared first: the tensor of shape {tuple(shape)} is "
        f"annotated with {current} on {current.mesh!r}, and mark_sharding was asked for {asked} "
        f"on {mesh!r}. Call partita.clear_sharding(x) and then mark_sharding(x, mesh, spec) to "
        f"re-annotate it in place, or {other}."
    )


#: The attribute holding the sharding ``mark_sharding`` gave a parameter of a module off the
#: virtual device (on the Parameter itself: a weak reference would stop ``module.to(dev)``
#: from swapping the parameter's tensor, and ``torch.utils.swap_tensors`` moves attributes
#: with the old tensor, so the mark stays off the device). ``partita.jit(model)`` and
#: ``partita.train_step`` shard those parameters so (:func:`marked_param_specs`).
_MARK = "_partita_mark"
_MARKS_MADE = [0]


def mark_parameter(param: nn.Parameter, sharding: Sharding) -> None:
    """Remember ``sharding`` for ``param`` (``partita.mark_sharding`` on a module's weight);
    another sharding than the one remembered raises, as for an annotated tensor."""
    current = getattr(param, _MARK, None)
    if current is not None and current != sharding:
        raise annotation_conflict(
            param.shape, current, sharding, sharding.mesh, "pass param_specs to partita.jit"
        )
    setattr(param, _MARK, sharding)
    _MARKS_MADE[0] += 1


def clear_parameter(param: nn.Parameter) -> bool:
    """Forget ``param``'s mark (``partita.clear_sharding``); False when it had none."""
    if getattr(param, _MARK, None) is None:
        return False
    delattr(param, _MARK)
    _MARKS_MADE[0] += 1
    return True


def marks_made() -> int:
    """How many times a mark was made or cleared (jit's memo of in_specs changes with it)."""
    return _MARKS_MADE[0]


def marked_param_specs(model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
    """``{parameter name: spec}`` of ``model``'s parameters marked with ``mark_sharding``.

    Raises ShardingError for a parameter marked over another mesh than ``mesh``.

    Example:
        >>> mesh = Mesh.create((2,), ("data",))
        >>> model = nn.Linear(4, 2)
        >>> _ = partita.mark_sharding(model.weight, mesh, P("data", None))
        >>> marked_param_specs(model, mesh)
        {'weight': P('data', None)}
    """
    out = {}
    for name, p in model.named_parameters():
        sharding = getattr(p, _MARK, None)
        if sharding is None:
            continue
        if sharding.mesh != mesh:
            raise ShardingError(
                f"parameter {name!r} of shape {tuple(p.shape)} was marked with "
                f"mark_sharding(..., {sharding.mesh!r}, {sharding.spec}), but the module is "
                f"compiled for {mesh!r}. Mark it over the mesh the step runs on."
            )
        out[name] = sharding.spec
    return out
