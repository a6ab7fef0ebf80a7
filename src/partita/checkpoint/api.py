"""``partita.checkpoint.save`` / ``load``: sharded checkpoints through torch.distributed.checkpoint.

:func:`save` hands DCP a state dict whose sharded entries are this process's tiles
(:mod:`partita.checkpoint.tiles`), with partita's planners (:mod:`partita.checkpoint.planner`)
and DCP's own ``FileSystemWriter`` (which also hashes what it wrote), into a temporary
directory that becomes ``path`` only when complete (:mod:`partita.checkpoint.directory`).
:func:`load` finds the checkpoint, checks the request against its metadata, then lets DCP read
(each file checked against its sha256 first) into buffers laid out for the *current* mesh and
plan (resharding), and only then replaces the state. Both work in one process (the LocalMesh)
and under ``torch.distributed``, where every process calls them with the same path and their
collectives are bounded and typed (:mod:`partita.checkpoint.sync`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from partita.checkpoint import sync
from partita.checkpoint.directory import (
    Manifest,
    digest,
    prepare,
    publish,
    remove_temporary,
    resolve,
    temporary,
)
from partita.checkpoint.module import (
    apply_module,
    is_virtual_module,
    module_request,
    module_state,
)
from partita.checkpoint.planner import LoadPlanner, SavePlanner
from partita.checkpoint.safety import NamingReader, check_request, read_metadata, unwrap
from partita.checkpoint.state import (
    RESERVED,
    apply_loaded,
    apply_run_state,
    request_for_load,
    run_state,
    run_state_request,
    state_for_save,
)
from partita.checkpoint.tiles import Tiles, assemble, tiles_to_read, tiles_to_write
from partita.errors import CheckpointError
from partita.training.train import TrainStep
from partita.values.tensor import ShardedTensor

__all__ = ["load", "save"]

Target = TrainStep | Mapping[str, ShardedTensor | torch.Tensor]


def _no_dist() -> bool:
    return not sync.distributed()


# --- save ----------------------------------------------------------------------------------


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


def _state_for_save(
    target: Target, scheduler: Any, extra: dict[str, Any] | None, optimizer: Any
) -> dict[str, Any]:
    if optimizer is not None and not is_virtual_module(target):
        raise CheckpointError(
            f"checkpoint.save(optimizer=...) saves a torch.optim optimizer beside an nn.Module "
            f"on the virtual device; the target is a {type(target).__name__}. Nothing was "
            "saved. A TrainStep saves its own optimizer: leave optimizer= out."
        )
    if is_virtual_module(target):
        return {**module_state(target, optimizer), **run_state(scheduler, extra)}
    if isinstance(target, TrainStep):
        return state_for_save(target, scheduler, extra)
    if isinstance(target, Mapping):
        if scheduler is not None or extra is not None:
            raise CheckpointError(
                "checkpoint.save: scheduler= and extra= are saved with a TrainStep; this is "
                "a tensor dict. Nothing was saved. Add tensors to the dict, or save the step."
            )
        return _tensor_dict_for_save(target)
    raise CheckpointError(
        f"checkpoint.save got a {type(target).__name__}; it saves a partita TrainStep or "
        "a {name: ShardedTensor | Tensor} dict. Nothing was saved. For an nn.Module use "
        "torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=path)."
    )


class _HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that hashes the files this process wrote, once written."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.digests: dict[str, tuple[int, str]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # written synchronously; the future is set
        folder = Path(self.path)
        names = {r.storage_data.relative_path for r in future.wait()}
        self.digests = {n: ((folder / n).stat().st_size, digest(folder / n)) for n in names}
        return future


def _gather_digests(mine: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
    """Every process's written files and checksums, on rank 0 (``{}`` elsewhere)."""
    if not sync.distributed():
        return mine
    everyone: list[Any] | None = [None] * dist.get_world_size() if sync.is_main() else None
    sync.collective(
        "checkpoint.save",
        "collecting the written files' checksums",
        lambda: dist.gather_object(mine, everyone, dst=0),
    )
    return {name: value for d in everyone or [] for name, value in (d or {}).items()}


