"""What a training step does around its program on every call, done once where nothing changed.

``TrainStep.__call__`` checks the batch (``training.checks.check_batch``: rows, dtypes, that
``batch_spec`` fits; and that no tensor is on the meta device), reads each parameter group's
hyperparameters into tensors (``training.groups.group_hyperparameters``) and hands back the
loss as a full tensor. In a loop these are the same work on the same kind of input at every
step, and for a small model they cost as much as a good part of the step. Here:

* :class:`BatchChecks` runs the checks once per *batch signature*: the containers (tuples,
  lists, dicts by their keys) and each tensor's shape, dtype and device; a batch with another
  signature, or a leaf that is not a plain tensor, is checked in full;
* :class:`HyperTensors` makes the hyperparameter tensors again only when a value changed (a
  scheduler's step), so a constant learning rate is the same tensors at every call;
* :func:`full_loss`: the loss, replicated and held once, is one copy of that value.

Nothing here is kept across a change it could miss: every call reads what the checks and the
tensors depend on, and compares it. This module runs no program.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from partita.runtime.executor import check_has_data
from partita.training.checks import check_batch
from partita.values.mesh import Mesh
from partita.values.tensor import ShardedTensor

__all__ = ["BatchChecks", "HyperTensors", "batch_signature", "full_loss"]


def batch_signature(batch: Any) -> tuple[Any, ...] | None:
    """The containers of ``batch`` and each tensor's shape, dtype and device, or None when a
    leaf is not a plain ``torch.Tensor`` (anything else is checked in full at every call).

    Example:
        >>> batch_signature((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))[0]
        (<class 'tuple'>, 2)
    """
    out: list[Any] = []
    return tuple(out) if _signature(batch, out) else None


def _signature(x: Any, out: list[Any]) -> bool:
    kind = type(x)
    if kind is torch.Tensor:
        out.append((x.shape, x.dtype, x.device))
        return True
    if kind is tuple or kind is list:
        out.append((kind, len(x)))
        return all(_signature(v, out) for v in x)
    if kind is dict:
        out.append((dict, tuple(x)))
        return all(_signature(v, out) for v in x.values())
    return False


class BatchChecks:
    """The batch checks of a training step, once per batch signature (see the module doc)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None

    def check(
        self,
        batch: Any,
        spec: Any,
        mesh: Mesh,
        float_dtype: torch.dtype | None,
        first: dict[str, Any] | None,
    ) -> bool:
        """``check_batch``, then (to run: ``first`` given, named tensors) that neither
        ``first`` nor the batch is on the meta device; skipped when a batch of the same
        signature passed the same checks last time with the same ``spec`` object. Returns
        whether the checks ran."""
        signature = batch_signature(batch)
        run = first is not None
        key = None if signature is None else (id(spec), spec, float_dtype, run, signature)
        if key is not None and key == self._last:
            return False
        self._last = None
        check_batch(batch, spec, mesh, float_dtype=float_dtype)
        if first is not None:  # by name: a model built on meta whole is the usual reason
            paths = tree_flatten_with_path(batch)[0]
            names = [*first, *(f"batch{keystr(p)}" for p, _ in paths)]
            check_has_data([*first.values(), *(v for _, v in paths)], "partita.train_step", names)
        self._last = key
        return True


class HyperTensors:
    """The hyperparameter tensors of a step, made again only when a value changed."""

    __slots__ = ("_tensors", "_values")

    def __init__(self) -> None:
        self._values: dict[str, list[float]] | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def now(self, values: dict[str, list[float]]) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` of ``values`` (one float per parameter group): 0-d for one group,
        else one entry per group (float64). The same tensors as last time when no value
        changed (the program only reads them)."""
        if values != self._values:
            self._tensors = {
                key: torch.tensor(v[0] if len(v) == 1 else v, dtype=torch.float64)
                for key, v in values.items()
            }
            self._values = values
        return dict(self._tensors)


def full_loss(loss: ShardedTensor) -> torch.Tensor:
    """``loss.full()``: for a replicated value held once (the LocalMesh's scalar loss), a copy
    of that value; otherwise ``full()`` itself."""
    held = loss.held
    if held is not None and not any(held[1]) and loss.sharding.is_replicated:
        return held[0].clone()
    return loss.full()
