"""Which repeated layers become one loop (``partita.scan_layers(..., loop=True)``): the marked
modules, and the keys of the forward parts traced from them (``capture.layer_loop``)."""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["LOOPED", "LOOP_KEYS"]

#: modules whose chains of calls become one scan
LOOPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: the layer_call keys of their forward parts (keys are never reused in a process)
LOOP_KEYS: set[int] = set()
