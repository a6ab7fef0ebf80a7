"""What ``train_step`` read from the model and the optimizer when it was built, checked on each
call.

A :class:`~partita.training.train.TrainStep` copies the parameters and the optimizer's
hyperparameters once and owns the training state from then on (only what a scheduler moves is
read per call: each group's ``lr``, ``betas``, and a nonzero ``momentum`` or ``weight_decay``).
Changes a PyTorch loop would see at the next ``optimizer.step()`` would otherwise be ignored
silently: a parameter frozen or unfrozen (``requires_grad``), a hyperparameter edited in
``param_groups`` (weight decay, betas, momentum), the module's parameters written in place
(``model.load_state_dict``, an in-place re-initialisation) or replaced by other tensors
(``model.fc.weight = nn.Parameter(...)``). :class:`BuildSnapshot` notices them
with a few Python reads per parameter and says what to do instead. This module does not trace or
run anything.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.errors import TrainInputError

__all__ = ["BuildSnapshot"]

#: Group keys the step reads per call, or that a scheduler adds (not compared).
_PER_CALL = frozenset({"params", "lr", "initial_lr", "betas", "max_lr", "min_lr",
                       "max_momentum", "base_momentum"})  # fmt: skip


@dataclass(frozen=True)
class BuildSnapshot:
    """Each parameter (a weak reference: a version counter is the tensor's own, so it says
    nothing once another tensor took the name), its ``requires_grad`` and version counter,
    and each group's hyperparameters, as the step read them."""

    params: dict[str, tuple[weakref.ref[torch.Tensor], bool, int]]
    groups: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> BuildSnapshot:
        return cls(
            {k: (weakref.ref(p), p.requires_grad, p._version) for k, p in model.named_parameters()},
            tuple(_hyperparameters(g) for g in optimizer.param_groups),
        )

    def check(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise a TrainInputError naming what changed since the step was built."""
        for name, p in model.named_parameters():
            before = self.params.get(name)
            if before is None:
                continue
            ref, requires_grad, version = before
            if ref() is p and requires_grad == p.requires_grad and version == p._version:
                continue
            if ref() is not p:
                what = (
                    f"parameter {name!r} of the module was replaced by another tensor (a new "
                    f"nn.Parameter or submodule assigned, or load_state_dict(assign=True))"
                )
            elif requires_grad != p.requires_grad:
                what = (
                    f"parameter {name!r} was {'frozen' if requires_grad else 'unfrozen'} "
                    f"(requires_grad {requires_grad} -> {p.requires_grad})"
                )
            else:
                what = (
                    f"parameter {name!r} of the module was written in place (by "
                    f"model.load_state_dict, an initialisation or an optimizer of its own)"
                )
            raise TrainInputError(_message(what))
        for i, (before_group, group) in enumerate(
            zip(self.groups, optimizer.param_groups, strict=False)
        ):
            now = _hyperparameters(group)
            changed = sorted(k for k in before_group.keys() | now.keys()
                             if before_group.get(k) != now.get(k))  # fmt: skip
            if changed:
                values = ", ".join(
                    f"{k} {before_group.get(k)!r} -> {now.get(k)!r}" for k in changed
                )
                raise TrainInputError(
                    _message(f"parameter group {i} of the optimizer changed ({values})")
                )


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in group.items() if k not in _PER_CALL}
    for key in ("momentum", "weight_decay"):  # values read per call; zero or not is the update
        if key in out:
            out[key] = "0" if out[key] == 0 else "nonzero"
    return out


def _message(what: str) -> str:
    return (
        f"train_step: {what} after the step was built. The step read the model and the "
        f"optimizer once and owns the training state since (each group's lr, betas, momentum "
        f"and weight_decay are read per call), so this change would be ignored. Build a new "
        f"step for the new setting (carry the state over: "
        f"new_step.load_state_dict(old_step.state_dict())); to load weights into this step, "
        f"call step.load_state_dict(...) instead of the module's."
    )
