"""What partita's stages record on the nodes of a program: one typed accessor per fact.

A node's ``meta`` dict is shared with torch (``val``, ``stack_trace``, ``tensor_meta`` are
torch's own and are read directly). Everything partita adds goes through the functions here,
which name each fact once and give it a type; no other module spells one of these keys:

=====================  ==========================  =============================================
fact                   written by                  read by
=====================  ==========================  =============================================
source                 capture                     messages, the Plan, the runtime's errors
annotation             capture                     propagation, partitioning, explain
sharding               propagation                 partitioning, explain, the API
factor_axes, rule      propagation                 partitioning
replicated_reason      propagation (apply_rule)    the Plan's reasons
origin                 partitioning                the runtime's errors
local_shape            the reshard emitter         (inspection)
collective_bytes       bucketing                   the overlap scheduler
regather(_after)       re-gathering, bucketing     bucketing, the overlap scheduler
bucket_members         bucketing                   (inspection)
range_name             partitioning (ranges)       the runtimes' profiler ranges
lifted_from            capture (constant lifting)  (inspection)
=====================  ==========================  =============================================

Why functions over the plain dict rather than one record object per node: torch.fx copies
``meta`` shallowly (``node_copy``, ``dict(node.meta)``) and partita copies nodes between graphs
in capture, partitioning and the disk cache; separate immutable entries stay correct under
those copies, where one mutable record would be shared by the copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.fx as fx

from partita.errors import InternalError

if TYPE_CHECKING:
    from partita.rules.factor import FactorRule
    from partita.values.spec import Sharding

__all__ = [
    "AnnotationRecord",
    "annotation",
    "annotation_of",
    "body_layout",
    "bucket_members",
    "collective_bytes",
    "factor_axes",
    "has_source",
    "lifted_from",
    "local_shape",
    "origin",
    "range_name",
    "regather_after",
    "regather_of",
    "replicated_reason",
    "rule",
    "set_annotation",
    "set_body_layout",
    "set_bucket_members",
    "set_collective_bytes",
    "set_factor_axes",
    "set_lifted_from",
    "set_local_shape",
    "set_origin_once",
    "set_range_name",
    "set_regather",
    "set_regather_after",
    "set_replicated_reason",
    "set_rule",
    "set_sharding",
    "set_source",
    "set_source_once",
    "sharding",
    "single_sharding",
    "source",
    "value_sharding",
]


class AnnotationRecord(Protocol):
    """What the stages read of a user annotation (``capture.annotate.Annotation``)."""

    @property
    def sharding(self) -> Sharding: ...

    @property
    def source(self) -> str | None: ...

    @property
    def priority(self) -> int: ...


# --- capture ---------------------------------------------------------------------------------


def source(node: fx.Node) -> str | None:
    """The user's source line of the op (``"file.py:LINE in func"``), if recorded."""
    return node.meta.get("source")


def has_source(node: fx.Node) -> bool:
    """Whether a source was recorded (possibly as None: looked up, not found)."""
    return "source" in node.meta


def set_source(node: fx.Node, where: str | None) -> None:
    node.meta["source"] = where


def set_source_once(node: fx.Node, where: str | None) -> None:
    """Record the source unless one is already recorded."""
    node.meta.setdefault("source", where)


def annotation(node: fx.Node) -> AnnotationRecord | None:
    """The user's annotation if ``node`` is an annotation node."""
    return node.meta.get("annotation")


def annotation_of(node: fx.Node) -> AnnotationRecord:
    """The annotation of a node known to be an annotation node."""
    ann = node.meta.get("annotation")
    if ann is None:
        raise InternalError(
            f"node {node.name!r} ({node.target}) is handled as an annotation but carries none. "
            f"{InternalError.REPORT}"
        )
    return ann


def set_annotation(node: fx.Node, ann: AnnotationRecord) -> None:
    node.meta["annotation"] = ann


def lifted_from(node: fx.Node) -> str | None:
    """For a placeholder lifted from a constant: the constant's attribute name."""
    return node.meta.get("lifted_from")


def set_lifted_from(node: fx.Node, target: str) -> None:
    node.meta["lifted_from"] = target


# --- propagation -----------------------------------------------------------------------------


def sharding(node: fx.Node) -> Sharding | tuple[Sharding | None, ...] | None:
    """The sharding propagation chose (a ``Sharding``, or a tuple of ``Sharding | None`` for a
    multi-output op), or None before propagation."""
    return node.meta.get("sharding")


