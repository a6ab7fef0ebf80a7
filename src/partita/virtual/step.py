"""``sync()``: cut the recording, find or compile its program, run it, materialise the results.

The program of a recording is a replay function: it runs the recorded ops again, in order, on
its inputs (data cells, copied CPU tensors, lifted floats) and returns the values of the
recorded tensors still alive. :func:`partita.jit` compiles it through the ordinary pipeline
(capture traces the replay into a functional graph, in-place updates of data become input
updates; propagation; partitioning; the LocalMesh, or torch.distributed when it is up), so
annotations from ``mark_sharding`` and the input shardings decide every other sharding.

On the LocalMesh the run is submitted to a background thread and ``sync`` returns: the next
step records meanwhile, its values are *in flight* (reading one, or the next sync, waits).
Under torch.distributed the run happens before ``sync`` returns.

Programs are cached by the recording's structural key (:meth:`Recording.key`): a cache hit
builds no fx graph, and a step that repeated its guide op by op (the fast path, see
:class:`~partita.virtual.recording.Guide`) takes the guide's program without hashing its key.
:func:`metrics` counts compilations, hits and fast-path steps, and keeps, per compilation after
the first, one line saying what changed since the closest cached program, and per step that
left the fast path the first op or input that differed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.capture.source import pin_source
from partita.mesh import Mesh
from partita.relayout import reshard
from partita.runtime.distributed import distributed_executor
from partita.tensor import ShardedTensor
from partita.virtual import disk_cache, recording
from partita.virtual.device import VirtualDeviceError
from partita.virtual.lazy import Cell
from partita.virtual.lift import replay_op
from partita.virtual.program import StepProgram, compile_step
from partita.virtual.sources import stack_entries
from partita.virtual.why import recompile_reason

__all__ = [
    "RUN_IN_BACKGROUND",
    "Metrics",
    "current_mesh",
    "mesh",
    "metrics",
    "set_mesh",
    "sync",
    "wait_in_flight",
]

CACHE_LIMIT = 64
#: How many fast-path misses :class:`Metrics` keeps (the latest).
MISSES_KEPT = 20


@dataclass
class Metrics:
    """What the virtual device did so far (``partita.metrics()``).

    Attributes:
        compiles: programs compiled (in this process).
        cache_hits: syncs that reused a compiled program.
        disk_hits: compilations avoided by the persistent cache.
        syncs: syncs that ran a program.
        ops_recorded: ops recorded in all steps.
        recompile_reasons: one line per compilation after the first: what changed and where.
        fast_path_hits: syncs whose step repeated the step that last followed the same program
            op by op, so recording made no shape inference and the key was not hashed.
        fast_path_misses: one line per step that left the fast path: the first op or input
            that differed from the step it was checked against (the last ``MISSES_KEPT``).
        compile_seconds, run_seconds: time spent compiling and running steps.
    """

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    syncs: int = 0
    ops_recorded: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    fast_path_hits: int = 0
    fast_path_misses: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    run_seconds: float = 0.0

    def __str__(self) -> str:
        lines = [
            f"compiles={self.compiles} cache_hits={self.cache_hits} disk_hits={self.disk_hits} "
            f"syncs={self.syncs} ops_recorded={self.ops_recorded} "
            f"fast_path_hits={self.fast_path_hits} "
            f"compile={self.compile_seconds:.2f}s run={self.run_seconds:.2f}s"
        ]
        lines += [f"recompiled: {r}" for r in self.recompile_reasons]
        lines += [f"left the fast path: {r}" for r in self.fast_path_misses]
        return "\n".join(lines)


_STATE: dict[str, Any] = {"mesh": None, "metrics": Metrics()}
_CACHE: OrderedDict[Hashable, StepProgram] = OrderedDict()


def set_mesh(mesh: Mesh) -> None:
    """The mesh the virtual device's programs run on (``use_spmd`` sets it)."""
    if _STATE["mesh"] is not None and _STATE["mesh"] != mesh:
        _CACHE.clear()
        recording.forget_guides()
    _STATE["mesh"] = mesh


def current_mesh() -> Mesh | None:
    """The virtual device's mesh, or None before ``use_spmd``."""
    return _STATE["mesh"]


def mesh() -> Mesh:
    """The virtual device's mesh (raises when ``use_spmd`` was not called)."""
    m = _STATE["mesh"]
    if m is None:
        raise VirtualDeviceError(
            "The virtual device has no mesh: a tensor on 'spmd' was used before "
            "partita.use_spmd(mesh). Call dev = partita.use_spmd(mesh) first."
        )
    return m


