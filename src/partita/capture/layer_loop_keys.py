"""Which repeated layers become one loop (``partita.scan_layers(..., loop=True)``): the marked
modules with the list they belong to, and the keys of the forward parts traced from them
(``capture.layer_loop``)."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["LOOPED", "LOOP_KEYS", "LoopGroup"]


class LoopGroup:
    """The layers of one ``scan_layers(layers, loop=True)`` call, in order (held weakly), and
    the stacked tensors their parameters are views of (``capture.layer_stack``)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._refs = [weakref.ref(m) for m in modules]
        self.index = weakref.WeakKeyDictionary({m: i for i, m in enumerate(modules)})
        self.stacks: dict[str, Any] = {}  # name -> the stacked tensor the layers' tensors view

    def modules(self) -> list[nn.Module] | None:
        """The layers in order (None once one of them is gone)."""
        out = [r() for r in self._refs]
        return None if any(m is None for m in out) else out  # type: ignore[return-value]


#: modules whose chains of calls become one scan, each with its list of layers
LOOPED: weakref.WeakKeyDictionary[nn.Module, LoopGroup] = weakref.WeakKeyDictionary()
#: the layer_call keys of their forward parts (keys are never reused in a process)
LOOP_KEYS: set[int] = set()
