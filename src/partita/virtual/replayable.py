"""Whether a recorded call of a compiled step can be replayed, and what a replay needs.

:func:`describe_call` turns what the call's sync ran into a :class:`Call`: where each input of
the program came from (an argument, a tensor that existed before the call such as a parameter
or optimizer state, an argument uploaded inside the step, a host value), the lifted floats, and
where each returned value comes from; or says, in one line with the fix, why the call cannot be
replayed. :func:`differs` compares two consecutive calls. Used by
:mod:`partita.virtual.compiled`; this module does not record or run anything.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor
from partita.virtual import recording, step
from partita.virtual.cell import Cell
from partita.virtual.lazy import LazyTensor
from partita.virtual.why import recompile_reason

__all__ = [
    "REPLICATED",
    "Call",
    "describe_call",
    "differs",
    "equal_values",
    "extra_output",
    "sharding_of",
]

#: A value's sharding as the signature and the guards compare it (plain = replicated).
REPLICATED = "replicated"


def sharding_of(data: Any) -> Any:
    """A device value's sharding, with every replicated layout (a plain tensor too) as one."""
    sharding = getattr(data, "sharding", REPLICATED)
    if isinstance(sharding, Sharding) and sharding.is_replicated:  # not partial
        return REPLICATED
    return sharding


def _full(value: Any) -> torch.Tensor:
    return value.full() if isinstance(value, ShardedTensor) else value


