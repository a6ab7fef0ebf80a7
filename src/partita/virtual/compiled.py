"""``partita.compile(step_fn)``: run a step function until it repeats, then replay its program.

The semantics are CUDA Graphs' (``torch.cuda.graph``): the first calls run the function (each is
recorded and synced like ``partita.sync()``); once two consecutive calls with the same argument
signature, after a warm-up call, recorded the same step (same structural key, same inputs in the
same places, same lifted floats, equal host values), the step is *captured*. Later calls with
that signature do not run the function: the captured program runs on the current values of the
tensors it read, its in-place updates go back into the same cells (parameters and optimizer
state keep their identity), and the returned tensors are new, in flight like a sync's.

Whatever cannot be proven identical stays on the slow path (the function runs every call), with
one line in ``partita.metrics()`` saying why and how to fix it. This module does not record ops
or compile programs; it reads what :func:`partita.virtual.step.sync` ran.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.values.tensor import ShardedTensor
from partita.virtual import recording, step
from partita.virtual import state as device_state
from partita.virtual.cell import Cell
from partita.virtual.holders import Holders, holders
from partita.virtual.lazy import LazyTensor
from partita.virtual.replayable import (
    REPLICATED,
    Call,
    describe_call,
    differs,
    equal_values,
    extra_output,
    sharding_of,
)

__all__ = ["CALLS", "SIGNATURE_LIMIT", "CompiledStep", "compile"]

#: Argument signatures a compiled function keeps (each with its capture), the oldest dropped.
SIGNATURE_LIMIT = 16
#: Held during each call of a compiled step: calls from several threads run in turn. One lock
#: for all compiled steps: the virtual device records one step at a time (one recording per
#: process), and a call reads and updates the same parameters and optimizer state.
CALLS = threading.RLock()


@dataclass
class _Capture:
    """A captured step: the program, where each input comes from, what the call returns."""

    program: Any
    roles: list[tuple[Any, ...]]
    scalars: list[Any]
    returns: list[tuple[Any, ...]]
    out_descs: list[Any]
    out_spec: Any
    cpu_guards: list[tuple[int, torch.Tensor]]
    mesh: Any
    holders: Holders


@dataclass
class _Signature:
    """Per argument signature: how many times the function ran, the last call, the capture."""

    calls: int = 0
    last: Call | None = None
    capture: _Capture | None = None


@dataclass
class CompiledStep:
    """A step function compiled by :func:`compile` (call it as the function)."""

    fn: Callable[..., Any]
    signatures: dict[Any, _Signature] = field(default_factory=dict)
    collected: bool = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def reset(self) -> None:
        """Drop every capture: the next calls run the function again (after a change the
        guard does not see: a Python value read inside the step; loads and replaced tensors
        drop the capture by themselves)."""
        self.signatures.clear()
        step.metrics().compiled_steps.pop(self.name, None)

    def _say(self, line: str) -> None:
        step.metrics().compiled_steps[self.name] = line

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with CALLS:
            return self._call(args, kwargs)

    def _call(self, args: Any, kwargs: Any) -> Any:
        step.sync()  # work recorded before the call: its values are the step's inputs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig = _signature(leaves, spec)
        if isinstance(sig, str):
            self._say(f"not capturable: {sig}; it runs the function every call")
            return self._run(None, leaves, args, kwargs)
        state = self.signatures.get(sig)
        if state is None:
            if len(self.signatures) >= SIGNATURE_LIMIT:  # the oldest signature goes
                del self.signatures[next(iter(self.signatures))]
            state = self.signatures[sig] = _Signature()
        cap = state.capture
        if cap is not None:
            stale = _stale(cap, leaves)
            if stale is None:
                return _replay(cap, leaves)
            state.capture, state.calls, state.last = None, 0, None
            self._say(f"capture dropped: {stale}; the function runs again and is re-captured")
        return self._run(state, leaves, args, kwargs)

    def _run(self, state: _Signature | None, leaves: list[Any], args: Any, kwargs: Any) -> Any:
        """Run the function (recorded, synced at the end) and capture it once it repeats."""
        m = step.metrics()
        syncs, start = m.syncs, device_state.next_serial()
        device_state.get().uploads.append([])
        try:
            out = self.fn(*args, **kwargs)
        finally:
            uploads = device_state.get().uploads.pop()
        inner = m.syncs - syncs
        out_leaves, out_spec = pytree.tree_flatten(out)
        returned = {id(t._cell) for t in out_leaves if isinstance(t, LazyTensor)}
        rec = recording.current()
        if state is not None and not self.collected and extra_output(rec, returned) is not None:
            gc.collect()  # a cycle may hold a tensor the step made (decided once per function)
            self.collected = True
        extra = extra_output(rec, returned)  # named now: the sync clears the recording's slots
        step.sync()
        out = pytree.tree_unflatten([_detach(t) for t in out_leaves], out_spec)
        if state is None:
            return out
        state.calls += 1
        last = step.last_sync()
        reason = None
        if inner:
            reason = (
                f"the function synced {inner} time(s) inside the call (.item(), print(t), "
                f".cpu() or bool(t) of a device value), so the call ran more than one program "
                f"and a replay runs one. Fix: return the value and read it after the call"
            )
        elif not rec.ops or last is None or last.rec is not rec:
            reason = "the call recorded no device op after its last sync"
        if reason is None:
            assert last is not None  # else the branch above gave the reason
            call = describe_call(last, leaves, out_leaves, start, uploads, extra)
            reason = call if isinstance(call, str) else None
        if reason is not None:
            state.last = None
            self._say(f"not capturable: {reason}; it runs the function every call")
            return out
        assert isinstance(call, Call)
        previous, state.last = state.last, (call if state.calls > 1 else None)  # 1: warm-up
        if previous is not None:
            why = differs(previous, call)
            if why is not None:
                self._say(f"not captured yet: {why}; it runs the function every call")
                return out
            state.last = None  # the capture keeps what a replay needs, not the recording
            state.capture = _Capture(
                call.program, call.roles, call.scalars, call.returns, call.out_descs, out_spec,
                call.cpu_guards, step.current_mesh(), holders(call.roles),
            )  # fmt: skip
            self._say(
                f"captured after {state.calls} calls ({len(rec.ops)} ops, "
                f"{len(call.roles)} inputs); later calls with the same signature replay it"
            )
        else:  # a line until the next call decides (a dropped capture's stays)
            m.compiled_steps.setdefault(
                self.name, f"capturing: {state.calls} call(s) recorded (captured at the 3rd)"
            )
        return out


def compile(fn: Callable[..., Any]) -> CompiledStep:
    """Compile a training step on the virtual device: run it until it repeats, then replay it.

    Calls 1..k run ``fn`` (recorded and synced at the end of the call, like ``partita.sync()``);
    call 1 is a warm-up (the optimizer creates its state). Once two consecutive calls with the
    same argument signature record the same step, with the same lifted floats and equal host
    values, it is captured: later calls with that signature do **not** run ``fn`` (as CUDA
    graph replay: Python side effects inside ``fn`` happen only on the calls that ran it). They
    run the captured program on the current values of the tensors it read, write its in-place
    updates back into the same tensors, and return new tensors (detached: no autograd graph
    crosses the call). Optimizers must be built with ``capturable=True`` (their step counters
    then live on the device). The signature is the pytree structure of the arguments, each
    tensor's device, shape, dtype (and sharding on the device), the other values by value; and
    every tensor the step reads besides its arguments must still be alive with the same shape
    and sharding, and held as at the capture (:class:`~partita.virtual.holders.Holders`: the
    tensor objects standing for it, their ``requires_grad``, ``.grad`` and ``.data``; the
    modules and optimizers holding them). A different signature runs ``fn`` and is captured
    separately; a changed holder drops the capture (``fn`` runs and is captured again). Calls
    run one at a time (:data:`CALLS`).
    ``partita.metrics()`` says, per compiled function, whether it was captured or why not (and
    the fix); the compiled function's ``reset()`` drops its captures. See docs/virtual-device.md.

    Example:
        >>> dev = partita.use_spmd(Mesh.create((2, 4), ("data", "model")))
        >>> w = torch.zeros(4, device=dev)
        >>> @partita.compile
        ... def add_one():
        ...     w.add_(1)
        ...     return w.sum() * 1
        >>> [add_one().item() for _ in range(5)]
        [4.0, 8.0, 12.0, 16.0, 20.0]
    """
    compiled = CompiledStep(fn)
    functools.update_wrapper(compiled, fn)
    return compiled


def _detach(t: Any) -> Any:
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def _signature(leaves: list[Any], spec: Any) -> tuple[Any, ...] | str:
    """The guard of a call (hashable), or why the arguments cannot have one."""
    # The modes the recorded ops depend on: grad mode (is a backward recorded) and autocast
    # (which dtypes the ops run in) on the device and the CPU.
    backend = torch._C._get_privateuse1_backend_name()
    modes = (torch.is_grad_enabled(), *(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in (backend, "cpu")
    ))  # fmt: skip
    parts: list[Any] = [spec, modes]
    first: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, LazyTensor):
            cell = leaf._cell
            parts.append(
                ("spmd", cell.desc, sharding_of(cell.data), leaf.requires_grad,
                 first.setdefault(id(cell), i))
            )  # fmt: skip
        elif isinstance(leaf, torch.Tensor):
            parts.append(("cpu", leaf.device, tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
            except TypeError:
                return (
                    f"argument leaf {i} is a {type(leaf).__name__}, which is not hashable, so "
                    f"calls cannot be told apart. Fix: pass tensors, numbers, strings or tuples"
                )
            parts.append(("value", type(leaf), leaf))
    return tuple(parts)


def _stale(cap: _Capture, leaves: list[Any]) -> str | None:
    """Why a captured step's non-argument inputs no longer are what it was captured with."""
    mesh = step.current_mesh()
    if mesh is not cap.mesh and mesh != cap.mesh:
        return f"the virtual device's mesh changed from {cap.mesh!r} to {mesh!r} (use_spmd)"
    for i, value in cap.cpu_guards:
        if not equal_values(leaves[i], value):
            return f"the CPU argument leaf {i}, not read by the program, has another value"
    for n, role in enumerate(cap.roles):
        if role[0] != "cell":
            continue
        cell = role[1]()
        if cell is None:
            return f"input {n} of the step (a {list(role[2][0])} tensor) was freed"
        if cell.desc != role[2] or sharding_of(cell.data) != role[3]:
            return (
                f"input {n} of the step changed from {list(role[2][0])} {role[3]} to "
                f"{list(cell.desc[0])} {sharding_of(cell.data)} (mark_sharding, or .data replaced)"
            )
    return cap.holders.stale()


