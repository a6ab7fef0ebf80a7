"""The recording: the ops of the current step, in order, with their inputs and lifted floats.

:mod:`partita.virtual.dispatch` appends every recorded op to the current :class:`Recording` as
``(op, argument template, output slots)``, where a template refers to
earlier values by slot, to lifted Python floats by index, and holds every other argument as a
constant. Tensors enter a recording as *inputs*: a data cell of the virtual device, or a CPU
tensor used by an op (copied when recorded, so a later in-place change, such as a scheduler
updating a tensor learning rate, does not reach this step).

An op's results come from shape inference on meta tensors (:mod:`partita.virtual.shapes`), or,
on the fast path, from the :class:`Guide`: the step that last followed the same program, which
this one is checked against op by op. The structural key of a recording
(:meth:`Recording.key`) holds ops, constants, shapes, dtypes and input shardings but not the
lifted floats, so a learning rate or Adam's bias corrections that change every step leave the
key unchanged. The current recording and the guides live in the device's state
(:mod:`partita.virtual.state`). This module does not compile, and does not decide what to
record (:mod:`partita.virtual.dispatch` does).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.errors import VirtualDeviceError
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor
from partita.virtual import draws, state, why
from partita.virtual.cell import Cell
from partita.virtual.guide import Guide
from partita.virtual.lazy import LazyTensor
from partita.virtual.sources import Source, op_source
from partita.virtual.state import DEVICE, DEVICE_NAME

__all__ = [
    "Guide",
    "Recording",
    "build",
    "current",
    "forget_guides",
    "record_annotation",
    "remember",
    "reset",
]

_CPU = torch.device("cpu")
_PLAIN = frozenset({int, bool, type(None), str, torch.dtype, torch.memory_format, torch.layout})


@dataclass
class Recording:
    """The ops recorded since the last sync (one step of the program).

    Attributes:
        epoch: distinguishes this recording's slots from earlier ones.
        ops: ``(op, args template, kwargs template, output slots)`` in program order.
        inputs: ``(slot, value)`` per input: a data Cell or a copied CPU tensor.
        scalars: the lifted Python floats, in order.
        scalar_dtypes: the dtype each becomes a program input in.
        live: weak references to the tensors created here (the candidate outputs).
        guide: the recording this one is expected to repeat (None once it differed).
        miss: why it stopped following its guide, in one line (None while it follows).
        sources: per op, its user source line; only once it left its guide (the fast path
            records none: :meth:`op_sources` takes the guide's). Not part of the key.
    """

    epoch: int
    ops: list[tuple[Any, Any, Any, tuple[int | None, ...]]] = field(default_factory=list)
    inputs: list[tuple[int, Cell | torch.Tensor]] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    scalar_dtypes: list[torch.dtype] = field(default_factory=list)
    live: list[tuple[weakref.ref[LazyTensor], Cell]] = field(default_factory=list)
    n_slots: int = 0
    guide: Guide | None = None
    miss: str | None = None
    results: list[Any] = field(default_factory=list)
    input_meta: list[Any] = field(default_factory=list)
    #: The copies of CPU tensors, by ``(id(t), t._version)``, each with a weak reference to
    #: ``t``: a tensor freed during the recording gives its id to the next one allocated,
    #: which must get its own copy, not the freed tensor's.
    _snapshots: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], int]] = field(
        default_factory=dict
    )
    sources: list[Source] = field(default_factory=list)
    forward_sources: dict[int, Source] = field(default_factory=dict)

    def new_slot(self) -> int:
        self.n_slots += 1
        return self.n_slots - 1

    def _add_input(self, slot: int, value: Cell | torch.Tensor, meta: Any) -> None:
        guide, n = self.guide, len(self.inputs)
        if guide is not None and (n >= len(guide.inputs) or guide.inputs[n] != meta):
            # Another shape, dtype or memory layout: the guide's results would be wrong.
            self._leave(why.input_miss(n, guide.inputs[n] if n < len(guide.inputs) else None, meta))
        self.inputs.append((slot, value))
        self.input_meta.append(meta)

    def slot_of(self, cell: Cell) -> int:
        """The cell's slot here; a data cell not used yet becomes an input."""
        if cell.epoch == self.epoch and cell.slot is not None:
            return cell.slot
        if not cell.has_value:
            raise VirtualDeviceError(
                "partita.sync: a pending value of an earlier step was used after that step ran "
                "without being kept (it was not alive at the sync). This is a partita bug; "
                "please report the loop that triggers it."
            )
        cell.epoch, cell.slot = self.epoch, self.new_slot()
        self._add_input(cell.slot, cell, cell.desc)
        return cell.slot

    def snapshot(self, t: torch.Tensor) -> int:
        """A slot for a CPU tensor, copied now (one copy per tensor version)."""
        slot = self.snapshot_slot(t)
        if slot is None:
            slot = self.new_slot()
            meta = ("cpu", tuple(t.shape), t.stride(), t.dtype)
            self._add_input(slot, t.detach().clone(), meta)
            self._snapshots[(id(t), t._version)] = (weakref.ref(t), slot)
        return slot

    def snapshot_slot(self, t: torch.Tensor) -> int | None:
        """The slot of the copy of CPU tensor ``t`` (as it is now), if an op read it."""
        entry = self._snapshots.get((id(t), t._version))
        return entry[1] if entry is not None and entry[0]() is t else None

    def template(self, x: Any, lift: bool, like: torch.dtype = torch.float64) -> Any:
        if isinstance(x, LazyTensor):
            return ("t", self.slot_of(x._cell))
        if type(x) in _PLAIN:  # the common constants, without the checks below
            return ("c", x)
        if isinstance(x, torch.Tensor):
            return ("t", self.snapshot(x))
        if isinstance(x, ShardedTensor):
            raise VirtualDeviceError(
                f"An op on the virtual device got a ShardedTensor of shape {tuple(x.shape)} "
                f"({x.spec}) inside a list argument, where it cannot be converted: ops mix "
                f"device tensors with ShardedTensors only as direct arguments. Pass x.full(), "
                f"or move the value to the device (x.full().to(dev)) and mark_sharding it."
            )
        if lift and type(x) is float:
            # One program input per use, in the dtype the op computes the number in (its first
            # tensor's): the program does not convert it, and its value may change freely.
            self.scalars.append(x)
            self.scalar_dtypes.append(like)
            return ("s", len(self.scalars) - 1)
        if isinstance(x, (list, tuple)):
            return ("l", tuple(self.template(v, lift, like) for v in x))
        if isinstance(x, torch.device) and x.type == DEVICE_NAME:
            return ("c", _CPU)
        return ("c", x)

    def follow(self, func: Any, targs: Any, tkwargs: Any) -> Any:
        """The guide's entry at this position when this op repeats it, else None (and the
        guide is dropped)."""
        guide = self.guide
        if guide is None:
            return None
        n = len(self.ops)
        if n < len(guide.ops):
            entry = guide.ops[n]
            if entry[0] is func and entry[1] == targs and entry[2] == tkwargs:
                return entry
        self._leave(why.op_miss(n, guide.ops[n] if n < len(guide.ops) else None, func, targs))
        return None

    def _leave(self, reason: str) -> None:
        self.sources = self.guide.sources[: len(self.ops)]  # type: ignore[union-attr]
        self.guide, self.miss = None, reason

    def op_sources(self) -> list[Source]:
        """Each op's user source line (the guide's while this recording follows it)."""
        return self.sources if self.guide is None else self.guide.sources

    def described_inputs(self) -> tuple[Any, ...]:
        """The inputs' part of the structural key: shapes, dtypes, shardings."""
        described: list[tuple[Any, ...]] = []
        for _, value in self.inputs:
            if isinstance(value, Cell):
                data = value.data
                # A plain tensor is replicated: the same input as a replicated ShardedTensor.
                sharding = data.sharding if isinstance(data, ShardedTensor) else "replicated"
                if isinstance(sharding, Sharding) and sharding.is_replicated:  # not partial
                    sharding = "replicated"
                shape, _, _, dtype = value.desc
                described.append((shape, dtype, sharding))
            else:
                described.append(("cpu", tuple(value.shape), value.dtype))
        return tuple(described)

    def key(self, described: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """The structural key: ops, constants and input shapes/dtypes/shardings."""
        return (tuple(self.ops), described or self.described_inputs())

    def repeats_guide(self, out_slots: tuple[int | None, ...], described: tuple[Any, ...]) -> bool:
        """True when this whole recording repeated its guide: the same structural key."""
        guide = self.guide
        if guide is None:
            return False
        reason = why.end_miss(
            (len(self.ops), len(self.inputs), len(self.scalars), out_slots, described),
            (len(guide.ops), len(guide.inputs), guide.n_scalars, guide.out_slots, guide.described),
        )
        if reason is not None:
            self._leave(reason)
        return reason is None

    def as_guide(
        self, out_slots: tuple[int | None, ...], described: tuple[Any, ...], key: Any, program: Any
    ) -> Guide:
        """This recording as the guide of the next one that follows the same program."""
        return Guide(
            self.ops, self.results, self.input_meta, described, out_slots, len(self.scalars),
            key, program, self.op_sources(),
        )  # fmt: skip


#: Guides kept at most (``DeviceState.guides``: the recording that followed each program last
#: time, by ``id(program)``, so a loop alternating between programs, accumulation micro-steps
#: or evaluation, is guided by each).
_GUIDE_LIMIT = 128


def build(template: Any, env: dict[int, Any], scalars: Sequence[Any]) -> Any:
    """An argument from its :meth:`Recording.template`: tensors from ``env`` by slot, lifted
    floats from ``scalars`` (numbers, or the program's 0-dim inputs when replayed)."""
    kind, value = template
    if kind == "t":
        return env[value]
    if kind == "s":
        return scalars[value]
    if kind == "l":
        return [build(v, env, scalars) for v in value]
    return value


def current() -> Recording:
    """The recording of the step being recorded now (``DeviceState.fast_path`` False: never
    guided, every step recorded in full)."""
    device = state.get()
    rec = device.recording
    if rec is None:
        device.epoch += 1
        last = device.last_guide
        guide = None if last is None or not device.fast_path else _guide_after(device, last)
        rec = device.recording = Recording(device.epoch, guide=guide)
    return rec


def _guide_after(device: Any, last: Any) -> Any:
    """The guide that followed ``last.program`` the last time it ran, else ``last``. The
    guides are keyed by ``id``; each entry holds its program, so an id that a program freed
    since (evicted, or the programs cleared) and a new one now has never finds another
    program's guide."""
    entry = device.guides.get(id(last.program))
    return entry[1] if entry is not None and entry[0] is last.program else last


def reset() -> Recording | None:
    """End the current recording (a sync does this) and return it."""
    device = state.get()
    rec, device.recording = device.recording, None
    draws.reset()
    return rec


def remember(guide: Guide) -> None:
    """After a sync: ``guide`` is the step just run; it follows the previous step's program."""
    device = state.get()
    last = device.last_guide
    if last is not None:
        if len(device.guides) >= _GUIDE_LIMIT:
            device.guides.clear()
        device.guides[id(last.program)] = (last.program, guide)  # see _guide_after
    device.last_guide = guide


def forget_guides() -> None:
    """Drop every guide (the mesh changed: their programs are for another mesh)."""
    device = state.get()
    device.guides.clear()
    device.last_guide = None
    if device.recording is not None:
        device.recording.guide = None


def record_annotation(t: LazyTensor, annotate: Any, mesh: Any, spec: Any) -> None:
    """Record ``annotate(t, mesh, spec)`` on a pending tensor: its later uses see the
    annotated value (``mark_sharding`` in place on a value being computed)."""
    with DEVICE:  # as an op: not while another thread's sync takes the recording
        rec = current()
        slot = rec.slot_of(t._cell)
        targs = (("t", slot), ("c", mesh), ("c", spec))
        entry = rec.follow(annotate, targs, ()) or (annotate, targs, (), (slot,))
        if rec.guide is None:
            rec.sources.append(op_source(rec.forward_sources))
        rec.ops.append(entry)
        rec.results.append(None)
