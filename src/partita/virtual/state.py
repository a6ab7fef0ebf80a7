"""The virtual device's state: one :class:`DeviceState`, made on first use, reset for tests.

Everything the device remembers between ops lives here: the mesh, the recording being made and
the guides of the fast path, the compiled programs, the counters, the draws recorded since the
last sync, the steps running in the background, and what registering the device with torch
left (kept alive: dropping a ``torch.library.Library`` deregisters its kernels). The other
modules of :mod:`partita.virtual` read and write it through :func:`get`; this module is the
bottom of the package and imports none of them.

Threads: one thread records at a time: each op is recorded, and each sync takes the
recording, under :data:`DEVICE` (a sync started inside ``__torch_dispatch__`` runs in a helper
thread while that thread waits, handing it the lock). The background step thread only runs the
program it was handed and reads :attr:`DeviceState.mesh`; one thread at a time hands out the
values of the steps it ran (:meth:`DeviceState.wait_in_flight`). Making the instance takes a
lock, so two threads asking at once get the same one.

Op metadata memos (:mod:`partita.virtual.shapes`, :mod:`partita.virtual.lift`) are not here:
they depend only on torch's op schemas, never on what the device did.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from partita.values.mesh import Mesh
from partita.virtual.metrics import Metrics

__all__ = [
    "DEVICE",
    "DEVICE_NAME",
    "DeviceState",
    "Registration",
    "device_released",
    "existing",
    "get",
    "next_serial",
    "reset",
]

#: The name of the virtual device (``torch.device("spmd", 0)``).
DEVICE_NAME = "spmd"

#: Held while an op is recorded and while a sync takes the recording: the device records one
#: step for the whole process, so ops from several threads (two threads training their own
#: models, autograd's backward thread) go into it one at a time, never while a sync takes it.
DEVICE = threading.RLock()
#: Held while the values of finished steps are handed out (:meth:`DeviceState.wait_in_flight`).
_FINISHING = threading.RLock()


@dataclass
class Registration:
    """What registering the device with torch left: the Python kernels' callables and the
    ``torch.library`` objects holding them (process-global; never undone), and whether a
    ``backward()`` can run on the device (not when the process ran one before registering)."""

    factory: Callable[..., torch.Tensor]
    wrap: Callable[..., torch.Tensor]
    libraries: list[torch.library.Library] = field(default_factory=list)
    backward_runs: bool = True


@dataclass
class DeviceState:
    """The virtual device's state (one per process: :func:`get`).

    Attributes:
        registration: set once the device is registered with torch (:mod:`device`).
        active: ``use_spmd`` switched the device on (torch's accelerator hooks ask).
        mesh: the mesh the programs run on (``use_spmd`` sets it).
        metrics: the counters ``partita.metrics()`` returns.
        programs: compiled programs by structural key, least recently used first.
        last_sync: the step the last sync ran (a ``step.LastSync``).
        last_program: the program of the step run last (a sync's or a ``partita.compile``
            replay's; a ``program.StepProgram``).
        epoch: numbers recordings; a cell's slot is valid in the recording of its epoch.
        recording: the recording being made (a ``recording.Recording``), None between steps.
        last_guide: the guide of the step run last.
        guides: the guide that followed each program last, by ``id(program)``: (program,
            guide), the program held so that its id names no other program.
        fast_path: check recordings against their guide (False records every step in full).
        draws_pending, draws_seen, draw_keys: the random ops recorded since the last sync
            (:mod:`partita.virtual.draws`).
        uploads: per compiled call being recorded, the CPU tensors copied into device tensors.
        copying: ``copy.deepcopy`` is copying a device tensor.
        run_in_background: run each step in a background thread (LocalMesh only).
        in_flight: submitted steps not finished yet, oldest first (each has ``finish()``).
        pool: the background thread.
        serials: numbers the cells in creation order.
    """

    registration: Registration | None = None
    active: bool = False
    mesh: Mesh | None = None
    metrics: Metrics = field(default_factory=Metrics)
    programs: OrderedDict[Hashable, Any] = field(default_factory=OrderedDict)
    last_sync: Any = None
    last_program: Any = None
    epoch: int = 0
    recording: Any = None
    last_guide: Any = None
    guides: dict[int, Any] = field(default_factory=dict)
    fast_path: bool = True
    draws_pending: int = 0
    draws_seen: dict[Any, Any] = field(default_factory=dict)
    draw_keys: set[Any] = field(default_factory=set)
    uploads: list[list[tuple[torch.Tensor | None, Any]]] = field(default_factory=list)
    copying: bool = False
    run_in_background: bool = True
    in_flight: list[Any] = field(default_factory=list)
    pool: ThreadPoolExecutor | None = None
    serials: itertools.count[int] = field(default_factory=itertools.count)
    #: ``use_spmd(mesh, auto=True)``: unannotated replicated inputs are auto-sharding's
    auto: bool = False
    #: The one instance (:func:`get`).
    instance: ClassVar[DeviceState | None] = None

    def wait_in_flight(self) -> None:
        """Wait for the steps running in the background, if any, and hand out their values."""
        # One thread hands the values out; another thread reading a value meanwhile waits for it
        # here (else it could find the run taken off the list and its cells not filled yet).
        with _FINISHING:
            while self.in_flight:
                self.in_flight.pop(0).finish()

    def reset(self) -> None:
        """Forget everything but what cannot be undone (for tests): waits for running steps,
        then drops the mesh, recording, guides, programs and counters. The registration stays,
        and the epoch and cell numbers keep growing (cells made before stay valid)."""
        self.wait_in_flight()
        epoch, serials = self.epoch, self.serials
        fresh = DeviceState(registration=self.registration, active=self.active, pool=self.pool)
        for name in fresh.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))
        self.epoch, self.serials = epoch, serials


_LOCK = threading.Lock()


def get() -> DeviceState:
    """The device's state, made on first use (``use_spmd`` is the first user)."""
    state = DeviceState.instance
    if state is None:
        with _LOCK:
            if DeviceState.instance is None:
                DeviceState.instance = DeviceState()
            state = DeviceState.instance
    return state


def existing() -> DeviceState | None:
    """The device's state if something made it, else None (without making it)."""
    return DeviceState.instance


def reset() -> None:
    """Reset the device's state for a test (see :meth:`DeviceState.reset`)."""
    if DeviceState.instance is not None:
        DeviceState.instance.reset()


def next_serial() -> int:
    """A number above every cell's ``serial`` so far (cells made later have higher ones)."""
    return next(get().serials)


@contextlib.contextmanager
def device_released() -> Iterator[None]:
    """Let go of :data:`DEVICE` inside the block, however deep this thread holds it, and take it
    back after (a thread waiting for another thread that records or syncs)."""
    held = DEVICE._release_save()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        DEVICE._acquire_restore(held)  # type: ignore[attr-defined]
