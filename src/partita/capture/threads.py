"""Threads: one trace at a time in the process, and the calls of one object in turn.

``make_fx`` keeps process-global state: ``torch.fx`` patches module globals through one
``CURRENT_PATCHER``, so two threads tracing at once corrupt each other's trace (the second
fails with ``AssertionError: CURRENT_PATCHER is None``, reported as the user function's
CaptureError). Every ``make_fx`` of partita runs under :data:`TRACING`; other threads keep
running programs meanwhile. :func:`serialized` makes the calls of one ``partita.jit`` or
``partita.train_step`` object run one at a time. This module imports nothing of partita.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TRACING", "serialized"]

#: Held while a function is traced (reentrant: a trace may trace inside, e.g. a shard_map).
TRACING = threading.RLock()


def serialized(*names: str) -> Callable[[type], type]:
    """A class decorator: the methods ``names`` of one object run under one lock of that
    object (made at its first call), so calls from several threads run in turn, each on the
    state the previous one left (``partita.jit``, ``partita.train_step``)."""

    def locked(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            lock = vars(self).get("_calls") or vars(self).setdefault("_calls", threading.RLock())
            with lock:
                return method(self, *args, **kwargs)

        return run

    def wrap(cls: type) -> type:
        for name in names:
            setattr(cls, name, locked(getattr(cls, name)))
        return cls

    return wrap
