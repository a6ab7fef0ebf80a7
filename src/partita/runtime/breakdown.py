"""Where a step's time goes: a measured breakdown of its CPU time by category.

The work a step must do is the unsharded step's compute plus its bytes on the wire; the rest
is the executor's own cost. :func:`measure` times a step (median process CPU, the step's own
thread's CPU and wall time of some unprofiled runs), then runs it with partita's named ranges on
(``runtime.ranges``) under :class:`OpClock`, which reads the calling thread's CPU clock
(``time.thread_time``) around every top-level op and every mesh op's range (the ranges on,
no profiler recording). Every category but
``idle`` is CPU time, and together they add up to the process CPU time:

- ``collectives``: the step's thread's CPU inside a mesh op's range (``runtime.ranges``: the
  LocalMesh's stacked implementation of a collective; a DistributedMesh's launch with its flat
  copies and its Gloo/NCCL call, and its wait), in partita's mesh ops outside one, and in
  torch's own collective ops (``c10d``, ``_c10d_functional``, and FSDP2's copies in and out of
  its flat buffers, ``fsdp``); partita's other ops (its attention ``partita.sdpa``) are
  local compute (before session 37 the whole ``partita`` namespace counted here, attention
  included);
- ``local compute``: the CPU of the other top-level ops, except
- ``copies/layout``: ops that only copy or re-view memory (``copy_``, ``clone``, ``cat``,
  ``reshape``, ``permute``, ...), wherever they run outside a collective;
- ``other``: the step's thread's CPU less the three above: the interpreter, the executors'
  Python per op and per step, dispatch, the glue no op holds;
- ``threads``: the CPU of the process's other threads during the step (Gloo's event loops and
  workers; intra-op threads if any): process CPU less the step's thread's;
- ``idle``: **wall** time less the step's thread's CPU (waiting for other ranks' bytes or for
  a core): not CPU, not in the sum.

Only top-level ops count (an op's nested ops run inside its clock), so nothing counts twice.
The three op categories are measured in the instrumented runs (their mean): the clock costs
the step's thread a few microseconds per op, outside the ops it times. If under load they sum
to more than the unprofiled runs' thread CPU, they are scaled down to it (``other`` is then 0).
``bench/bench_partition.py`` and ``bench/bench_distributed.py`` print it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

from partita.runtime import ranges

__all__ = [
    "CATEGORIES",
    "CPU_CATEGORIES",
    "Breakdown",
    "OpClock",
    "RangeClock",
    "clocked_ranges",
    "measure",
]

CATEGORIES = ("collectives", "local compute", "copies/layout", "other", "threads", "idle")
#: The categories that are CPU time: they add up to :attr:`Breakdown.cpu`.
CPU_CATEGORIES = CATEGORIES[:-1]

#: Ops that only copy or re-view memory (the aten names, without the namespace).
_LAYOUT_OPS = frozenset(
    """copy_ clone contiguous cat stack _to_copy to empty_like zeros_like new_zeros
    reshape view _unsafe_view _reshape_alias permute transpose t expand expand_as as_strided
    select slice narrow split split_with_sizes chunk unbind unsqueeze squeeze flatten
    unflatten movedim alias detach index_select gather""".split()
)
#: The mesh op kinds a range can be named after (``runtime.ranges``: ``partita.<kind>...``),
#: and a DistributedMesh's wait for one.
_MESH_KINDS = frozenset(
    """all_gather all_reduce reduce_scatter all_to_all collective_permute axis_index
    shard_slice all_gather_bucket all_reduce_bucket reduce_scatter_bucket wait""".split()
)
#: Op namespaces that are communication wherever they run.
_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "fsdp"})


@dataclass
class Breakdown:
    """Seconds per step: ``cpu`` (process CPU, median), ``wall`` (median), and ``parts``
    (one entry per :data:`CATEGORIES`; those of :data:`CPU_CATEGORIES` add up to ``cpu``,
    ``idle`` is wall time)."""

    cpu: float
    wall: float
    parts: dict[str, float] = field(default_factory=dict)

    def row(self, floor_cpu: float | None = None) -> str:
        """``CPU 12.3 ms (1.42x floor): collectives 1.0, local compute 8.1, ...`` in ms."""
        ratio = f" ({self.cpu / floor_cpu:.2f}x floor)" if floor_cpu else ""
        parts = ", ".join(f"{k} {1e3 * self.parts.get(k, 0.0):.1f}" for k in CPU_CATEGORIES)
        idle = 1e3 * self.parts.get("idle", 0.0)
        return f"CPU {1e3 * self.cpu:.1f} ms{ratio}: {parts}; idle (wall) {idle:.1f} (ms)"


def _mesh_range(name: str) -> bool:
    """``partita.all_gather[model] 1536 B #3 @ ...`` or ``partita.wait all_gather...``."""
    rest = name.removeprefix("partita.")
    if rest == name:
        return False
    for stop in " [":
        rest = rest.split(stop, 1)[0]
    return rest in _MESH_KINDS


