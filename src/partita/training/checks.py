"""What a training step checks about its inputs before it traces or runs anything.

A training step's mistakes otherwise surface deep inside tracing or in the generated program,
phrased in terms the user never wrote (``in_specs of 'step'``, a bare dtype error from a matmul,
a ZeroDivisionError from a mean). These checks say it in the user's terms: which leaf of ``batch
= (inputs, targets)``, its shape and dtype, what ``batch_spec`` gave it, why that cannot work
and what to change. They also check that the optimizer was built over the model, and read the
step's arguments (``mixed_precision``). This module does not trace,
shard or run anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from partita.capture.uncompile import uncompiled
from partita.errors import ArgumentError, ArgumentTypeError, SpecError, TrainInputError
from partita.training.groups import optimizer_params
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = [
    "check_batch",
    "check_optimizer_params",
    "compute_dtype",
    "describe_batch",
    "model_argument",
]


class _Leaf:
    """A tensor shown by its shape and dtype (how a batch is printed in messages)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.text = f"Tensor{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    def __repr__(self) -> str:
        return self.text


def describe_batch(batch: Any) -> str:
    """The structure of ``batch`` with each tensor as its shape and dtype.

    Example:
        >>> describe_batch((torch.zeros(8, 4), {"mask": torch.ones(8, dtype=torch.bool)}))
        "(Tensor[8, 4] float32, {'mask': Tensor[8] bool})"
    """
    return repr(pytree.tree_map_only(torch.Tensor, _Leaf, batch))


def _where(path: tuple[Any, ...]) -> str:
    """``inputs``, ``targets``, ``inputs['mask']``... for a path into ``(inputs, targets)``."""
    head = ("inputs", "targets")[path[0].idx]
    return head + pytree.keystr(path[1:])


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _leaf_specs(batch: Any, batch_spec: Any) -> list[PartitionSpec | None] | None:
    """One spec per leaf of ``batch`` (``batch_spec`` is a prefix of it), or None if it is not.

    Dicts match by key, not by position (``torch.utils._pytree``'s broadcasting pairs dict
    entries by position, which would give ``{"mask": P(), "ids": P("data")}`` to the wrong
    keys of ``{"ids": ..., "mask": ...}``).
    """
    if _is_spec_leaf(batch_spec):
        return [batch_spec] * len(pytree.tree_leaves(batch))
    if isinstance(batch_spec, dict) and isinstance(batch, dict):
        if set(batch_spec) != set(batch):
            return None
        pairs = [(batch[k], batch_spec[k]) for k in batch]
    elif isinstance(batch_spec, tuple | list) and isinstance(batch, tuple | list):
        if len(batch_spec) != len(batch):
            return None
        pairs = list(zip(batch, batch_spec, strict=True))
    else:
        return None
    flat: list[PartitionSpec | None] = []
    for value, spec in pairs:
        part = _leaf_specs(value, spec)
        if part is None:
            return None
        flat += part
    return flat


#: One spec per leaf of a batch (public name of :func:`_leaf_specs`).
batch_leaf_specs = _leaf_specs