def metrics(reset: bool = False) -> Metrics:
    """The virtual device's counters (``reset=True`` starts new ones and returns the old).

    Example:
        >>> m = metrics()
        >>> m.compiles >= 0
        True
    """
    m = _STATE["metrics"]
    if reset:
        _STATE["metrics"] = Metrics()
    return m


def _replay_fn(rec: recording.Recording, outputs: list[int]) -> Callable[..., list[torch.Tensor]]:
    """The recording as a function of its inputs (in ``rec.inputs`` order, then the scalars).

    Each op runs with its recorded source line pinned, so capture gives the nodes it makes the
    user's line (the stack here shows only the replay and ``partita.sync()``).
    """
    ops = list(rec.ops)
    entries = stack_entries(rec.op_sources())
    input_slots = [slot for slot, _ in rec.inputs]
    n_inputs = len(input_slots)

    def replay(*inputs: torch.Tensor) -> list[torch.Tensor]:
        env: dict[int, Any] = dict(zip(input_slots, inputs[:n_inputs], strict=True))
        scalars = inputs[n_inputs:]
        for (func, targs, tkwargs, outs), entry in zip(ops, entries, strict=True):
            args = tuple(recording.build(t, env, scalars) for t in targs)
            kwargs = {k: recording.build(t, env, scalars) for k, t in tkwargs}
            pin_source(entry)
            try:
                result = replay_op(func, args, kwargs)
            finally:
                pin_source(None)
            flat = result if isinstance(result, (list, tuple)) else [result]
            for slot, value in zip(outs, flat, strict=False):
                if slot is not None:
                    env[slot] = value
        return [env[slot] for slot in outputs]

    replay.__name__ = replay.__qualname__ = "virtual_device_step"
    return replay


def _outputs(rec: recording.Recording) -> list[Cell]:
    """The cells created in this recording whose tensors are still alive, once each."""
    seen: set[int] = set()
    cells = []
    for ref, cell in rec.live:
        if ref() is not None and id(cell) not in seen:
            seen.add(id(cell))
            cells.append(cell)
    return cells


def sync() -> None:
    """Run everything recorded on the virtual device since the last sync (``mark_step``).

    Example:
        >>> partita.sync()   # nothing recorded: nothing runs
    """
    pending = recording.current()
    if not pending.ops:
        return
    mesh()  # raises before the recording is taken when use_spmd was never called
    rec = recording.reset()
    assert rec is pending
    wait_in_flight()  # the previous step's values are this step's inputs
    m: Metrics = _STATE["metrics"]
    m.syncs += 1
    m.ops_recorded += len(rec.ops)
    out_cells = _outputs(rec)
    out_slots = tuple(c.slot for c in out_cells)
    described = rec.described_inputs()
    inputs = _inputs(rec)
    guide = rec.guide
    if (
        guide is not None
        and rec.repeats_guide(out_slots, described)
        # Only while its program is cached (an evicted or cleared program is compiled or read
        # from disk again, as any miss).
        and any(p is guide.program for p in _CACHE.values())
    ):
        # The fast path: the step repeated the guide's ops and inputs, so it has the guide's
        # key; nothing to hash.
        key, program = guide.key, guide.program
        m.cache_hits += 1
        m.fast_path_hits += 1
    else:
        key = (rec.key(described), out_slots, len(rec.scalars))
        program = _CACHE.get(key)
        if program is None:
            started = time.perf_counter()
            # A reason for every compilation after the first one these metrics count (the
            # cache may hold programs of earlier, unrelated loops: the first compile is not a
            # recompile).
            reason = recompile_reason(key, list(_CACHE), rec) if _CACHE and m.compiles else None
            compiles = m.compiles
            program = _compile(rec, out_cells, key, inputs)
            if reason and m.compiles > compiles:
                m.recompile_reasons.append(reason)
            m.compile_seconds += time.perf_counter() - started
        else:
            _CACHE.move_to_end(key)
            m.cache_hits += 1
    if rec.miss is not None:
        m.fast_path_misses.append(rec.miss)
        del m.fast_path_misses[:-MISSES_KEPT]
    recording.remember(rec.as_guide(out_slots, described, key, program))
    # The recording is finished: its cells leave it, and the values the step computes (its
    # results and the data it updates in place) are in flight until it has run.
    for _, value in rec.inputs:
        if isinstance(value, Cell):
            value.slot = None
            value.base.dirty = False
    for cell in out_cells:
        cell.slot, cell.in_flight = None, True
    for i in program.mutated_inputs:
        if isinstance(rec.inputs[i][1], Cell):
            rec.inputs[i][1].in_flight = True  # type: ignore[union-attr]
    run = _Run(program, inputs, out_cells, rec)
    if RUN_IN_BACKGROUND and distributed_executor(mesh()) is None:
        # Recording the next step (Python) overlaps this step's run; reading a value it
        # computes, or the next sync, waits for it.
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="partita-step"))
        run.future = _POOL[0].submit(run.execute)
        _IN_FLIGHT.append(run)
    else:
        run.execute()
        run.finish()


