"""The values of a per-device program under construction, and moving them between shardings.

:class:`LocalValues` is the part of a :class:`~partita.partition.lower.Lowering` that handlers
share: every value's local node and sharding (:class:`LocalValue`), ``call`` to emit a node,
and ``reshard``, which brings a value to a sharding through the planner
(``partition.reshard``), reusing any local copy made before (a value gathered for one consumer
is sliced locally for the next), records each collective in the Plan with its reason and
source line, and warns (or, under ``strict=True``, raises) on an involuntary full
rematerialization.

This module does not decide what sharding an op needs (``partition.lower`` does).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from partita.capture.fx_nodes import add_node
from partita.errors import RematerializationError, RematerializationWarning, warn
from partita.ir import node_meta
from partita.partition.plan import CollectiveRecord, Plan
from partita.partition.reshard import is_full_remat, plan_reshard
from partita.partition.reshard_emit import emit_reshard
from partita.report.explain import op_name
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["LocalValue", "LocalValues", "ValueKey", "naming_spec_knobs", "reshard_source"]

ValueKey = tuple[fx.Node, int | None]

_PERMUTE = torch.ops.aten.permute.default

#: The knobs of the entry point compiling now that set the specs, as its advice names them:
#: ``partita.jit``'s ``in_specs/out_specs``, ``train_step``'s ``param_specs/batch_spec``.
_SPEC_KNOBS: contextvars.ContextVar[str] = contextvars.ContextVar(
    "partita_spec_knobs", default="in_specs/out_specs"
)


@contextlib.contextmanager
def naming_spec_knobs(knobs: str) -> Iterator[None]:
    """Within: a reshard's advice names ``knobs`` as the specs to change."""
    token = _SPEC_KNOBS.set(knobs)
    try:
        yield
    finally:
        _SPEC_KNOBS.reset(token)


@dataclass(slots=True)
class LocalValue:
    """A value of the per-device program: its local node and what it holds."""

    node: fx.Node
    sharding: Sharding
    shape: tuple[int, ...]
    dtype: torch.dtype