def check_batch(
    batch: Any, batch_spec: Any, mesh: Mesh, *, float_dtype: torch.dtype | None
) -> None:
    """Raise a :class:`TrainInputError` if ``batch`` cannot go through a training step.

    ``float_dtype`` is the dtype floating-point inputs must have (the model's), or None when
    they are cast anyway (mixed precision).
    """
    paths = pytree.tree_flatten_with_path(batch)[0]
    for path, leaf in paths:
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == 0:
            raise TrainInputError(
                f"batch leaf {_where(path)} has shape {tuple(leaf.shape)}: 0 rows. A training "
                "step needs at least one example: with a mean loss an empty batch is 0/0 "
                "(eager PyTorch would give a NaN loss and NaN gradients and silently poison "
                "the weights). Skip empty batches, e.g. DataLoader(..., drop_last=True)."
            )
    for path, leaf in paths:
        first = path[0]  # batch = (inputs, targets): a position in that tuple
        is_input = isinstance(first, pytree.SequenceKey) and first.idx == 0
        if (
            is_input
            and float_dtype is not None
            and isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.dtype != float_dtype
        ):
            fix = ".float()" if float_dtype == torch.float32 else f".to({float_dtype})"
            raise TrainInputError(
                f"batch leaf {_where(path)} is {leaf.dtype} (shape {tuple(leaf.shape)}) but the "
                f"model's parameters are {float_dtype}; PyTorch does not mix the two in one "
                f"matmul. Convert the batch ({_where(path)}{fix}), or pass mixed_precision= to "
                "train_step to cast inputs to the compute dtype."
            )
    specs = _leaf_specs(batch, batch_spec)
    if specs is None:
        raise TrainInputError(
            f"batch_spec {batch_spec!r} does not match the batch {describe_batch(batch)}: it "
            "must be one P(...) for every tensor of the batch, or a prefix of the batch's "
            "structure with a P(...) or None per part, e.g. (P('data'), P('data')) for "
            "(inputs, targets). Write P('data', None), not ('data', None)."
        )
    for (path, leaf), spec in zip(paths, specs, strict=True):
        if spec is None or not isinstance(leaf, torch.Tensor):
            continue
        try:
            spec.to_sharding(mesh, leaf.ndim)
        except SpecError as e:
            raise TrainInputError(
                f"batch_spec gives batch leaf {_where(path)} (shape {tuple(leaf.shape)}) the "
                f"spec {spec!r}, which does not fit: {e} The batch is {describe_batch(batch)}; "
                "give that part of batch_spec a spec it fits (or None: replicated)."
            ) from e


def check_optimizer_params(
    optimizer: torch.optim.Optimizer, model: nn.Module, trainable: Mapping[str, torch.Tensor]
) -> None:
    """The optimizer holds the model's trainable parameters (and perhaps frozen ones)."""
    params = optimizer_params(optimizer)
    given = {id(p) for p in params}
    wanted = {id(p) for p in trainable.values()}
    everything = {id(p) for p in model.parameters()}
    if not given <= everything or not wanted <= given:
        left_out = [k for k, p in trainable.items() if id(p) not in given]
        raise ArgumentError(
            f"the optimizer holds {len(given)} tensors, {len(given - everything)} of them not "
            f"parameters of this model, and leaves out the trainable parameters "
            f"{left_out[:5]}: build the optimizer from model.parameters() of the same model "
            "(freeze a parameter with requires_grad_(False) instead of leaving it out)."
        )
    if any(optimizer.state.get(p) for p in params):
        raise ArgumentError(
            "the optimizer already has state (it has taken steps); train_step starts from "
            "fresh optimizer states. Load a checkpoint with TrainStep.load_state_dict instead."
        )


MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: str | torch.dtype | None) -> torch.dtype | None:
    """The low-precision compute dtype ``mixed_precision`` names (None: float32)."""
    if mixed_precision is None or mixed_precision is torch.float32:
        return None
    if isinstance(mixed_precision, torch.dtype) and mixed_precision in MIXED_PRECISION.values():
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision in MIXED_PRECISION:
        return MIXED_PRECISION[mixed_precision]
    raise ArgumentError(
        f"mixed_precision must be None, 'bf16' or 'fp16' (or the torch dtype), got "
        f"{mixed_precision!r}."
    )


def check_step_arguments(optimizer: Any, mesh: Any, max_grad_norm: float | None) -> None:
    """``train_step``'s optimizer, mesh and ``max_grad_norm`` are of a kind it can use."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"train_step needs a torch.optim optimizer instance (AdamW, Adam, SGD), got "
            f"{optimizer!r}. Build it as usual: torch.optim.AdamW(model.parameters(), lr=...)."
        )
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError(f"train_step needs mesh=Mesh(...), got {mesh!r}.")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ArgumentError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}.")


def model_argument(model: Any) -> nn.Module:
    """``train_step``'s model: an ``nn.Module``, taken out of ``torch.compile`` (so that its
    parameters keep their own names, not ``_orig_mod.<name>``)."""
    model = uncompiled(model, "partita.train_step")
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"train_step needs an nn.Module, got {type(model).__name__}.")
    return model
