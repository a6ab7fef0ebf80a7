"""``partita.checkpoint.save`` / ``load``: sharded checkpoints through torch.distributed.checkpoint.

:func:`save` hands DCP a state dict whose sharded entries are this process's tiles
(:mod:`partita.checkpoint.tiles`), with partita's planners (:mod:`partita.checkpoint.planner`)
and DCP's own ``FileSystemWriter``, inside an atomic directory
(:mod:`partita.checkpoint.safety`). :func:`load` checks the request against the checkpoint's
metadata, then lets DCP read into buffers laid out for the *current* mesh and plan (resharding),
and only then replaces the state. Both work in one process (the LocalMesh) and under
``torch.distributed`` (every process calls them; each writes and reads its own shards).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from partita.checkpoint.module import (
    apply_module,
    is_virtual_module,
    module_request,
    module_state,
)
from partita.checkpoint.planner import LoadPlanner, SavePlanner
from partita.checkpoint.safety import (
    NamingReader,
    atomic_directory,
    check_request,
    read_metadata,
    unwrap,
)
from partita.checkpoint.state import (
    RESERVED,
    apply_loaded,
    apply_run_state,
    request_for_load,
    run_state,
    run_state_request,
    state_for_save,
)
from partita.checkpoint.tiles import assemble, tiles_to_read, tiles_to_write
from partita.errors import CheckpointError
from partita.tensor import ShardedTensor
from partita.train import TrainStep

__all__ = ["load", "save"]

Target = TrainStep | Mapping[str, ShardedTensor | torch.Tensor]


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _tensor_dict_for_save(tensors: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, ShardedTensor):
            out[name] = tiles_to_write(name, value)
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach()
        else:
            raise CheckpointError(
                f"checkpoint.save: {name!r} is a {type(value).__name__}; a tensor dict holds "
                "ShardedTensors or torch tensors. Nothing was saved. Put other values in a "
                "TrainStep checkpoint's extra= dict."
            )
    return out


def save(
    target: Target,
    path: str | os.PathLike[str],
    *,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Save a TrainStep (or a ``{name: ShardedTensor | Tensor}`` dict) to directory ``path``.

    Every process calls it; each writes only the tiles it owns (replicas once). A TrainStep's
    checkpoint holds its parameters, buffers, optimizer state and step, the RNG state, the
    ``scheduler``'s state and ``extra`` (a dict of numbers, strings, lists, dicts and tensors).
    An ``nn.Module`` on the virtual device (``partita.use_spmd``) saves its parameters' and
    buffers' shards, and with ``optimizer=`` its ``torch.optim`` optimizer's state.
    ``path`` appears only when the save is complete; an existing checkpoint there is replaced
    then (and stays loadable if the save fails).

    Example:
        >>> partita.checkpoint.save(step, "ckpt/step_100", extra={"batch": 100})  # doctest: +SKIP
        >>> extra = partita.checkpoint.load(step, "ckpt/step_100")  # doctest: +SKIP
    """
    path = Path(path)
    if optimizer is not None and not is_virtual_module(target):
        raise CheckpointError(
            f"checkpoint.save(optimizer=...) saves a torch.optim optimizer beside an nn.Module "
            f"on the virtual device; the target is a {type(target).__name__}. Nothing was "
            "saved. A TrainStep saves its own optimizer: leave optimizer= out."
        )
    if is_virtual_module(target):
        state = {**module_state(target, optimizer), **run_state(scheduler, extra)}
    elif isinstance(target, TrainStep):
        state = state_for_save(target, scheduler, extra)
    elif isinstance(target, Mapping):
        if scheduler is not None or extra is not None:
            raise CheckpointError(
                "checkpoint.save: scheduler= and extra= are saved with a TrainStep; this is "
                "a tensor dict. Nothing was saved. Add tensors to the dict, or save the step."
            )
        state = _tensor_dict_for_save(target)
    else:
        raise CheckpointError(
            f"checkpoint.save got a {type(target).__name__}; it saves a partita TrainStep or "
            "a {name: ShardedTensor | Tensor} dict. Nothing was saved. For an nn.Module use "
            "torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=path)."
        )
    with atomic_directory(path) as tmp, _Quiet():
        dcp.save(
            state,
            # per_thread_copy_ahead=0: DCP's default overlapping loader asks the PrivateUse1
            # backend's module for streams whenever one is registered, and partita's virtual
            # device (registered at import) has none; the tiles are CPU tensors anyway.
            storage_writer=FileSystemWriter(tmp, per_thread_copy_ahead=0),
            planner=SavePlanner(),
            no_dist=_no_dist(),
        )


