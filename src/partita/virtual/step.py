"""``sync()``: cut the recording, find or compile its program, run it, materialise the results.

The program of a recording is a replay function: it runs the recorded ops again, in order, on
its inputs (data cells, copied CPU tensors, lifted floats) and returns the values of the
recorded tensors still alive. :func:`partita.jit` compiles it through the ordinary pipeline
(capture traces the replay into a functional graph, in-place updates of data become input
updates; propagation; partitioning; the LocalMesh, or torch.distributed when it is up), so
annotations from ``mark_sharding`` and the input shardings decide every other sharding.

On the LocalMesh the run is submitted to a background thread and ``sync`` returns: the next
step records meanwhile, its values are *in flight* (reading one, or the next sync, waits).
Under torch.distributed the run happens before ``sync`` returns. Whether steps run in the
background is ``DeviceState.run_in_background`` (:mod:`partita.virtual.state`).

Programs are cached by the recording's structural key (:meth:`Recording.key`): a cache hit
builds no fx graph, and a step that repeated its guide op by op (the fast path, see
:class:`~partita.virtual.recording.Guide`) takes the guide's program without hashing its key.
:func:`metrics` counts compilations, hits and fast-path steps, and keeps, per compilation after
the first, one line saying what changed since the closest cached program, and per step that
left the fast path the first op or input that differed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from partita.capture.source import pin_source
from partita.errors import InternalError, RecompileWarning, VirtualDeviceError, warn
from partita.frontend.recompile import RECOMPILE_WARNING_AT
from partita.frontend.reshard import reshard
from partita.options import CompileOptions
from partita.options import current as current_options
from partita.runtime.distributed import distributed_executor
from partita.values.mesh import Mesh
from partita.values.tensor import ShardedTensor
from partita.virtual import disk_cache, recording, state
from partita.virtual.auto_inputs import open_inputs_of
from partita.virtual.cell import Cell
from partita.virtual.lift import replay_op
from partita.virtual.metrics import MISSES_KEPT, Metrics
from partita.virtual.program import StepProgram, compile_step
from partita.virtual.sources import stack_entries
from partita.virtual.why import recompile_reason, recompile_warning

__all__ = [
    "LastSync",
    "Metrics",
    "current_mesh",
    "last_sync",
    "mesh",
    "metrics",
    "set_mesh",
    "submit",
    "sync",
    "wait_in_flight",
]

CACHE_LIMIT = 64


@dataclass
class LastSync:
    """The step the last :func:`sync` ran, for :mod:`partita.virtual.compiled` to capture.

    Attributes:
        rec: its recording (inputs, lifted floats, ops and their sources).
        key, program: its structural key and compiled program.
        inputs: the values it ran on (the inputs' data, then the lifted floats as tensors).
        out_cells: the cells of its results (the tensors alive at the sync).
    """

    rec: recording.Recording
    key: Hashable
    program: StepProgram
    inputs: list[Any]
    out_cells: list[Cell]


def set_mesh(mesh: Mesh) -> None:
    """The mesh the virtual device's programs run on (``use_spmd`` sets it). Work recorded
    and not yet run belongs to the mesh it was recorded on: it runs there first, as a step of
    its own, and is not compiled into the new mesh's next step."""
    device = state.get()
    if device.mesh is not None and device.mesh != mesh:
        sync()
        device.programs.clear()
        recording.forget_guides()
    device.mesh = mesh


def current_mesh() -> Mesh | None:
    """The virtual device's mesh, or None before ``use_spmd``."""
    device = state.existing()
    return None if device is None else device.mesh


def mesh() -> Mesh:
    """The virtual device's mesh (raises when ``use_spmd`` was not called)."""
    m = current_mesh()
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
    device = state.get()
    m = device.metrics
    if reset:
        device.metrics = Metrics()
    return m


def last_sync() -> LastSync | None:
    """The step the last :func:`sync` ran (None before the first)."""
    device = state.existing()
    return None if device is None else device.last_sync


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
    device = state.existing()
    if device is None or device.recording is None:
        return  # nothing recorded (or use_spmd never called)
    with state.DEVICE:  # no op is recorded from another thread while the recording is taken
        if device.recording is not None:  # not taken by another thread's sync meanwhile
            _sync(device)


def _sync(device: state.DeviceState) -> None:
    pending = recording.current()
    if not pending.ops:
        return
    mesh()  # raises before the recording is taken when use_spmd was never called
    rec = recording.reset()
    if rec is not pending:
        raise InternalError(
            f"partita.sync: the recording changed while it was being taken. {InternalError.REPORT}"
        )
    device.wait_in_flight()  # the previous step's values are this step's inputs
    m: Metrics = device.metrics
    cache = device.programs
    m.syncs += 1
    m.ops_recorded += len(rec.ops)
    out_cells = _outputs(rec)
    out_slots = tuple(c.slot for c in out_cells)
    described = rec.described_inputs()
    inputs = _inputs(rec)
    guide = rec.guide
    options = current_options()
    if (
        guide is not None
        and guide.key[-1] == options.key()  # the options are part of the key
        and rec.repeats_guide(out_slots, described)
        # Only while its program is cached (an evicted or cleared program is compiled or read
        # from disk again, as any miss).
        and any(p is guide.program for p in cache.values())
    ):
        # The fast path: the step repeated the guide's ops and inputs, so it has the guide's
        # key; nothing to hash.
        key, program = guide.key, guide.program
        m.cache_hits += 1
        m.fast_path_hits += 1
    else:
        key = (rec.key(described), out_slots, len(rec.scalars), options.key())
        program = cache.get(key)
        if program is None:
            started = time.perf_counter()
            # A reason for every compilation after the first one these metrics count (the
            # cache may hold programs of earlier, unrelated loops: the first compile is not a
            # recompile).
            reason = recompile_reason(key, list(cache), rec) if cache and m.compiles else None
            compiles = m.compiles
            program = _compile(rec, out_cells, key, inputs, options)
            if reason and m.compiles > compiles:
                m.recompile_reasons.append(reason)
            m.compile_seconds += time.perf_counter() - started
            if m.compiles == RECOMPILE_WARNING_AT > compiles:  # once per metrics window
                text = recompile_warning(
                    m.compiles, m.recompile_reasons, m.compile_seconds, m.run_seconds
                )
                warn(text, RecompileWarning)
        else:
            cache.move_to_end(key)
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
        cell.slot = None
    device.last_sync = LastSync(rec, key, program, inputs, out_cells)
    submit(program, inputs, out_cells, [value for _, value in rec.inputs])


def submit(
    program: StepProgram, inputs: list[Any], out_cells: list[Cell], input_cells: list[Any]
) -> None:
    """Run ``program`` on ``inputs``: in the background on the LocalMesh, else now.

    ``out_cells`` get its results; ``input_cells[i]`` (a Cell, or anything else for an input
    that is not a device value) gets the new value of input ``i`` when the step updates it in
    place. Until the run finishes these cells are in flight (reading one waits).
    """
    for cell in out_cells:
        cell.in_flight = True
    for i in program.mutated_inputs:
        if isinstance(input_cells[i], Cell):
            input_cells[i].in_flight = True
    run = _Run(program, inputs, out_cells, input_cells)
    device = state.get()
    device.last_program = program  # partita.last_plan() (partita.virtual.plans)
    # A step that draws random numbers runs now: in the background its draws would take the
    # CPU generator from whatever the Python thread draws meanwhile (the next batch's
    # torch.randn), not from where eager PyTorch takes them.
    background = device.run_in_background and distributed_executor(mesh()) is None
    if background and not program.draws_random:
        # Recording the next step (Python) overlaps this step's run; reading a value it
        # computes, or the next sync, waits for it.
        if device.pool is None:
            device.pool = ThreadPoolExecutor(1, thread_name_prefix="partita-step")
        run.future = device.pool.submit(run.execute)
        device.in_flight.append(run)
    else:
        run.execute()
        run.finish()


class _Run:
    """One submitted step: runs the program, then hands its values to the cells."""

    def __init__(
        self, program: StepProgram, inputs: list[Any], out_cells: list[Cell], input_cells: list[Any]
    ) -> None:
        self.program, self.inputs, self.out_cells = program, inputs, out_cells
        self.input_cells = input_cells
        self.future: Future[None] | None = None
        self.outputs: tuple[list[ShardedTensor], list[tuple[int, ShardedTensor]]] | None = None
        self.seconds = 0.0

    def execute(self) -> None:
        started = time.perf_counter()
        self.outputs = self.program.run(mesh(), self.inputs)
        self.seconds = time.perf_counter() - started

    def finish(self) -> None:
        """Give the cells their values (in the recording thread)."""
        mutated = [self.input_cells[i] for i in self.program.mutated_inputs]
        try:
            if self.future is not None:
                self.future.result()
        finally:
            for cell in [*self.out_cells, *mutated]:
                if isinstance(cell, Cell):
                    cell.in_flight = False
        assert self.outputs is not None
        results, updates = self.outputs
        state.get().metrics.run_seconds += self.seconds
        for cell, value in zip(self.out_cells, results, strict=True):
            cell.data = value
        for i, value in updates:  # in-place updates of data: the cell (the Parameter) is kept
            cell = self.input_cells[i]
            if isinstance(cell, Cell):
                cell.data = _keep_layout(cell.data, value)


def wait_in_flight() -> None:
    """Wait for the step running in the background, if any, and hand out its values."""
    device = state.existing()
    if device is not None:
        device.wait_in_flight()


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
    rec: recording.Recording,
    out_cells: list[Cell],
    key: Hashable,
    inputs: list[Any],
    options: CompileOptions,
) -> StepProgram:
    device = state.get()
    m: Metrics = device.metrics
    # Under torch.distributed every rank compiles (the executor checks the programs agree).
    local = distributed_executor(mesh()) is None
    open_inputs = open_inputs_of(rec) if device.auto else None
    program = disk_cache.load(key, mesh()) if local and not open_inputs else None
    if program is not None:
        program.options = options  # the key it was found by holds options.key()
        m.disk_hits += 1
    else:
        replay = _replay_fn(rec, [c.slot for c in out_cells])  # type: ignore[misc]
        program = compile_step(replay, inputs, mesh(), options, open_inputs)
        m.compiles += 1
        if not open_inputs:
            disk_cache.save(key, mesh(), program)
    device.programs[key] = program
    if len(device.programs) > CACHE_LIMIT:
        device.programs.popitem(last=False)
    return program