def _save_failure(path: Path, tmp: Path, e: BaseException) -> BaseException:
    if isinstance(e, CheckpointError) or not isinstance(e, Exception | CheckpointException):
        return e
    if isinstance(e, RuntimeError) and sync.distributed():  # raised by DCP's collectives
        what = "torch.distributed.checkpoint's planning and finishing"
        return sync.collective_error("checkpoint.save", what, e)
    return CheckpointError(
        f"checkpoint.save to {str(path)!r} failed while writing {str(tmp)!r}: {unwrap(e)}. "
        f"The previous contents of {str(path)!r} (if any) are unchanged and still load. Fix "
        "the cause above and save again."
    )


def save(
    target: Target,
    path: str | os.PathLike[str],
    *,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Save a TrainStep (or a ``{name: ShardedTensor | Tensor}`` dict) to directory ``path``.

    Every process calls it with the same ``path``; each writes only the tiles it owns
    (replicas once). A TrainStep's checkpoint holds its parameters, buffers, optimizer state
    and step, the RNG state, the ``scheduler``'s state and ``extra`` (a dict of ``None``,
    bools, ints, floats, strings and tensors, in lists, tuples and str-keyed dicts; numpy
    scalars are stored as the Python number). An ``nn.Module`` on the virtual device
    (``partita.use_spmd``) saves its parameters' and buffers' shards, and with
    ``optimizer=`` its ``torch.optim`` optimizer's state.

    ``path`` must be missing, an empty directory or an earlier partita checkpoint (anything
    else is refused before anything is written). The new checkpoint appears at ``path`` only
    when complete; the one it replaces stays loadable if the save fails or is killed at any
    point (``docs/checkpointing.md``).

    Example:
        >>> partita.checkpoint.save(step, "ckpt/step_100", extra={"batch": 100})  # doctest: +SKIP
        >>> extra = partita.checkpoint.load(step, "ckpt/step_100")  # doctest: +SKIP
    """
    path = Path(os.path.abspath(path))  # "." and "run/" get a name to put a temporary beside
    call = "checkpoint.save"
    state = sync.agree(call, path, lambda: _state_for_save(target, scheduler, extra, optimizer))
    save_id = sync.from_main(call, "preparing the directory", lambda: prepare(path))
    tmp = temporary(path, save_id)
    # per_thread_copy_ahead=0: DCP's default overlapping loader asks the PrivateUse1
    # backend's module for streams whenever one is registered, and partita's virtual
    # device (registered at import) has none; the tiles are CPU tensors anyway.
    writer = _HashingWriter(tmp, per_thread_copy_ahead=0)
    try:
        with _Quiet():
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=_no_dist())
        digests = _gather_digests(writer.digests)
        sync.from_main(call, "publishing the checkpoint", lambda: publish(path, save_id, digests))
    except BaseException as e:
        if sync.is_main():
            remove_temporary(path, save_id)  # unless publish renamed it to path already
        failure = _save_failure(path, tmp, e)
        if failure is e:
            raise
        raise failure from e


# --- load ----------------------------------------------------------------------------------


def _tensor_dict_request(target: Mapping[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = {}
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
    return request


def _check_load_arguments(target: Any, scheduler: Any, optimizer: Any) -> None:
    if optimizer is not None and not is_virtual_module(target):
        raise CheckpointError(
            f"checkpoint.load(optimizer=...) loads a torch.optim optimizer beside an nn.Module "
            f"on the virtual device; the target is a {type(target).__name__}. Nothing was "
            "loaded. A TrainStep loads its own optimizer: leave optimizer= out."
        )
    if not isinstance(target, TrainStep | Mapping) and not is_virtual_module(target):
        raise CheckpointError(
            f"checkpoint.load got a {type(target).__name__}; it loads into a partita "
            "TrainStep or a {name: ShardedTensor | Tensor} dict. Nothing was loaded. For an "
            "nn.Module use torch.distributed.checkpoint.load(model.state_dict(), ...)."
        )
    if isinstance(target, Mapping) and scheduler is not None:
        raise CheckpointError(
            "checkpoint.load: scheduler= is restored into a TrainStep's checkpoint; this is a "
            "tensor dict. Nothing was loaded. Load the step, or leave scheduler= out."
        )


_Plan = tuple[Path, Manifest | None, dict[str, Any], Callable[[], Any]]


def _plan_load(target: Any, path: Path, scheduler: Any, optimizer: Any) -> _Plan:
    """Everything a load does before reading, in this process: which directory, the checked
    request, and what to do with what is read into it."""
    _check_load_arguments(target, scheduler, optimizer)
    source, manifest = resolve(path)
    metadata = read_metadata(source, manifest)
    apply: Callable[[], Any]
    if is_virtual_module(target):
        request = {
            **module_request(target, metadata, optimizer),
            **run_state_request(metadata, scheduler),
        }
        optional: tuple[str, ...] = ("rng.", "extra.", "lr_scheduler.")
        ignored: tuple[str, ...] = ("optimizer.", "rng.", "lr_scheduler.", "extra.")

        def apply() -> Any:
            apply_module(target, request, optimizer)
            return apply_run_state(request, scheduler)

    elif isinstance(target, TrainStep):
        request, state = request_for_load(target, metadata, scheduler)
        optional = ("rng.", "extra.", "lr_scheduler.", "optimizer.param_groups.")
        ignored = RESERVED

        def apply() -> Any:
            return apply_loaded(target, request, state, scheduler)

    else:
        request = _tensor_dict_request(target)
        optional, ignored = (), ("",)  # a dict may load a subset of the checkpoint

        def apply() -> Any:
            got = {name: request[name] for name in target}
            return {
                name: assemble(value, got[name]) if isinstance(got[name], Tiles) else got[name]
                for name, value in target.items()
            }

    flat, _ = flatten_state_dict(request)
    check_request(source, metadata, flat, optional=optional, ignored=ignored)
    return source, manifest, request, apply


def _read(source: Path, manifest: Manifest | None, request: dict[str, Any]) -> None:
    try:
        with _Quiet():
            dcp.load(
                request,
                storage_reader=NamingReader(source, manifest),
                planner=LoadPlanner(allow_partial_load=True),
                no_dist=_no_dist(),
            )
    except CheckpointException as e:
        inner = unwrap(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from e
        raise CheckpointError(
            f"checkpoint.load from {str(source)!r} failed: {type(inner).__name__}: {inner}. "
            "Nothing was loaded. Load an earlier checkpoint."
        ) from e
    except RuntimeError as e:
        if not sync.distributed():
            raise
        what = "torch.distributed.checkpoint's planning and reading"  # DCP's collectives
        raise sync.collective_error("checkpoint.load", what, e) from e


def load(
    target: Target,
    path: str | os.PathLike[str],
    *,
    scheduler: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Load the checkpoint at ``path`` into a TrainStep (or tensors laid out like a dict's).

    Every process calls it with the same ``path``. The checkpoint may come from any mesh and
    plan: each process reads the pieces of the saved chunks that overlap the tiles it holds
    now. Everything is checked against the checkpoint's metadata first (names, shapes, dtypes,
    files), and every file against its sha256 before it is read; a
    :class:`~partita.errors.CheckpointError` names the tensor or file and nothing changes.

    A virtual-device ``nn.Module`` (and ``optimizer=``, its torch.optim optimizer) is loaded in
    place: every tensor keeps its object and its current layout.

    Returns:
        for a TrainStep or a virtual-device nn.Module, the ``extra`` dict it was saved with
        (``{}`` without); for a dict, a new dict of the same keys with the loaded values
        (ShardedTensors keep the given tensors' shardings, torch tensors are new tensors).
    """
    path = Path(os.path.abspath(path))  # "." and "run/" get a name to put a temporary beside
    source, manifest, request, apply = sync.agree(
        "checkpoint.load", path, lambda: _plan_load(target, path, scheduler, optimizer)
    )
    _read(source, manifest, request)
    return apply()


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
