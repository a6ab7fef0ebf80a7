"""The names a checkpoint uses: a TrainStep's state as a DCP state dict, and back.

The layout is PyTorch's, so plain PyTorch loads it (``docs/checkpointing.md``):

====================================  ========================================================
``<name>``                            each ``model.state_dict()`` entry, by the module's own
                                      name (a tied parameter once, under its first name)
``optimizer.state.<name>.<key>``      ``exp_avg``/``exp_avg_sq``/``momentum_buffer`` and the
                                      per-parameter ``step`` (AdamW/Adam), as
                                      ``get_optimizer_state_dict`` names them
``optimizer.param_groups.<i>.<h>``    each group's hyperparameters; ``params`` lists the names
``step``                              partita's optimizer step counter
``rng.torch``                         ``torch.get_rng_state()`` of the saving process (rank 0)
``lr_scheduler.*``                    ``scheduler.state_dict()``, when given
``extra.*``                           the user's ``extra`` dict
====================================  ========================================================

This module builds nested dicts (DCP flattens them into the dotted keys above); it writes and
reads nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from partita.checkpoint.tiles import Tiles, assemble, tiles_to_read, tiles_to_write
from partita.errors import CheckpointError
from partita.training.groups import RESTORED_KEYS
from partita.training.state import ShardedState, set_sharded_state, sharded_state
from partita.values.tensor import ShardedTensor

__all__ = [
    "RESERVED",
    "apply_loaded",
    "apply_run_state",
    "loadable_extra",
    "request_for_load",
    "run_state",
    "run_state_request",
    "state_for_save",
    "subtree",
]

#: Top-level keys of a TrainStep checkpoint besides the model's own names.
RESERVED = ("optimizer", "step", "rng", "lr_scheduler", "extra")


def _check_names(state: ShardedState) -> None:
    clash = [k for k in state.values if k.split(".", 1)[0] in RESERVED]
    if clash:
        raise CheckpointError(
            f"checkpoint.save: the model has state named {clash}, which collides with the "
            f"checkpoint's own top-level keys {list(RESERVED)}. Nothing was saved. Rename the "
            "submodule or attribute (model.state_dict() names are the checkpoint's names)."
        )


def _hyper(group: dict[str, Any], opt_names: list[str]) -> dict[str, Any]:
    out = {k: v for k, v in group.items() if k != "params"}
    out["params"] = list(opt_names)
    return out


def state_for_save(
    train_step: Any, scheduler: Any = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The nested state dict of a TrainStep to hand to ``dcp.save`` (tiles, not gathers)."""
    state = sharded_state(train_step)
    _check_names(state)
    out: dict[str, Any] = {k: tiles_to_write(k, v) for k, v in state.values.items()}
    step = state.step.full()  # replicated: read locally, no communication
    per_param: dict[str, dict[str, Any]] = {}
    for name in state.layout.trainable:
        entry: dict[str, Any] = {}
        if "exp_avg" in state.moments:  # Adam(W) keeps a step per parameter; SGD none
            entry["step"] = step.clone()
        for key, tensors in state.moments.items():
            entry[key] = tiles_to_write(f"optimizer.state.{name}.{key}", tensors[name])
        per_param[name] = entry
    groups, start = [], 0
    for group in train_step.optimizer.param_groups:  # names group after group, as saved
        end = start + len(group["params"])
        groups.append(_hyper(group, state.opt_names[start:end]))
        start = end
    out["optimizer"] = {"state": per_param, "param_groups": groups}
    out["step"] = step
    return {**out, **run_state(scheduler, extra)}