def _op_category(func: Any) -> str:
    """An op's category. partita's own ops are collectives only when they are mesh ops
    (``partita.all_gather``, ...): its attention (``partita.sdpa``) is local compute."""
    name = func.__name__.split(".")[0]
    if func.namespace in _COMM_NAMESPACES or (func.namespace == "partita" and name in _MESH_KINDS):
        return "collectives"
    return "copies/layout" if name in _LAYOUT_OPS else "local compute"


class OpClock(TorchDispatchMode):
    """The calling thread's CPU seconds in top-level ops, by category (``seconds``), except
    ops inside a mesh op's range (``record_function`` ranges named as ``runtime.ranges``
    names them; partita opens them under a profiler, or in :func:`measure`): those are
    :class:`RangeClock`'s.

    >>> with OpClock() as clock:
    ...     _ = (torch.ones(64, 64) @ torch.ones(64, 64)).t().contiguous()
    >>> clock.seconds["local compute"] > 0 and clock.seconds["collectives"] == 0
    True
    """

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"collectives": 0.0, "local compute": 0.0, "copies/layout": 0.0}
        self._ranges: list[bool] = []  # the open ranges: whether each is a mesh op's
        self._in_mesh = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "profiler":
            return self._range(func, args, kwargs or {})
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        if not self._in_mesh:
            self.seconds[_op_category(func)] += time.thread_time() - start
        return out

    def _range(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A range opens (``_record_function_enter_new``: its name) or closes: ranges nest
        (``with record_function``, ``ranges.Range``), so a close ends the innermost open one
        (the handles passed to the close compare by nothing)."""
        out = func(*args, **kwargs)
        if "enter" in func.__name__:
            mesh = bool(args) and isinstance(args[0], str) and _mesh_range(args[0])
            self._in_mesh += mesh
            self._ranges.append(mesh)
        elif self._ranges:
            self._in_mesh -= self._ranges.pop()
        return out


class RangeClock:
    """The calling thread's CPU seconds inside the outermost mesh op ranges (``seconds``).
    Called as ``record_function`` is (``runtime.ranges`` calls it in :func:`clocked_ranges`):
    each range's clock runs from its start to its end, outside the profiler's own calls, and
    no op inside it pays a dispatch mode (:class:`OpClock` would double a launch's cost)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._open = 0
        self._start = 0.0

    def __call__(self, name: str, args: str | None = None) -> record_function:
        return _ClockedRange(self, name, args) if _mesh_range(name) else record_function(name, args)

    def start(self) -> None:
        self._open += 1
        if self._open == 1:
            self._start = time.thread_time()

    def stop(self) -> None:
        self._open -= 1
        if self._open == 0:
            self.seconds += time.thread_time() - self._start


class _ClockedRange(record_function):
    """A mesh op's ``record_function`` range whose thread CPU its :class:`RangeClock` counts."""

    def __init__(self, clock: RangeClock, name: str, args: str | None = None) -> None:
        super().__init__(name, args)
        self._clock = clock

    def __enter__(self) -> Any:
        out = super().__enter__()
        self._clock.start()
        return out

    def __exit__(self, *exc: object) -> None:
        self._clock.stop()
        super().__exit__(*exc)


@contextmanager
def clocked_ranges() -> Iterator[RangeClock]:
    """partita's executors open their named ranges (``runtime.ranges.enabled``) with no
    profiler recording them (no op pays the profiler's callbacks), each mesh op's range
    counted by the :class:`RangeClock` this yields."""
    clock = RangeClock()
    was = torch.autograd.profiler._is_profiler_enabled
    torch.autograd.profiler._set_is_profiler_enabled(True)
    ranges.record_function = clock  # type: ignore[assignment,misc]
    try:
        yield clock
    finally:
        ranges.record_function = record_function  # type: ignore[misc]
        torch.autograd.profiler._set_is_profiler_enabled(was)


def measure(step: Callable[[], Any], repeat: int = 5, profiled: int = 2) -> Breakdown:
    """Time ``step()`` (already warmed up): the median CPU and wall seconds of ``repeat``
    runs, split by category from ``profiled`` instrumented runs (their mean)."""
    cpus, threads, walls = [], [], []
    for _ in range(repeat):
        w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
        step()
        threads.append(time.thread_time() - t)
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    cpu, wall = statistics.median(cpus), statistics.median(walls)
    # the step's thread: the median of its own, never above the process's
    main = min(statistics.median(threads), cpu)
    with clocked_ranges() as in_ranges:  # the mesh ops' ranges, no dispatch mode
        for _ in range(profiled):
            step()
    with clocked_ranges(), OpClock() as clock:  # the ops outside them
        for _ in range(profiled):
            step()
    ops = {k: v / profiled for k, v in clock.seconds.items()}
    ops["collectives"] += in_ranges.seconds / profiled
    total = sum(ops.values())
    if total > main:  # instrumented runs slower than the plain ones (load): fit them in
        ops = {k: v * main / total for k, v in ops.items()}
    parts = {**ops, "other": max(0.0, main - sum(ops.values())), "threads": cpu - main}
    parts["idle"] = max(0.0, wall - main)
    return Breakdown(cpu, wall, parts)
