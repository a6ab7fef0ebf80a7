"""A TrainStep's state as ``state_dict()`` checkpoints: written like torch, loaded atomically.

:class:`StateLayout` records, once, how the sharded training state maps onto the names
PyTorch uses: ``model.state_dict()`` keys (a tied parameter has several names and one value)
and ``optimizer.state_dict()`` indices (a parameter's position in the optimizer's list, frozen
parameters included, as torch numbers them). :func:`to_state_dict` writes a checkpoint that
loads into plain PyTorch; :func:`load_state` reads one back, checking *everything* before it
returns new state, so a bad checkpoint changes nothing. :func:`sharded_state` and
:func:`set_sharded_state` hand the state over *without* gathering it, for sharded checkpoints
(``partita.checkpoint``).

Loading follows ``nn.Module.load_state_dict``: with ``strict=True`` missing and unexpected keys
are an error, with ``strict=False`` they are returned (missing entries keep their current
value). Floating-point tensors are cast to the state's dtype (torch's ``copy_`` semantics, so a
bfloat16 or float64 checkpoint loads); any other dtype change (an int64 weight into float32) is
refused, because it is a different quantity, not a rounding. This module does not shard: the
caller re-shards the full tensors it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from partita.errors import InternalError, StateDictError
from partita.training.groups import optimizer_params
from partita.values.tensor import ShardedTensor

__all__ = [
    "LoadResult",
    "NewState",
    "ShardedState",
    "StateLayout",
    "load_state",
    "set_sharded_state",
    "sharded_state",
    "to_state_dict",
]

MOMENTS: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq"),
}
MOMENTS["sgd"] = ("momentum_buffer",)


class LoadResult(NamedTuple):
    """What ``load_state_dict`` did not load: like ``nn.Module.load_state_dict``'s result.

    Keys are paths into the checkpoint: ``"model.<name>"``, ``"optimizer.state.<i>.<key>"``.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(frozen=True)
class StateLayout:
    """The names of a training state.

    Attributes:
        model_keys: ``model.state_dict()`` keys, in order.
        aliases: every parameter name (each name of a tied parameter) -> its canonical name,
            the one ``model.named_parameters()`` reports.
        trainable: canonical names of the parameters the optimizer updates.
        buffer_keys: the other ``model_keys`` (frozen parameters' names are in ``aliases``).
        opt_index: trainable name -> its index in ``optimizer.state_dict()``.
        n_opt_params: how many tensors the optimizer holds (all groups).
        group_sizes: how many of them each parameter group holds, in order.
        moments: the per-parameter optimizer states (``exp_avg``, ...).
    """

    model_keys: tuple[str, ...]
    aliases: dict[str, str]
    trainable: tuple[str, ...]
    buffer_keys: tuple[str, ...]
    opt_index: dict[str, int]
    n_opt_params: int
    moments: tuple[str, ...]
    group_sizes: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer, kind: str) -> StateLayout:
        by_id: dict[int, str] = {}
        aliases = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases[name] = by_id.setdefault(id(p), name)
        trainable = tuple(k for k, p in model.named_parameters() if p.requires_grad)
        opt_params = optimizer_params(optimizer)
        position = {id(p): i for i, p in enumerate(opt_params)}
        named = dict(model.named_parameters())
        model_keys = tuple(model.state_dict())
        return cls(
            model_keys=model_keys,
            aliases=aliases,
            trainable=trainable,
            buffer_keys=tuple(k for k in model_keys if k not in aliases),
            opt_index={k: position[id(named[k])] for k in trainable},
            n_opt_params=len(opt_params),
            moments=MOMENTS[kind],
            group_sizes=tuple(len(group["params"]) for group in optimizer.param_groups),
        )


class NewState(NamedTuple):
    """Full tensors to re-shard: every entry replaces the current one of the same name."""

    values: dict[str, torch.Tensor]  # canonical parameter names and buffer keys
    step: torch.Tensor | None
    moments: dict[str, dict[str, torch.Tensor]]  # moment -> parameter -> tensor
    stepped: frozenset[str] | None  # None: keep the current set
    result: LoadResult


