"""Pause Python's cyclic garbage collector while a compile stage builds its graphs.

Why. Tracing and partitioning allocate hundreds of thousands of small objects (fx nodes, fake
tensors, metadata dicts) that all stay alive until the stage returns. Each allocation burst
triggers the cyclic collector, whose full collections walk every live object of the process
(the model, its optimizer state, earlier programs): on the GPT-M training step they cost
0.3-0.5 s of a 6 s trace, more in a process that holds more (a second compile in the same
process pays more than the first). Nothing a stage builds is garbage before it returns, so
collecting during it finds little; reference counting still frees everything acyclic.

:func:`gc_paused` disables the collector for the duration and restores the previous state
(nested uses, in any thread, are counted: the last one out restores it); the collector then
runs as usual on the next allocations.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]


_LOCK = threading.Lock()
_DEPTH = [0]  # blocks open in any thread: the first restores nothing, the last restores all
_WAS_ENABLED = [False]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (restored on exit).

    The collector is process-wide, so the blocks of all threads count together: the collector
    comes back when the last open block exits, in whichever thread.

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    with _LOCK:
        if _DEPTH[0] == 0:
            _WAS_ENABLED[0] = gc.isenabled()
        _DEPTH[0] += 1
        gc.disable()
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0 and _WAS_ENABLED[0]:
                gc.enable()
