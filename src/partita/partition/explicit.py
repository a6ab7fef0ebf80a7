"""Explicit mode: collectives the annotations do not imply are errors (or warnings).

``partita.jit(..., options={"collectives": "explicit"})`` partitions as usual and then reads
the Plan: a collective is *implied* when the annotations call for it directly, and *implicit*
otherwise.

Implied:
- ``all_reduce`` / ``reduce_scatter``: the reduction of a partial value, i.e. a contraction or
  reduction over a dim the annotations shard (the sum cannot be avoided, only placed);
- a halo exchange (a ``collective_permute`` whose reason says so) of a spatially sharded window;
- every collective written by hand in a ``shard_map`` body.

Implicit: everything else, which moves data between two shardings: a reshard between two
differently annotated values, an operand gathered (``all_gather``) or re-split
(``all_to_all``, ``collective_permute``) to fit an op. Under ``"explicit"`` they raise one
:class:`~partita.errors.ExplicitCollectiveError` listing each (op, source line, collective,
bytes, the annotation that avoids it); under ``"warn"`` an
:class:`~partita.errors.ImplicitCollectiveWarning` says the same. ``"auto"`` (the default) allows
all. The mode is the ``collectives`` field of :class:`~partita.options.CompileOptions`, which
``partition()`` passes to the lowering and the lowering to :func:`check`. This module does not
change any lowering.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.errors import ExplicitCollectiveError, ImplicitCollectiveWarning, warn
from partita.partition.manual import USER_COLLECTIVE
from partita.partition.plan import CollectiveRecord, Plan
from partita.values.spec import Sharding

__all__ = ["MODES", "Move", "check"]

#: The values of the ``collectives`` option.
MODES = ("auto", "warn", "explicit")


@dataclass(frozen=True, slots=True)
class Move:
    """A reshard that produced some of the Plan's collectives: value ``value`` moved from
    ``src`` to ``dst``."""

    value: str
    src: Sharding
    dst: Sharding


def is_implied(record: CollectiveRecord) -> bool:
    """Whether the annotations imply ``record`` directly (see the module doc)."""
    if record.reason.startswith(USER_COLLECTIVE):
        return True
    if record.kind in ("all_reduce", "reduce_scatter"):
        return True
    return record.kind == "collective_permute" and "halo exchange" in record.reason


def _fix(record: CollectiveRecord, move: Move | None) -> str:
    if move is None:
        return (
            "the op needs this operand laid out differently along the dim it cannot split; "
            "shard another dim of it, or mark it replicated where it is produced"
        )
    return (
        f"annotate %{move.value} where it is produced with partita.mark_sharding(t, mesh, "
        f"{move.dst.spec}), or change the annotation that gives it {move.src.spec}"
    )


def _line(i: int, record: CollectiveRecord, move: Move | None) -> str:
    return (
        f"  [{i}] {record.kind} over {list(record.mesh_axes)} of %{record.value} "
        f"{str(record.dtype).removeprefix('torch.')}{list(record.shape)} = {record.bytes} "
        f"B/device at {record.source or 'an unknown line'}\n"
        f"      why: {record.reason}\n"
        f"      fix: {_fix(record, move)}"
    )


def check(plan: Plan, moves: dict[int, Move], mode: str) -> None:
    """Raise or warn (per ``mode``, one of :data:`MODES`) about the Plan's implicit
    collectives; ``moves`` maps a collective's index in ``plan.collectives`` to the reshard
    that made it."""
    if mode == "auto":
        return
    found = [(i, r, moves.get(i)) for i, r in enumerate(plan.collectives) if not is_implied(r)]
    if not found:
        return
    total = sum(r.bytes for _, r, _ in found)
    msg = (
        f"collectives={mode!r}: the partitioner would insert {len(found)} collective(s) that "
        f"the annotations do not imply ({total} B per device per run), on {plan.mesh!r}:\n"
        + "\n".join(_line(i, r, m) for i, r, m in found)
        + "\nEach moves a value between two shardings. Annotate as each fix says so that no "
        "move is needed, write the communication yourself in a partita.shard_map region, or "
        "use the option collectives='auto' to let partita insert them."
    )
    if mode == "explicit":
        raise ExplicitCollectiveError(msg)
    warn(msg, ImplicitCollectiveWarning)