def single_sharding(node: fx.Node) -> Sharding | None:
    """The sharding propagation chose for the one value of a single-output ``node``, or None
    when it chose none."""
    value = node.meta.get("sharding")
    if isinstance(value, tuple):
        raise InternalError(
            f"node {node.name!r} ({node.target}) is handled as one value but propagation gave "
            f"it one sharding per output: {value}. {InternalError.REPORT}"
        )
    return value


def value_sharding(node: fx.Node) -> Sharding:
    """The sharding propagation chose for the one value of a single-output ``node``, which
    must have one (a tensor placeholder, a region boundary)."""
    value = single_sharding(node)
    if value is None:
        raise InternalError(
            f"node {node.name!r} ({node.target}) has no sharding after propagation. "
            f"{InternalError.REPORT}"
        )
    return value


def set_sharding(node: fx.Node, value: Sharding | tuple[Sharding | None, ...]) -> None:
    node.meta["sharding"] = value


def factor_axes(node: fx.Node) -> dict[str, tuple[str, ...]]:
    """The op's chosen ``{factor: mesh axes}`` (empty when none was chosen)."""
    return node.meta.get("factor_axes", {})


def set_factor_axes(node: fx.Node, assign: dict[str, tuple[str, ...]]) -> None:
    node.meta["factor_axes"] = assign


def rule(node: fx.Node) -> FactorRule | None:
    """The op's FactorRule, as propagation applied it."""
    return node.meta.get("rule")


def set_rule(node: fx.Node, value: FactorRule) -> None:
    node.meta["rule"] = value


def replicated_reason(node: fx.Node) -> str | None:
    """Why the op runs replicated under ``replicate_unsupported=True``, if it does."""
    return node.meta.get("replicated_reason")


def set_replicated_reason(node: fx.Node, reason: str) -> None:
    node.meta["replicated_reason"] = reason


# --- partitioning ----------------------------------------------------------------------------


def origin(node: fx.Node) -> str | None:
    """For a per-device node: the op (``"aten.mm (%mm)"``) it was emitted for."""
    return node.meta.get("origin")


def set_origin_once(node: fx.Node, where: str) -> None:
    """Record the origin unless one is already recorded."""
    node.meta.setdefault("origin", where)


def local_shape(node: fx.Node) -> tuple[int, ...] | None:
    """For a reshard step's node: its local shape."""
    return node.meta.get("local_shape")


def set_local_shape(node: fx.Node, shape: tuple[int, ...]) -> None:
    node.meta["local_shape"] = shape


def collective_bytes(node: fx.Node) -> int:
    """A collective's per-device bytes (0 when not recorded)."""
    return node.meta.get("bytes", 0)


def set_collective_bytes(node: fx.Node, nbytes: int) -> None:
    node.meta["bytes"] = nbytes


def regather_of(node: fx.Node) -> str | None:
    """For a re-gather: the name of the gather it repeats (None for any other node)."""
    return node.meta.get("regather")


def regather_after(node: fx.Node) -> str | None:
    """For a re-gather: the last node before the gap it waits for."""
    return node.meta.get("regather_after")


def set_regather(node: fx.Node, of: str) -> None:
    node.meta["regather"] = of


def set_regather_after(node: fx.Node, after: str) -> None:
    node.meta["regather_after"] = after


def bucket_members(node: fx.Node) -> list[str] | None:
    """For a fused collective: the names of the collectives it fuses."""
    return node.meta.get("bucket_members")


def set_bucket_members(node: fx.Node, names: list[str]) -> None:
    node.meta["bucket_members"] = names


def range_name(node: fx.Node) -> str | None:
    """For a collective of a per-device program: its profiler range name
    (``partition.ranges``), None when not named."""
    return node.meta.get("range_name")


def set_range_name(node: fx.Node, name: str) -> None:
    node.meta["range_name"] = name


# --- control flow (propagate/bodies.py -> partition/control_flow.py) --------------------------


def body_layout(node: fx.Node) -> Any:
    """A control-flow op's ``BodyLayout``: its bodies' input and output shardings."""
    return node.meta.get("partita_body_layout")


def set_body_layout(node: fx.Node, layout: Any) -> None:
    node.meta["partita_body_layout"] = layout