def _replay(cap: _Capture, leaves: list[Any]) -> Any:
    """Run the captured program on the current values; the call's return value."""
    step.wait_in_flight()
    values: list[Any] = []
    cells: list[Any] = []
    for role in cap.roles:
        kind = role[0]
        if kind == "arg":
            cell = leaves[role[1]]._cell
            values.append(cell.data)
        elif kind == "cell":
            cell = role[1]()
            values.append(cell.data)
        elif kind == "snapshot":
            cell = None
            values.append(leaves[role[1]].detach().clone())
        elif kind == "upload":
            cell, value = None, leaves[role[1]].detach().to(role[2], copy=True)
            values.append(
                value if role[3] == REPLICATED else ShardedTensor.from_global(value, role[3])
            )
        else:
            cell = None
            values.append(role[1])
        cells.append(cell)
    out_cells = [Cell(None, desc=desc) for desc in cap.out_descs]
    step.submit(cap.program, [*values, *cap.scalars], out_cells, cells)
    step.metrics().compiled_step_replays += 1
    result = []
    for ret in cap.returns:
        if ret[0] == "out":
            result.append(LazyTensor(out_cells[ret[1]]))
        elif ret[0] == "arg":
            result.append(leaves[ret[1]])
        else:
            result.append(ret[1])
    return pytree.tree_unflatten(result, cap.out_spec)