def to_state_dict(
    layout: StateLayout,
    values: dict[str, torch.Tensor],
    step: torch.Tensor,
    moments: dict[str, dict[str, torch.Tensor]],
    stepped: frozenset[str],
    groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` in the layouts of ``model.state_dict()`` and
    ``optimizer.state_dict()``. ``values`` holds full tensors by canonical parameter name and
    buffer key; a tied parameter appears under each of its names (one tensor). Like
    ``torch.optim``, only parameters that have been updated (``stepped``) have state."""
    model_sd = {k: values[layout.aliases.get(k, k)] for k in layout.model_keys}
    state = {}
    for name in sorted(stepped, key=layout.opt_index.__getitem__):
        entry: dict[str, Any] = {"step": step.clone()}
        entry.update({key: moments[key][name] for key in layout.moments})
        state[layout.opt_index[name]] = entry
    param_groups, start = [], 0
    for group in groups:  # torch.optim numbers the tensors group after group
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        param_groups.append(entry)
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": param_groups}}


def _check_tensor(where: str, new: Any, old: ShardedTensor | torch.Tensor) -> torch.Tensor:
    if not isinstance(new, torch.Tensor):
        raise StateDictError(
            f"load_state_dict: {where} is a {type(new).__name__} ({new!r:.60}), expected a "
            f"tensor of shape {tuple(old.shape)} and dtype {old.dtype}. Nothing was loaded. "
            "Pass what TrainStep.state_dict() (or model/optimizer.state_dict()) returned."
        )
    if tuple(new.shape) != tuple(old.shape):
        raise StateDictError(
            f"load_state_dict: {where} has shape {tuple(new.shape)} ({new.dtype}), which does "
            f"not match {tuple(old.shape)} ({old.dtype}) of this model. Nothing was loaded. "
            "Load a checkpoint of the same model configuration."
        )
    if new.dtype != old.dtype and not (new.is_floating_point() and old.dtype.is_floating_point):
        raise StateDictError(
            f"load_state_dict: {where} is {new.dtype} (shape {tuple(new.shape)}) but this model "
            f"keeps it as {old.dtype}. Floating-point values are cast between precisions; a "
            "change of kind (integer, bool, float) is refused because it is not a rounding. "
            f"Nothing was loaded. Convert it yourself if you mean it: .to({old.dtype})."
        )
    return new.detach().to(old.dtype).clone()


def _load_model(
    layout: StateLayout, sd: Mapping[str, Any], current: dict[str, ShardedTensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    values: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    names: dict[str, list[str]] = {}
    for key in layout.model_keys:
        names.setdefault(layout.aliases.get(key, key), []).append(key)
    for canonical, keys in names.items():
        given = [k for k in keys if k in sd]
        if not given:
            missing += [f"model.{k}" for k in keys]
            continue
        loaded = [_check_tensor(f"model[{k!r}]", sd[k], current[canonical]) for k in given]
        for k, t in zip(given[1:], loaded[1:], strict=True):
            if not torch.equal(t, loaded[0]):
                raise StateDictError(
                    f"load_state_dict: model[{given[0]!r}] and model[{k!r}] are one tied "
                    "parameter in this model, but the checkpoint holds different values for "
                    "them (a checkpoint of an untied model?). Nothing was loaded. Keep one of "
                    "the two keys, or untie the weights in the model."
                )
        values[canonical] = loaded[0]
    unexpected = [f"model.{k}" for k in sd if k not in layout.model_keys]
    return values, missing, unexpected


def _as_step(where: str, value: Any) -> torch.Tensor:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return torch.tensor(float(value))
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype == torch.bool:
        return value.detach().reshape(()).to(torch.float32)
    raise StateDictError(
        f"load_state_dict: {where} is {value!r:.60}; a step counter is a number or a "
        "one-element tensor. Nothing was loaded. Pass what optimizer.state_dict() returned."
    )


def _load_optimizer(
    layout: StateLayout,
    opt: Any,
    moments: dict[str, dict[str, ShardedTensor]],
) -> tuple[torch.Tensor | None, dict[str, dict[str, torch.Tensor]], set[str], list[str], list[str]]:
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping):
        raise StateDictError(
            f"load_state_dict: state_dict['optimizer'] is {type(opt).__name__}, expected the "
            "{'state': {...}, 'param_groups': [...]} of optimizer.state_dict(). Nothing was "
            "loaded. Leave the key out to load only the model weights."
        )
    expected = list(layout.group_sizes or (layout.n_opt_params,))
    groups = opt.get("param_groups", [{"params": list(range(layout.n_opt_params))}])
    sizes = [len(g.get("params", ())) for g in groups]
    if sizes != expected:
        raise StateDictError(
            f"load_state_dict: the optimizer checkpoint has parameter groups of sizes {sizes}, "
            f"this step's optimizer groups of sizes {expected}. Nothing was loaded. Load a "
            "checkpoint of the same model with the same optimizer parameter groups."
        )
    by_index = {i: name for name, i in layout.opt_index.items()}
    new: dict[str, dict[str, torch.Tensor]] = {key: {} for key in layout.moments}
    steps: dict[int, torch.Tensor] = {}
    missing: list[str] = []
    unexpected: list[str] = []
    for index, entry in opt["state"].items():
        where = f"optimizer.state.{index}"
        if index not in by_index:
            unexpected.append(where)
            continue
        name = by_index[index]
        if not isinstance(entry, Mapping):
            raise StateDictError(
                f"load_state_dict: state_dict['optimizer']['state'][{index}] (parameter "
                f"{name!r}) is a {type(entry).__name__}, expected a dict of its states "
                f"({', '.join(('step', *layout.moments))}). Nothing was loaded. Pass what "
                "optimizer.state_dict() returned."
            )
        missing += [f"{where}.{k}" for k in ("step", *layout.moments) if k not in entry]
        unexpected += [f"{where}.{k}" for k in entry if k not in ("step", *layout.moments)]
        if "step" in entry:
            steps[index] = _as_step(f"state['optimizer']['state'][{index}]['step']", entry["step"])
        for key in layout.moments:
            if key in entry:
                at = f"state['optimizer']['state'][{index}][{key!r}] (parameter {name!r})"
                new[key][name] = _check_tensor(at, entry[key], moments[key][name])
    if len({float(s) for s in steps.values()}) > 1:
        raise StateDictError(
            "load_state_dict: the optimizer checkpoint has different step counts per "
            f"parameter ({ {i: float(s) for i, s in steps.items()} }); partita's step keeps one "
            "counter for all parameters. Nothing was loaded. Load a checkpoint in which every "
            "parameter was updated at every step."
        )
    stepped = {by_index[i] for i in opt["state"] if i in by_index}
    # A parameter without state has never been updated (torch creates state on its first
    # gradient): its moments start at zero, and with no state at all the step count is 0.
    for name in layout.trainable:
        if name not in stepped:
            for key in layout.moments:
                old = moments[key][name]
                new[key][name] = torch.zeros(tuple(old.shape), dtype=old.dtype)
    step = next(iter(steps.values()), None if stepped else torch.zeros(()))
    return step, new, stepped, missing, unexpected


def load_state(
    layout: StateLayout,
    state_dict: Any,
    current: dict[str, ShardedTensor],
    moments: dict[str, dict[str, ShardedTensor]],
    *,
    strict: bool = True,
) -> NewState:
    """Check ``state_dict`` against the current state and return what to load.

    ``current`` holds the current parameters and buffers by canonical name / buffer key,
    ``moments`` the optimizer states. Raises :class:`StateDictError` (and returns nothing)
    on any mismatch; missing or unexpected keys only under ``strict``. Without an
    ``"optimizer"`` entry, the optimizer state is left as it is (``NewState.step`` None).
    """
    if not isinstance(state_dict, Mapping) or "model" not in state_dict:
        keys = list(state_dict)[:4] if isinstance(state_dict, Mapping) else []
        bare = bool(keys) and all(k in layout.model_keys for k in keys)
        raise StateDictError(
            f"load_state_dict got {type(state_dict).__name__} with keys {keys}"
            f"{' (a model.state_dict()?)' if bare else ''}; it expects {{'model': ..., "
            "'optimizer': ...}, as produced by TrainStep.state_dict(). Nothing was loaded. "
            "To load only model weights, pass {'model': model_state_dict} (the optimizer state "
            "is kept)."
        )
    if not isinstance(state_dict["model"], Mapping):
        raise StateDictError(
            f"load_state_dict: state_dict['model'] is a {type(state_dict['model']).__name__}, "
            "expected the {name: tensor} dict of model.state_dict(). Nothing was loaded. Pass "
            "what TrainStep.state_dict() returned (its 'model' entry is model.state_dict())."
        )
    values, missing, unexpected = _load_model(layout, state_dict["model"], current)
    unexpected += [k for k in state_dict if k not in ("model", "optimizer")]
    step, stepped = None, None
    new_moments: dict[str, dict[str, torch.Tensor]] = {}
    if state_dict.get("optimizer") is not None:
        step, new_moments, got, opt_missing, opt_unexpected = _load_optimizer(
            layout, state_dict["optimizer"], moments
        )
        missing += opt_missing
        unexpected += opt_unexpected
        stepped = frozenset(got)
    if strict and (missing or unexpected):
        raise StateDictError(
            f"load_state_dict(strict=True): missing keys {missing}, unexpected keys "
            f"{unexpected}. Nothing was loaded. Load a checkpoint of the same model and "
            "optimizer, or pass strict=False to load the keys that match (the others keep "
            "their current values)."
        )
    return NewState(values, step, new_moments, stepped, LoadResult(missing, unexpected))


# --- the sharded state, for partita.checkpoint (no gathering) --------------------------------


class ShardedState(NamedTuple):
    """A TrainStep's state as it is held: ShardedTensors, nothing gathered.

    ``values``: every ``model.state_dict()`` entry once, by canonical name (a tied parameter
    under its first name; ``layout.aliases`` lists the others). ``moments``: optimizer state
    name -> trainable parameter -> tensor. ``step``: the optimizer's step counter (replicated).
    ``opt_names``: the parameter name of each position of the optimizer's parameter group.
    """

    layout: StateLayout
    values: dict[str, ShardedTensor]
    moments: dict[str, dict[str, ShardedTensor]]
    step: ShardedTensor
    opt_names: list[str]


def sharded_state(train_step: Any) -> ShardedState:
    """The sharded state of a ``partita.training.train.TrainStep`` (its public attributes only)."""
    model, optimizer = train_step.model, train_step.optimizer
    layout = StateLayout.of(model, optimizer, train_step.config.kind)
    held = {**train_step.params, **train_step.buffers}
    canonical = dict.fromkeys(layout.aliases.get(k, k) for k in layout.model_keys)
    values = {k: held[k] for k in canonical}
    moments = {k: dict(v) for k, v in train_step.opt_state.items() if k != "step"}
    names = {id(p): n for n, p in model.named_parameters()}
    opt_names = [names[id(p)] for p in optimizer_params(optimizer)]
    return ShardedState(layout, values, moments, train_step.opt_state["step"], opt_names)


def set_sharded_state(
    train_step: Any,
    values: dict[str, ShardedTensor],
    moments: dict[str, dict[str, ShardedTensor]],
    step: ShardedTensor,
) -> None:
    """Replace a TrainStep's state with (already checked and sharded) loaded values.

    Keys and key order of every dict stay as they were (the compiled step function keeps one
    input structure). Every trainable parameter counts as updated afterwards: a sharded
    checkpoint holds optimizer state for all of them, as ``get_optimizer_state_dict`` does.
    """
    train_step.params = {k: values.get(k, v) for k, v in train_step.params.items()}
    train_step.buffers = {k: values.get(k, v) for k, v in train_step.buffers.items()}
    train_step.opt_state = {
        k: step if k == "step" else {n: moments[k].get(n, t) for n, t in v.items()}
        for k, v in train_step.opt_state.items()
    }
    # TrainStep keeps the set of updated parameters privately (state_dict() reports optimizer
    # state only for those); there is no public setter, so set it here, loudly if it moved.
    if not hasattr(train_step, "_stepped"):
        raise InternalError(
            f"set_sharded_state: TrainStep no longer has _stepped (the set of updated "
            f"parameters); update set_sharded_state. {InternalError.REPORT}"
        )
    train_step._stepped = frozenset(train_step.params)