def run_state(scheduler: Any = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint keeps beside the tensors: the RNG, the scheduler, the user's extra."""
    out: dict[str, Any] = {"rng": {"torch": torch.get_rng_state()}}
    if scheduler is not None:
        out["lr_scheduler"] = scheduler.state_dict()
    if extra is not None:
        out["extra"] = loadable_extra(extra)
    return out


#: What ``extra`` may hold: what DCP writes and ``torch.load(weights_only=True)`` gives back.
_SCALARS = (type(None), bool, int, float, str)


def _refuse(where: str, value: Any, why: str, fix: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint.save: {where} is {why} ({type(value).__module__}.{type(value).__qualname__}"
        f"{'' if isinstance(value, dict | list | tuple) else f' {value!r:.60}'}); extra may hold "
        "None, bools, ints, floats, strings and torch tensors, in lists, tuples and dicts with "
        "str keys (numpy scalars are stored as the Python number), because a load gives back "
        f"only those (it unpickles nothing else). Nothing was saved. {fix}"
    )


def _loadable(value: Any, where: str) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value.detach()
    if (
        kind.__module__ == "numpy"
        and getattr(value, "ndim", None) == 0
        and kind.__name__ != "ndarray"
    ):
        item = value.item()  # np.float64 -> float, np.int64 -> int, np.bool_ -> bool, np.str_
        if type(item) in _SCALARS:
            return item
    if kind is list or kind is tuple:
        return kind(_loadable(v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind is dict:
        if not value:
            raise _refuse(where, value, "an empty dict", f"Leave {where} out, or store None.")
        out = {}
        for key, v in value.items():
            if type(key) is not str:
                raise _refuse(
                    f"{where}[{key!r}]", key, "a dict key that is not a str",
                    f"Use str keys (DCP names entries by them, so {key!r} would load as "
                    f"{str(key)!r}).",
                )  # fmt: skip
            out[key] = _loadable(v, f"{where}[{key!r}]")
        return out
    if isinstance(value, ShardedTensor | torch.Tensor):
        fix = "Save a plain tensor: .full() of a ShardedTensor, or .detach().clone().cpu()."
    elif kind.__module__ == "numpy":
        fix = "Convert it: torch.from_numpy(a) for an array, .item() for a scalar."
    else:
        fix = "Convert it to one of those, e.g. str(path), when.isoformat(), float(x)."
    raise _refuse(where, value, "not a type a checkpoint can load back", fix)


def loadable_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as saved: checked to load back equal, numpy scalars made Python numbers."""
    if type(extra) is not dict:
        raise CheckpointError(
            f"checkpoint.save: extra is a {type(extra).__name__}; it must be a dict (of None, "
            "bools, ints, floats, strings, tensors, and lists, tuples and str-keyed dicts of "
            "them). Nothing was saved. Pass a dict."
        )
    if not extra:
        return {}
    out = _loadable(extra, "extra")
    try:
        flatten_state_dict({"extra": out})
    except ValueError as e:  # "duplicated flatten key extra.a.b"
        raise CheckpointError(
            f"checkpoint.save: two entries of extra get the same checkpoint name ({e}): a key "
            "with a dot in it names the same entry as nested dicts (extra={'a.b': 1, "
            "'a': {'b': 2}}). Nothing was saved. Rename one of them."
        ) from e
    return out


def subtree(metadata: Metadata, prefix: str) -> dict[str, Any]:
    """Placeholders for every saved entry under top-level key ``prefix`` (None for Python
    objects, empty tensors of the saved size and dtype), nested as they were saved."""
    out: dict[str, Any] = {}
    for key, path in (metadata.planner_data or {}).items():
        if not path or path[0] != prefix:
            continue
        md = metadata.state_dict_metadata[key]
        value = (
            torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
        set_element(out, path, value)
    return out.get(prefix, {})


def request_for_load(
    train_step: Any, metadata: Metadata, scheduler: Any = None
) -> tuple[dict[str, Any], ShardedState]:
    """The nested request to hand to ``dcp.load``: buffers laid out like the step's state."""
    state = sharded_state(train_step)
    out: dict[str, Any] = {k: tiles_to_read(k, v) for k, v in state.values.items()}
    per_param: dict[str, dict[str, Any]] = {}
    for name in state.layout.trainable:
        entry: dict[str, Any] = {}
        if "exp_avg" in state.moments:
            entry["step"] = torch.empty((), dtype=state.step.dtype)
        for key, tensors in state.moments.items():
            entry[key] = tiles_to_read(f"optimizer.state.{name}.{key}", tensors[name])
        per_param[name] = entry
    groups = []  # what the step reads per call (the other hyperparameters are the step's)
    saved = metadata.state_dict_metadata
    for i, now in enumerate(train_step.optimizer.param_groups):
        keys = [k for k in RESTORED_KEYS if f"optimizer.param_groups.{i}.{k}" in saved
                and (k in now or k == "initial_lr")]  # fmt: skip
        group: dict[str, Any] = {"lr": None, **dict.fromkeys(keys)}
        groups.append(group)
    out["optimizer"] = {"state": per_param, "param_groups": groups}
    out["step"] = torch.empty((), dtype=state.step.dtype)
    return {**out, **run_state_request(metadata, scheduler)}, state


def run_state_request(metadata: Metadata, scheduler: Any = None) -> dict[str, Any]:
    """The ``dcp.load`` request for :func:`run_state`'s entries."""
    out: dict[str, Any] = {"rng": {"torch": torch.empty_like(torch.get_rng_state())}}
    if scheduler is not None:
        if "lr_scheduler" not in {p[0] for p in (metadata.planner_data or {}).values() if p}:
            raise CheckpointError(
                "checkpoint.load(scheduler=...): the checkpoint holds no learning-rate "
                "scheduler state (it was saved without scheduler=). Nothing was loaded. Load "
                "without scheduler= and set the scheduler up yourself."
            )
        out["lr_scheduler"] = subtree(metadata, "lr_scheduler")
    out["extra"] = subtree(metadata, "extra")
    return out


def apply_loaded(
    train_step: Any, loaded: dict[str, Any], state: ShardedState, scheduler: Any = None
) -> dict[str, Any]:
    """Put what ``dcp.load`` filled into the step (and scheduler, RNG); returns ``extra``."""

    def put(template: ShardedTensor, tiles: Tiles) -> ShardedTensor:
        return assemble(template, tiles)

    values = {k: put(v, loaded[k]) for k, v in state.values.items()}
    per_param = loaded["optimizer"]["state"]
    moments = {
        key: {n: put(t, per_param[n][key]) for n, t in tensors.items()}
        for key, tensors in state.moments.items()
    }
    step = ShardedTensor.from_global(loaded["step"], state.step.sharding)
    set_sharded_state(train_step, values, moments, step)
    groups = loaded["optimizer"]["param_groups"]
    for group, values in zip(train_step.optimizer.param_groups, groups, strict=True):
        group.update(values)
    return apply_run_state(loaded, scheduler)


def apply_run_state(loaded: dict[str, Any], scheduler: Any = None) -> dict[str, Any]:
    """Restore the RNG (and scheduler) from a loaded :func:`run_state`; returns ``extra``."""
    torch.set_rng_state(loaded["rng"]["torch"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["lr_scheduler"])
    return loaded["extra"]