class LocalValues:
    """The per-device graph being built, its values, and the Plan's collective records."""

    def __init__(self, mesh: Mesh, *, strict: bool = False) -> None:
        self.mesh = mesh
        self.strict = strict
        self.graph = fx.Graph()
        self.values: dict[ValueKey, LocalValue] = {}
        self.alias: dict[fx.Node, ValueKey] = {}
        # Every local copy of a value made so far, by sharding (reshards reuse them).
        self._copies: dict[ValueKey, dict[Sharding, fx.Node]] = {}
        self._pending_copies: dict[fx.Node, dict[Sharding, fx.Node]] = {}
        # Why a value is partial: (explanation, source line of the op that made it partial).
        self._partial_origin: dict[ValueKey, tuple[str, str | None]] = {}
        self.plan = Plan(mesh)

    def key(self, node: fx.Node) -> ValueKey:
        return self.alias.get(node, (node, None))

    def value(self, node: fx.Node) -> LocalValue:
        return self.values[self.key(node)]

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.emit(target, tuple(args), kwargs)

    def emit(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> fx.Node:
        """``self.graph.call_function(target, args, kwargs)`` without fx's walk of every
        argument for a raw SymInt (a pytree walk, 10-15% of partitioning GPT-M; the per-device
        program's arguments have none): the node is made bare, then given its arguments."""
        return add_node(self.graph, target, args, kwargs)

    def reshard(self, key: ValueKey, dst: Sharding, why: str, at: fx.Node) -> fx.Node:
        """The local node of value ``key`` under ``dst``, inserting collectives as needed."""
        v = self.values[key]
        if v.sharding == dst:
            return v.node
        copies = self._copies.setdefault(key, {})
        if dst in copies:
            return copies[dst]
        through = self._reshard_through_permute(key, dst, why, at)
        if through is not None:
            copies[dst] = through
            return through
        # Start from whichever copy of the value moves the fewest bytes to ``dst``: a value
        # already gathered for one consumer is sliced locally for the next.
        plans: dict[Sharding, list[Any]] = {}

        def moved(s: Sharding) -> int:
            plans[s] = plan_reshard(s, dst, v.shape)
            return _collective_bytes(plans[s])

        src = reshard_source(v.sharding, copies, moved)
        start, steps = (v.node if src == v.sharding else copies[src]), plans[src]
        source = node_meta.source(at)
        name = key[0].name if key[1] is None else f"{key[0].name}[{key[1]}]"
        if is_full_remat(steps):
            msg = (
                f"involuntary full rematerialization of %{name} {v.dtype}{list(v.shape)} "
                f"from {v.sharding} to {dst} for {op_name(at.target)} at "
                f"{source or 'an unknown source line'}: no collective moves the tiles directly, "
                f"so every device gathers the whole value and slices it."
            )
            fix = (
                f"Annotate the value where it is produced with "
                f"partita.mark_sharding(t, mesh, {dst.spec}) (or change the {_SPEC_KNOBS.get()} "
                f"that ask for {v.sharding.spec}) so that no reshard between the two is needed."
            )
            if self.strict:
                raise RematerializationError(f"{msg} {fix}")
            warn(f"{msg} {fix}", RematerializationWarning)
            self.plan.warnings.append(msg)
        out = emit_reshard(self.graph, start, steps, self.mesh)
        origin = self._partial_origin.get(key)
        for step in steps:
            if not step.is_collective:
                continue
            reason = f"{why}: {step.reason}" if step.reason else why
            step_source = source
            if origin is not None and step.kind in ("all_reduce", "reduce_scatter"):
                reason, step_source = f"{origin[0]}; then {reason}", origin[1]
            shape = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            self.plan.collectives.append(
                CollectiveRecord(
                    kind=step.kind,
                    mesh_axes=tuple(step.mesh_axes),
                    groups=self.mesh.device_groups(step.mesh_axes),
                    shape=tuple(shape),
                    dtype=v.dtype,
                    value=name,
                    reason=reason,
                    source=step_source,
                    detail=_detail(step),
                )
            )
        copies[dst] = out
        return out

    def note_copy(self, node: fx.Node, sharding: Sharding, local: fx.Node) -> None:
        """A handler tells that ``local`` holds the result of ``node`` under ``sharding`` too
        (for example the gathered value it sliced its result from)."""
        self._pending_copies.setdefault(node, {})[sharding] = local

    def _reshard_through_permute(
        self, key: ValueKey, dst: Sharding, why: str, at: fx.Node
    ) -> fx.Node | None:
        """Reshard ``permute(u)`` by resharding ``u`` and permuting locally.

        The same data moves either way, but a weight used transposed in the forward and as is
        in the backward is then gathered once, not twice (the reshard of ``u`` is cached).
        """
        node, idx = key
        if idx is not None or node.op != "call_function" or node.target != _PERMUTE:
            return None
        args: tuple[Any, ...] = node.args  # permute(u, dims)
        src_key = self.key(args[0])
        u = self.values.get(src_key)
        if u is None or u.sharding.partial or dst.partial or self.values[key].sharding.partial:
            return None
        perm = [int(p) % len(u.shape) for p in args[1]]
        dims: list[tuple[str, ...]] = [()] * len(perm)
        for i, p in enumerate(perm):
            dims[p] = dst.dim_axes[i]
        local = self.reshard(src_key, Sharding(self.mesh, tuple(dims)), why, at)
        return self.graph.call_function(_PERMUTE, (local, perm))


def reshard_source(
    has: Sharding, copies: Iterable[Sharding], moved: Callable[[Sharding], int]
) -> Sharding:
    """The sharding a reshard of a value starts from (``LocalValues.reshard``): of the value's
    own sharding ``has`` and those of its copies made so far (``copies``, in the order they
    were made), the one from which the reshard moves the fewest elements (``moved(s)``: its
    collectives' local elements, input elements for a reduce_scatter, output ones otherwise).
    A partial copy is never a start (the value's own sharding may be partial); a tie goes to
    the earlier, the value's own first. Pure: the auto-sharding model prices a plan's reshards
    by the same rule (``auto.realize``)."""
    return min((s for s in [has, *copies] if not s.partial or s == has), key=moved)


def _detail(step: Any) -> str:
    parts = [str(a) for a in step.args if not isinstance(a, (list, tuple))]
    return ", ".join(parts)


def _collective_bytes(steps: list[Any]) -> int:
    """Per-device bytes a step list moves, in element counts (dtype is the same for all)."""
    total = 0
    for step in steps:
        if step.is_collective:
            shape = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            n = 1
            for d in shape:
                n *= d
            total += n
    return total
