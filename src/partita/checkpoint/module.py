"""Checkpoints of an ``nn.Module`` on the virtual device (``partita.use_spmd``), in place.

Saving syncs the device and writes each parameter's and buffer's shards
(``partita.virtual.sharded``) and, with ``optimizer=``, the ``torch.optim`` state under the
names :mod:`partita.checkpoint.state` documents (``optimizer.state.<name>.<key>``,
``optimizer.param_groups.<i>.<hyper>``). Loading reads each value whole and copies it into the
existing tensor with ``Tensor.copy_``, which on virtual-device data keeps the tensor's current
layout (so the Parameter objects, and an optimizer holding them, stay the same); the
optimizer's state goes through ``optimizer.load_state_dict`` and each moment is then laid out
like its parameter with ``partita.mark_sharding`` (as ``zeros_like(param)`` lays it out in the
run that saved it). This module builds state dicts; reading and writing is ``api``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from partita.checkpoint.state import subtree
from partita.checkpoint.tiles import tiles_to_write
from partita.errors import CheckpointError
from partita.virtual import LazyTensor, sharded, sync
from partita.virtual.marking import mark_in_place
from partita.virtual.step import mesh as device_mesh

__all__ = ["apply_module", "is_virtual_module", "module_request", "module_state"]


def is_virtual_module(target: Any) -> bool:
    """An ``nn.Module`` with a parameter or buffer on the virtual device."""
    if not isinstance(target, nn.Module):
        return False
    tensors = [*target.parameters(), *target.buffers()]
    return any(isinstance(t, LazyTensor) for t in tensors)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` entries by their first name (a tied parameter once), as the objects."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _leaf(name: str, t: Any) -> Any:
    if isinstance(t, LazyTensor):
        return tiles_to_write(name, sharded(t))
    return t.detach() if isinstance(t, torch.Tensor) else t


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(t): name for name, t in reversed(list(_tensors(model).items()))}


def module_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The nested state dict to hand to ``dcp.save`` (syncs the device first)."""
    sync()
    out = {name: _leaf(name, t) for name, t in _tensors(model).items()}
    if optimizer is None:
        return out
    names = _param_names(model)
    groups: list[dict[str, Any]] = []
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        params = [names.get(id(p)) for p in group["params"]]
        if None in params:
            raise CheckpointError(
                f"checkpoint.save(model, optimizer=...): the optimizer holds "
                f"{params.count(None)} tensor(s) that are not the model's parameters, so they "
                "have no name in the checkpoint. Nothing was saved. Build the optimizer from "
                "model.parameters()."
            )
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        for p, name in zip(group["params"], params, strict=True):
            entry = optimizer.state.get(p, {})
            state[name] = {k: _leaf(f"optimizer.state.{name}.{k}", v) for k, v in entry.items()}
    out["optimizer"] = {"state": state, "param_groups": groups}
    return out


def module_request(
    model: nn.Module, metadata: Metadata, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Buffers for ``dcp.load``: each tensor whole (plain CPU), the optimizer as saved."""
    sync()
    out: dict[str, Any] = {
        name: torch.empty(tuple(t.shape), dtype=t.dtype) for name, t in _tensors(model).items()
    }
    if optimizer is not None:
        saved = subtree(metadata, "optimizer")
        if not saved:
            raise CheckpointError(
                "checkpoint.load(model, optimizer=...): the checkpoint holds no optimizer "
                "state (it was saved without optimizer=). Nothing was loaded. Load without "
                "optimizer=, or load a checkpoint saved with it."
            )
        out["optimizer"] = saved
    return out


def apply_module(
    model: nn.Module, loaded: dict[str, Any], optimizer: torch.optim.Optimizer | None
) -> None:
    """Copy what ``dcp.load`` read into the model's tensors (in place) and the optimizer."""
    tensors = _tensors(model)
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(loaded[name])  # on device data: eager, keeps t's layout and identity
    if optimizer is None:
        return
    saved = loaded["optimizer"]
    index = {name: i for i, name in enumerate(tensors)}
    # An optimizer saved before its first step has no state: DCP writes no key for an empty dict.
    saved_state = saved.get("state", {})
    groups, state, order = [], {}, 0
    for group in saved["param_groups"]:
        ids = list(range(order, order + len(group["params"])))
        order += len(ids)
        groups.append({**group, "params": ids})
        for i, name in zip(ids, group["params"], strict=True):
            if name not in index:
                raise CheckpointError(
                    f"checkpoint.load(model, optimizer=...): the saved optimizer has state "
                    f"for {name!r}, which this model does not have. Nothing was loaded into "
                    "the optimizer. Load into the model the checkpoint was saved from."
                )
            if saved_state.get(name):
                state[i] = dict(saved_state[name])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    mesh = device_mesh()
    for p, entry in optimizer.state.items():
        if not isinstance(p, LazyTensor):
            continue
        spec = sharded(p).sharding.spec
        for value in entry.values():
            if isinstance(value, LazyTensor) and value.shape == p.shape:
                mark_in_place(value, mesh, spec)