def equal_values(a: Any, b: Any) -> bool:
    """Same shape, dtype and values (ShardedTensors compared by their global value)."""
    a, b = _full(a), _full(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _where(rec: recording.Recording, i: int) -> str:
    """Op ``i`` of ``rec`` and the user's line that recorded it."""
    sources = rec.op_sources()
    src = sources[i] if i < len(sources) else None
    at = "" if src is None else f" at {src[0].co_filename}:{src[1]}"
    return f"op {i} ({rec.ops[i][0]}){at}"


def _uses(template: Any, kind: str, index: int) -> bool:
    if template[0] == kind and template[1] == index:
        return True
    return template[0] == "l" and any(_uses(t, kind, index) for t in template[1])


def _op_using(rec: recording.Recording, kind: str, index: int) -> str:
    """The first op whose arguments use the lifted float or input slot ``index``."""
    for i, (_, targs, tkwargs, _) in enumerate(rec.ops):
        if any(_uses(t, kind, index) for t in (*targs, *(t for _, t in tkwargs))):
            return _where(rec, i)
    return "no op"


@dataclass
class Call:
    """What one recorded call ran, to compare with the next call and to capture."""

    key: Any
    rec: recording.Recording
    program: Any
    roles: list[tuple[Any, ...]]
    scalars: list[Any]
    returns: list[tuple[Any, ...]]
    out_descs: list[Any]
    cpu_guards: list[tuple[int, torch.Tensor]]


def extra_output(rec: recording.Recording, returned: set[int]) -> str | None:
    """The first tensor the step made that is alive and not returned, named, else None."""
    for ref, cell in rec.live:
        if ref() is not None and id(cell) not in returned:
            made = next((i for i, op in enumerate(rec.ops) if cell.slot in op[3]), None)
            where = "" if made is None else f" by {_where(rec, made)}"
            return f"{list(cell.desc[0])} {cell.desc[3]}{where}"
    return None


def describe_call(
    last: step.LastSync,
    leaves: list[Any],
    out_leaves: list[Any],
    start: int,
    uploads: list[Any],
    extra: str | None,
) -> Call | str:
    """The call the last sync ran, as a :class:`Call`, or why it cannot be replayed."""
    rec = last.rec
    args = {id(t._cell): i for i, t in enumerate(leaves) if isinstance(t, LazyTensor)}
    cpu_args = {
        id(t): i
        for i, t in enumerate(leaves)
        if isinstance(t, torch.Tensor) and not isinstance(t, LazyTensor)
    }
    read = {rec.snapshot_slot(leaves[i]): i for i in cpu_args.values()}
    sources = {id(cell): src for src, cell in uploads}  # the last event of each cell
    roles: list[tuple[Any, ...]] = []
    for n, (slot, value) in enumerate(rec.inputs):
        # The value the step ran on (a cell the step updates in place holds its new value now).
        data = last.inputs[n]
        if not isinstance(value, Cell) and slot in read:  # a CPU argument an op read
            roles.append(("snapshot", read[slot]))
        elif not isinstance(value, Cell):  # another CPU tensor an op read (copied then)
            roles.append(("const", data, _op_using(rec, "t", slot)))
        elif id(value) in args:
            roles.append(("arg", args[id(value)]))
        elif value.serial < start:  # a parameter, optimizer state, a buffer
            roles.append(("cell", weakref.ref(value), value.desc, sharding_of(data)))
        else:
            src = sources.get(id(value))
            shape, _, _, dtype = value.desc
            if src is not None and id(src) in cpu_args and tuple(src.shape) == shape:
                # An argument moved to the device inside the step (x.to(dev)), its data not
                # overwritten since (a later mark_sharding lays the same values out).
                roles.append(("upload", cpu_args[id(src)], dtype, sharding_of(data)))
            else:  # made on the device inside the step from no argument
                roles.append(("const", data, _op_using(rec, "t", slot)))
    outs = {id(c): i for i, c in enumerate(last.out_cells)}
    returned: set[int] = set()
    returns: list[tuple[Any, ...]] = []
    for i, leaf in enumerate(out_leaves):
        if isinstance(leaf, LazyTensor) and id(leaf._cell) in outs:
            returns.append(("out", outs[id(leaf._cell)]))
            returned.add(id(leaf._cell))
        elif isinstance(leaf, LazyTensor) and id(leaf._cell) in args:
            returns.append(("arg", args[id(leaf._cell)]))
        elif isinstance(leaf, torch.Tensor):
            return (
                f"return value leaf {i} ({type(leaf).__name__} {list(leaf.shape)}) is not a "
                f"tensor the step computed on the device nor an argument, so a replay has no "
                f"new value for it. Fix: return device tensors the step computes"
            )
        else:
            returns.append(("value", leaf))
    kept = [c for c in last.out_cells if id(c) not in returned]
    if kept:
        cell = kept[0]
        what = extra or f"{list(cell.desc[0])} {cell.desc[3]}"
        return (
            f"a tensor the step made ({what}) is still "
            f"alive after the call and is not returned (a gradient in p.grad when gradients "
            f"are zeroed outside the step, a list the step appends to), so a replay could not "
            f"hand its new value to whoever holds it. Fix: zero the gradients inside the step "
            f"(opt.zero_grad(), set_to_none) or return the tensor"
        )
    scalars = last.inputs[len(rec.inputs) :]
    descs = [c.desc for c in last.out_cells]
    # CPU arguments the program does not read as tensors (read in Python, say): compared by
    # value before each replay, since their value may be baked into the step.
    used = {r[1] for r in roles if r[0] in ("snapshot", "upload")}
    guards = [(i, leaves[i].detach().clone()) for i in cpu_args.values() if i not in used]
    return Call(last.key, rec, last.program, roles, scalars, returns, descs, guards)


def differs(a: Call, b: Call) -> str | None:
    """Why the calls ``a`` and ``b`` (same signature) are not the same step, or None."""
    if a.key != b.key:
        why = recompile_reason(b.key, [a.key], b.rec)
        return f"two consecutive calls recorded different steps ({why})"
    for j, (x, y) in enumerate(zip(a.rec.scalars, b.rec.scalars, strict=True)):
        if x != y:
            return (
                f"the Python float of {_op_using(b.rec, 's', j)} was {x!r} in one call and "
                f"{y!r} in the next (a number computed in Python each step: AdamW with "
                f"capturable=False computes its bias corrections from a CPU step counter, an lr "
                f"scheduler sets a float lr). Fix: torch.optim.AdamW(..., capturable=True), and "
                f"a tensor lr on the device (lr=torch.tensor(1e-3).to(dev)) for a schedule"
            )
    for n, (ra, rb) in enumerate(zip(a.roles, b.roles, strict=True)):
        if ra[0] != rb[0]:
            return f"input {n} of the step came from {ra[0]} in one call and {rb[0]} in the next"
        if ra[0] == "const" and not equal_values(ra[1], rb[1]):
            return (
                f"the host value read by {rb[2]} ({list(rb[1].shape)} {rb[1].dtype}) changed "
                f"between two calls (state kept on the host that changes each step). Fix: keep "
                f"it on the device, updated in place inside the step, or pass it as an argument"
            )
        if ra[0] == "cell" and ra[1]() is not rb[1]():
            return f"input {n} of the step is a different tensor in one call and the next"
        if ra[0] in ("arg", "upload", "snapshot") and ra != rb:
            return f"input {n} of the step comes from another argument in one call and the next"
    if a.returns != b.returns:
        return "the two calls returned different values (besides the tensors)"
    return None
