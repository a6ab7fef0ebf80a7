"""Give the memory a process freed back to the operating system, once, after a compile.

Compiling a program (capture, propagation, partitioning, the plan) and its first run on a
DistributedMesh (``runtime.overlap.first_run``) allocate and free many objects and tensors.
glibc's ``malloc`` keeps most of what was freed resident: the heap only shrinks from its top,
and after a large block is freed its threshold for serving large blocks by ``mmap`` rises, so
later tensors come from the heap too. On the 4-process GPT step that was about 100 MB per
rank of freed memory still resident (``VmRSS`` 467 MB, 362 MB after ``malloc_trim``), which
the step's own allocations then stacked on (``bench/bench_distributed.py``: the ``peak RSS``
and ``step RSS`` columns; docs/performance.md).

:func:`release_freed` collects Python's garbage and calls ``malloc_trim(0)``, which returns
the free pages of every arena to the system. It costs a few milliseconds and runs once per
compiled program (before and after its first run), never in a step. Elsewhere than glibc it
only collects garbage.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

__all__ = ["release_freed"]

_TRIM: list[Any] = []


def _malloc_trim() -> Any:
    if not _TRIM:
        try:
            _TRIM.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):  # not glibc
            _TRIM.append(None)
    return _TRIM[0]


def release_freed() -> bool:
    """Collect garbage and return the freed heap to the system; whether malloc_trim ran."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
