"""The collectives of a save or load, each bounded and turned into a CheckpointError.

``checkpoint.save`` and ``checkpoint.load`` are collective: every process calls them with the
same path. Under ``torch.distributed`` they talk on the default process group (as DCP does),
whose timeout is the collective timeout (``partita.distributed.initialize``,
``PARTITA_COLLECTIVE_TIMEOUT``). A process that does not take part (the call is under
``if is_main_process():``, or the process died) makes the others' next collective fail once
that timeout has passed; :func:`collective` turns that raw Gloo/NCCL ``RuntimeError`` into a
:class:`~partita.errors.CheckpointError` naming the call, the step and the timeout.

In one process (no ``torch.distributed``) every function here runs locally. This module reads
and writes no files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from partita.errors import CheckpointError
from partita.runtime import launch

__all__ = ["agree", "collective", "collective_error", "distributed", "from_main", "is_main"]

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    return not distributed() or dist.get_rank() == 0


def collective_error(call: str, what: str, cause: BaseException) -> CheckpointError:
    """The error for a collective of ``call`` (e.g. ``checkpoint.save``) that failed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    text = str(cause).strip()
    first = text.splitlines()[0][:300] if text else type(cause).__name__
    timeout = launch.active_collective_timeout()
    kept = (
        "the path keeps a complete checkpoint: the previous one, or this one if rank 0 completed it"
        if "save" in call
        else "nothing was loaded"
    )
    return CheckpointError(
        f"{call} on rank {rank} of {world}: {what} (a collective over every process) failed: "
        f"{first}. {call} is collective: every process must call it, with the same path. A "
        f"process that does not (the call is under `if is_main_process():`, or that process "
        f"stopped or died) leaves the others waiting until the collective timeout ({timeout:g} "
        f"s, PARTITA_COLLECTIVE_TIMEOUT), then this error. Call {call} on every process; the "
        f"run cannot continue after this error: restart every process ({kept})."
    )


def collective(call: str, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` (one collective of ``call``); a backend failure becomes a CheckpointError."""
    try:
        return fn()
    except RuntimeError as e:  # DistBackendError, and Gloo's timeouts/closed connections
        raise collective_error(call, what, e) from e


def agree(call: str, path: Path, local: Callable[[], T]) -> T:
    """Run ``local`` on every process, then check together that the processes passed the same
    ``path`` and that ``local`` succeeded on each; a failure raises on every process.

    One small collective (an ``all_gather_object`` of the path and an error message).
    """
    error: CheckpointError | None = None
    result: T | None = None
    try:
        result = local()
    except CheckpointError as e:
        error = e
    if not distributed():
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    mine = (os.path.abspath(path), None if error is None else str(error))
    everyone: list[tuple[str, str | None] | None] = [None] * dist.get_world_size()
    collective(call, "the check that every process passed the same path",
               lambda: dist.all_gather_object(everyone, mine))  # fmt: skip
    paths = [entry[0] for entry in everyone if entry is not None]
    if len(set(paths)) > 1:
        listed = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise CheckpointError(
            f"{call}: the processes passed different paths ({listed}). Every process must "
            "pass the same path, on a file system all of them see: each process reads or "
            "writes only its own shards there, so with different paths no checkpoint is "
            f"complete. Nothing was {'saved' if 'save' in call else 'loaded'}. Pass the same "
            "path on every process (e.g. built from the step number, not the rank)."
        )
    if error is not None:
        raise error
    failed = [(r, entry[1]) for r, entry in enumerate(everyone) if entry and entry[1]]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{call} failed on rank {rank} (so on every rank): {message}")
    return result  # type: ignore[return-value]


def from_main(call: str, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and hand its result, or its error, to every process."""
    box: list[object] = [None, None]
    if is_main():
        try:
            box[0] = fn()
        except CheckpointError as e:
            box[1] = str(e)
            if not distributed():
                raise
            error: BaseException = e
        except Exception as e:
            box[1] = f"{call}: {what} failed on rank 0: {type(e).__name__}: {e}"
            error = e
            if not distributed():
                raise CheckpointError(str(box[1])) from e
    if distributed():
        collective(call, what, lambda: dist.broadcast_object_list(box, src=0))
    if box[1] is not None:
        if is_main():
            raise CheckpointError(str(box[1])) from error
        raise CheckpointError(str(box[1]))
    return box[0]  # type: ignore[return-value]
