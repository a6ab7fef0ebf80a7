"""Reference models for tests, examples and benchmarks.

Plain ``nn.Module`` code with no partita inside: these are the programs a user would write for
one device. The training machinery that turns a model into a step partita traces is
:mod:`partita.training`. This package does not shard anything.
"""

from __future__ import annotations

import warnings
from typing import Any

from partita.models.cnn import SmallCNN
from partita.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "SmallCNN"]

_MOVED = {"init_opt_state", "make_train_step"}


def __getattr__(name: str) -> Any:
    """``partita.models.init_opt_state`` / ``make_train_step``: deprecated, in
    :mod:`partita.training` now."""
    if name in _MOVED:
        warnings.warn(
            f"partita.models.{name} moved to partita.training.{name}; import it from there.",
            DeprecationWarning,
            stacklevel=2,
        )
        import partita.training

        return getattr(partita.training, name)
    raise AttributeError(f"module 'partita.models' has no attribute {name!r}")
