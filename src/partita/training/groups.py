"""Parameter groups: each group of a torch.optim optimizer updated with its own hyperparameters.

torch.optim lets every parameter group carry its own ``lr``, ``weight_decay``, ``betas``,
``momentum``...; the usual split puts weight decay on the matrices and none on the biases and
norms (nanoGPT's ``configure_optimizers``, the Hugging Face ``Trainer``). ``train_step`` reads
each group's hyperparameters once (:func:`read_param_groups`), keeps one step counter and one
set of optimizer states (sharded like their parameters) and runs each group's update on its own
parameters (:meth:`ParamGroups.update`). The hyperparameters a scheduler moves are data, read
from ``optimizer.param_groups[i]`` at every call (:func:`group_hyperparameters`): ``lr``,
``weight_decay`` (DINO-style schedules set it), and ``betas`` (Adam) or ``momentum`` (SGD),
which OneCycleLR and CyclicLR cycle against the rate;
each a float64 tensor with one entry per group, so a scheduler that sets different values per
group works unchanged.

Every group must be of the same optimizer (one ``torch.optim`` object); the parameter order of
the optimizer (group by group) is the index order of ``optimizer.state_dict()``
(:func:`optimizer_params`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from partita.training.optim import OptimizerConfig, group_config

__all__ = [
    "RESTORED_KEYS",
    "ParamGroups",
    "group_hyper_values",
    "group_hyperparameters",
    "optimizer_params",
    "read_param_groups",
]

#: What loading a checkpoint restores into each optimizer group, as ``torch.optim`` does: the
#: hyperparameters the step reads per call, and the scheduler's ``initial_lr``.
RESTORED_KEYS = ("lr", "initial_lr", "betas", "momentum", "weight_decay")

Tensors = dict[str, torch.Tensor]
Update = Callable[
    [Tensors, Tensors, dict[str, Any], Any, OptimizerConfig], tuple[Tensors, dict[str, Any]]
]


@dataclass(frozen=True)
class ParamGroups:
    """The hyperparameters of each group and the parameters (by name) it holds, in order."""

    configs: tuple[OptimizerConfig, ...]
    members: tuple[tuple[str, ...], ...]

    @property
    def kind(self) -> str:
        """The optimizer (``adamw``, ``adam``, ``sgd``): the same for every group."""
        return self.configs[0].kind

    def update(
        self, update: Update, params: Tensors, grads: Tensors, state: dict[str, Any], hyper: Any
    ) -> tuple[Tensors, dict[str, Any]]:
        """Run ``update`` (``optim._adam`` or ``optim._sgd``) group by group, each on its own
        parameters, states, config and hyperparameters (entry ``[group]`` of each tensor of
        ``hyper``); parameters in no group keep their values and states (torch.optim does not
        know them)."""
        new_params = dict(params)
        new_state = {k: v if k == "step" else dict(v) for k, v in state.items()}
        for index, (cfg, names) in enumerate(zip(self.configs, self.members, strict=True)):
            if not names:
                continue
            sub_state = {
                k: v if k == "step" else {n: v[n] for n in names} for k, v in state.items()
            }
            sub_grads = {n: grads[n] for n in names if n in grads}
            group_hyper = (
                {k: _entry(v, index) for k, v in hyper.items()}
                if isinstance(hyper, dict)
                else _entry(hyper, index)
            )
            group_params, group_state = update(
                {n: params[n] for n in names}, sub_grads, sub_state, group_hyper, cfg
            )
            new_params.update(group_params)
            for key, value in group_state.items():
                if key == "step":  # the same counter, advanced once per step in every group
                    new_state["step"] = value
                else:
                    new_state[key].update(value)
        if all(not names for names in self.members):
            new_state["step"] = state["step"] + 1
        return new_params, new_state


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer holds, group after group: index ``i`` of its state dict."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def read_param_groups(
    optimizer: torch.optim.Optimizer, names: dict[int, str], trainable: set[str]
) -> ParamGroups:
    """Each group's config and its trainable parameters' names (``names``: ``id(param)`` ->
    name). Frozen parameters an optimizer holds are left out: they get no gradient."""
    configs = tuple(group_config(optimizer, group) for group in optimizer.param_groups)
    members = tuple(
        tuple(names[id(p)] for p in group["params"] if names.get(id(p)) in trainable)
        for group in optimizer.param_groups
    )
    return ParamGroups(configs, members)


def _entry(value: Any, index: int) -> Any:
    return value[index] if isinstance(value, torch.Tensor) and value.ndim == 1 else value


def group_hyperparameters(optimizer: torch.optim.Optimizer, kind: str) -> dict[str, torch.Tensor]:
    """The hyperparameters a scheduler may move, now: ``lr``, ``weight_decay``, and ``beta1`` and
    ``beta2`` (Adam) or ``momentum`` (SGD); each 0-d for one group, else one entry per group
    (float64).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
        >>> group_hyperparameters(opt, "sgd")["momentum"]
        tensor(0.9000, dtype=torch.float64)
    """
    return {
        key: torch.tensor(values[0] if len(values) == 1 else values, dtype=torch.float64)
        for key, values in group_hyper_values(optimizer, kind).items()
    }


def group_hyper_values(optimizer: torch.optim.Optimizer, kind: str) -> dict[str, list[float]]:
    """What :func:`group_hyperparameters` makes tensors of: one float per group and name."""
    groups = optimizer.param_groups
    columns = {key: [float(g[key]) for g in groups] for key in ("lr", "weight_decay")}
    if kind == "sgd":
        columns["momentum"] = [float(g["momentum"]) for g in groups]
    else:
        columns["beta1"] = [float(g["betas"][0]) for g in groups]
        columns["beta2"] = [float(g["betas"][1]) for g in groups]
    return columns