#: Run each step in a background thread (LocalMesh only): the next step records meanwhile.
RUN_IN_BACKGROUND = True
_POOL: list[ThreadPoolExecutor] = []
_IN_FLIGHT: list[_Run] = []


class _Run:
    """One submitted step: runs the program, then hands its values to the cells."""

    def __init__(
        self, program: StepProgram, inputs: list[Any], out_cells: list[Cell], rec: Any
    ) -> None:
        self.program, self.inputs, self.out_cells, self.rec = program, inputs, out_cells, rec
        self.future: Future[None] | None = None
        self.outputs: tuple[list[ShardedTensor], list[tuple[int, ShardedTensor]]] | None = None
        self.seconds = 0.0

    def execute(self) -> None:
        started = time.perf_counter()
        self.outputs = self.program.run(mesh(), self.inputs)
        self.seconds = time.perf_counter() - started

    def finish(self) -> None:
        """Give the cells their values (in the recording thread)."""
        mutated = [self.rec.inputs[i][1] for i in self.program.mutated_inputs]
        try:
            if self.future is not None:
                self.future.result()
        finally:
            for cell in [*self.out_cells, *mutated]:
                if isinstance(cell, Cell):
                    cell.in_flight = False
        assert self.outputs is not None
        results, updates = self.outputs
        _STATE["metrics"].run_seconds += self.seconds
        for cell, value in zip(self.out_cells, results, strict=True):
            cell.data = value
        for i, value in updates:  # in-place updates of data: the cell (the Parameter) is kept
            cell = self.rec.inputs[i][1]
            if isinstance(cell, Cell):
                cell.data = _keep_layout(cell.data, value)


def wait_in_flight() -> None:
    """Wait for the step running in the background, if any, and hand out its values."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop(0).finish()


def _keep_layout(old: Any, new: ShardedTensor) -> Any:
    """``new`` in ``old``'s layout: a tensor updated in place keeps the sharding the user gave
    it with mark_sharding, whatever the program produced (the next step's key stays the same).
    Under torch.distributed the program's layout is kept (this process holds only its shards).
    """
    old_sharding = old.sharding if isinstance(old, ShardedTensor) else None
    if type(new) is not ShardedTensor or old_sharding == new.sharding:
        return new
    if old_sharding is None:
        return new if new.sharding.is_replicated and not new.sharding.partial else new.full()
    return reshard(new, old_sharding)


def _inputs(rec: recording.Recording) -> list[Any]:
    values: list[Any] = []
    for _, value in rec.inputs:
        values.append(value.data if isinstance(value, Cell) else value)
    # The lifted floats: one tensor per dtype, split into 0-dim views (a step of AdamW's foreach
    # kernels lifts about 70; one torch.tensor each cost 0.6 ms more per step).
    scalars: list[Any] = [None] * len(rec.scalars)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(rec.scalar_dtypes):
        by_dtype.setdefault(dtype, []).append(i)
    for dtype, where in by_dtype.items():
        packed = torch.tensor([rec.scalars[i] for i in where], dtype=dtype)
        for i, value in zip(where, packed.unbind(0), strict=True):
            scalars[i] = value
    return values + scalars


def _compile(
    rec: recording.Recording, out_cells: list[Cell], key: Hashable, inputs: list[Any]
) -> StepProgram:
    m: Metrics = _STATE["metrics"]
    # Under torch.distributed every rank compiles (the executor checks the programs agree).
    local = distributed_executor(mesh()) is None
    program = disk_cache.load(key, mesh()) if local else None
    if program is not None:
        m.disk_hits += 1
    else:
        replay = _replay_fn(rec, [c.slot for c in out_cells])  # type: ignore[misc]
        program = compile_step(replay, inputs, mesh())
        m.compiles += 1
        disk_cache.save(key, mesh(), program)
    _CACHE[key] = program
    if len(_CACHE) > CACHE_LIMIT:
        _CACHE.popitem(last=False)
    return program
