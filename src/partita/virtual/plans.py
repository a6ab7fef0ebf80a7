"""The Plan of the step the virtual device ran last: :func:`last_plan` (``partita.last_plan``).

:func:`partita.virtual.step.submit` keeps the program of every step it runs, a sync's or a
``partita.compile`` replay's, in :attr:`~partita.virtual.state.DeviceState.last_program`; this
module only reads it.
"""

from __future__ import annotations

from partita.errors import VirtualDeviceError
from partita.partition import Plan
from partita.virtual import state

__all__ = ["last_plan"]


def last_plan() -> Plan:
    """The :class:`~partita.Plan` of the step the device ran last (a ``sync``'s, or a
    ``partita.compile`` step's replay): its shardings, collectives and memory.
    ``last_plan().explain()`` prints it as ``partita.jit(...).explain()`` does.

    Raises VirtualDeviceError before the first step, and when that step's program was read
    from the persistent compile cache (which keeps the per-device program, not its Plan).

    Example:
        >>> dev = partita.use_spmd(Mesh.create((2, 4), ("data", "model")))
        >>> (torch.ones(8, 4, device=dev) * 2).sum().item()
        64.0
        >>> partita.last_plan().collectives  # doctest: +SKIP
    """
    device = state.existing()
    program = None if device is None else device.last_program
    if program is None:
        raise VirtualDeviceError(
            "partita.last_plan(): the virtual device has run no step yet in this process. "
            "Record a step and run it first (partita.sync(), .item() or .cpu() on a result), "
            "then ask for its Plan."
        )
    if program.compiled is None:
        raise VirtualDeviceError(
            "partita.last_plan(): the last step's program was read from the persistent compile "
            "cache (use_spmd(cache_dir=...) / PARTITA_COMPILE_CACHE), which keeps the "
            "per-device program but not its Plan. Run once without the cache to see the Plan."
        )
    return program.compiled.plan
