"""Deprecated alias: the training machinery moved to :mod:`partita.training`.

Reading a name of this module (``partita.models.steps.init_opt_state``) warns with a
DeprecationWarning and returns :mod:`partita.training.optim`'s; setting one (a test wrapping
``_adam``) sets it there, so code written against the old module keeps working.
``functional_step`` and ``make_train_step`` are in :mod:`partita.training`.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

from partita.training import optim, step


def _owner(name: str) -> types.ModuleType | None:
    if name.startswith("__"):
        return None
    return next((m for m in (optim, step) if hasattr(m, name)), None)


class _Moved(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        owner = _owner(name)
        if owner is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"partita.models.steps.{name} moved to {owner.__name__}.{name}; import it from "
            "there (partita.models holds reference models only).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(owner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        owner = _owner(name)
        setattr(owner if owner is not None else super(), name, value)


sys.modules[__name__].__class__ = _Moved