def _load(path: Path, metadata: Any, request: dict[str, Any], **check: Any) -> None:
    flat, _ = flatten_state_dict(request)
    check_request(path, metadata, flat, **check)
    try:
        with _Quiet():
            dcp.load(
                request,
                storage_reader=NamingReader(path),
                planner=LoadPlanner(allow_partial_load=True),
                no_dist=_no_dist(),
            )
    except CheckpointException as e:
        inner = unwrap(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from e
        raise CheckpointError(
            f"checkpoint.load from {str(path)!r} failed: {type(inner).__name__}: {inner}. "
            "Nothing was loaded. Load an earlier checkpoint."
        ) from e


def load(
    target: Target,
    path: str | os.PathLike[str],
    *,
    scheduler: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Load the checkpoint at ``path`` into a TrainStep (or tensors laid out like a dict's).

    The checkpoint may come from any mesh and plan: each process reads the pieces of the saved
    chunks that overlap the tiles it holds now. Everything is checked against the checkpoint's
    metadata first (names, shapes, dtypes, files); a :class:`~partita.errors.CheckpointError`
    names the tensor and nothing changes.

    A virtual-device ``nn.Module`` (and ``optimizer=``, its torch.optim optimizer) is loaded in
    place: every tensor keeps its object and its current layout.

    Returns:
        for a TrainStep or a virtual-device nn.Module, the ``extra`` dict it was saved with
        (``{}`` without); for a dict, a new dict of the same keys with the loaded values
        (ShardedTensors keep the given tensors' shardings, torch tensors are new tensors).
    """
    path = Path(path)
    if optimizer is not None and not is_virtual_module(target):
        raise CheckpointError(
            f"checkpoint.load(optimizer=...) loads a torch.optim optimizer beside an nn.Module "
            f"on the virtual device; the target is a {type(target).__name__}. Nothing was "
            "loaded. A TrainStep loads its own optimizer: leave optimizer= out."
        )
    if is_virtual_module(target):
        metadata = read_metadata(path)
        request: dict[str, Any] = {
            **module_request(target, metadata, optimizer),
            **run_state_request(metadata, scheduler),
        }
        _load(
            path,
            metadata,
            request,
            optional=("rng.", "extra.", "lr_scheduler."),
            ignored=("optimizer.", "rng.", "lr_scheduler.", "extra."),
        )
        apply_module(target, request, optimizer)
        return apply_run_state(request, scheduler)
    if isinstance(target, TrainStep):
        metadata = read_metadata(path)
        request, state = request_for_load(target, metadata, scheduler)
        _load(
            path,
            metadata,
            request,
            optional=("rng.", "extra.", "lr_scheduler.", "optimizer.param_groups."),
            ignored=RESERVED,
        )
        return apply_loaded(target, request, state, scheduler)
    if not isinstance(target, Mapping):
        raise CheckpointError(
            f"checkpoint.load got a {type(target).__name__}; it loads into a partita "
            "TrainStep or a {name: ShardedTensor | Tensor} dict. Nothing was loaded. For an "
            "nn.Module use torch.distributed.checkpoint.load(model.state_dict(), ...)."
        )
    if scheduler is not None:
        raise CheckpointError(
            "checkpoint.load: scheduler= is restored into a TrainStep's checkpoint; this is a "
            "tensor dict. Nothing was loaded. Load the step, or leave scheduler= out."
        )
    request = {}
    for name, value in target.items():
        if isinstance(value, ShardedTensor):
            request[name] = tiles_to_read(name, value)
        elif isinstance(value, torch.Tensor):
            request[name] = torch.empty_like(value)
        else:
            raise CheckpointError(
                f"checkpoint.load: {name!r} is a {type(value).__name__}; a tensor dict holds "
                "ShardedTensors or torch tensors (templates of what to load). Nothing was "
                "loaded. Pass a tensor of the saved shape and dtype."
            )
    _load(
        path, read_metadata(path), request, ignored=("",)
    )  # a dict may load a subset of the checkpoint
    out: dict[str, Any] = {}
    for name, value in target.items():
        got = request[name]
        out[name] = assemble(value, got) if isinstance(value, ShardedTensor) else got
    return out


class _Quiet:
    """Silence DCP's "torch.distributed is disabled ... single process" warning (the
    LocalMesh is one process on purpose)."""

    def __enter__(self) -> None:
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint")

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
