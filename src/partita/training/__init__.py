"""Training: ``partita.train_step`` and the machinery behind it, in one package.

``train``: :func:`train_step` and the :class:`TrainStep` it returns, which owns the sharded
training state and runs forward, backward and the update as one program compiled by
``partita.jit``. Beside it, each concern of that object: ``checks`` (the batch, the optimizer,
the arguments), ``state`` (the checkpoint layout: tied names, optimizer indices, atomic
loading), ``memory`` (the state's sizes), ``snapshot`` (what was read when the step was built,
checked on each call), ``groups`` (parameter groups' hyperparameters as data). The pure
functions a step is made of: ``optim`` (the torch.optim updates as tensor ops,
:func:`init_opt_state`, :func:`optimizer_config`) and ``step`` (:func:`functional_step`, what
``train_step`` compiles, and :func:`make_train_step`, the same with a fixed learning rate and
no state of its own, for a user who drives ``partita.jit`` directly).
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
from partita.training.train import LoadResult, TrainStep, train_step

__all__ = [
    "OPTIMIZERS",
    "LoadResult",
    "OptimizerConfig",
    "TrainStep",
    "clip_by_global_norm",
    "functional_step",
    "init_opt_state",
    "make_train_step",
    "optimizer_config",
    "train_step",
]
