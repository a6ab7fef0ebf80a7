"""The training machinery behind ``partita.train_step``: a model, a loss and an optimizer as
one pure function of tensors that partita can trace.

``optim``: the torch.optim updates (AdamW, Adam, SGD) as tensor ops, :func:`init_opt_state`,
:func:`optimizer_config`; ``step``: :func:`functional_step` (what ``train_step`` compiles) and
:func:`make_train_step` (the same with a fixed learning rate, for ``partita.jit``). The
``TrainStep`` object that owns the sharded state is :mod:`partita.train`.
"""

from __future__ import annotations

from partita.training.optim import (
    OPTIMIZERS,
    OptimizerConfig,
    clip_by_global_norm,
    init_opt_state,
    optimizer_config,
)
from partita.training.step import functional_step, make_train_step

__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "clip_by_global_norm",
    "functional_step",
    "init_opt_state",
    "make_train_step",
    "optimizer_config",
]
