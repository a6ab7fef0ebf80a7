"""Pause Python's cyclic garbage collector while a compile stage builds its graphs.

Why. Tracing and partitioning allocate hundreds of thousands of small objects (fx nodes, fake
tensors, metadata dicts) that all stay alive until the stage returns. Each allocation burst
triggers the cyclic collector, whose full collections walk every live object of the process
(the model, its optimizer state, earlier programs): on the GPT-M training step they cost
0.3-0.5 s of a 6 s trace, more in a process that holds more (a second compile in the same
process pays more than the first). Nothing a stage builds is garbage before it returns, so
collecting during it finds little; reference counting still frees everything acyclic.

:func:`gc_paused` disables the collector for the duration and restores the previous state
(nested uses are no-ops); the collector then runs as usual on the next allocations.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (restored on exit).

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
