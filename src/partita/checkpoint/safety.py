"""Never a half-written or mismatched checkpoint: atomic saves, checks before every load.

A save writes into ``<path>.tmp-<id>`` and renames it to ``<path>`` only once DCP has written
every file and its ``.metadata`` (under ``torch.distributed``: after a barrier, by rank 0), so a
save that dies midway leaves ``<path>`` as it was; a left-over ``.tmp-`` directory is never
read. The next save to ``<path>`` deletes such left-overs (with a warning naming them), and a
load from ``<path>`` warns about them. Overwriting an existing ``<path>`` moves it aside first
and deletes it only after the new one is in place.

A load reads DCP's ``.metadata`` and checks the whole request against it *before* reading any
tensor: every key present (or listed as missing), every size and dtype equal, every file there
and long enough for the bytes the metadata says it holds. Errors raised while DCP reads
(a corrupted file) are re-raised naming the tensor being read. Every failure is a
:class:`~partita.errors.CheckpointError`. This module builds no state dicts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from partita.checkpoint.tiles import Tiles
from partita.errors import CheckpointError, PartitaWarning

__all__ = [
    "NamingReader",
    "atomic_directory",
    "check_request",
    "leftovers",
    "read_metadata",
    "unwrap",
]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _shared_id() -> str:
    """A fresh id, the same on every process (rank 0 draws it)."""
    value = torch.tensor([uuid.uuid4().int % (1 << 62)], dtype=torch.int64)
    if _distributed():
        dist.broadcast(value, src=0)
    return f"{int(value):016x}"


def leftovers(path: Path) -> list[Path]:
    """The ``<path>.tmp-*`` directories beside ``path``: saves that died before finishing."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.tmp-*"))


def _remove_leftovers(path: Path) -> None:
    """Delete the temporaries of earlier saves to ``path`` that died (SIGKILL, power loss).

    Nothing reads them, and every killed save would otherwise leak a checkpoint's worth of
    disk. Two jobs saving to one ``path`` at once are unsupported anyway (the renames race).
    """
    found = leftovers(path)
    if not found:
        return
    warnings.warn(
        f"checkpoint.save to {str(path)!r}: removing {[p.name for p in found]}, left by "
        "earlier saves to this path that did not finish (killed processes); they were never "
        "read. Nothing to do, unless another job is saving to this same path (don't).",
        PartitaWarning,
        stacklevel=4,
    )
    for p in found:
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it becomes ``path``.

    Left-over temporaries of earlier, killed saves to ``path`` are removed first (by rank 0,
    before the id broadcast, so no rank has started writing the new one yet).
    """
    main = not _distributed() or dist.get_rank() == 0
    if main:
        _remove_leftovers(path)
    tmp = path.with_name(f"{path.name}.tmp-{_shared_id()}")
    try:
        yield tmp
    except BaseException as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        # DCP reports a failure on any rank as a CheckpointException (a BaseException)
        if isinstance(e, Exception | CheckpointException) and not isinstance(e, CheckpointError):
            raise CheckpointError(
                f"checkpoint.save to {str(path)!r} failed while writing {str(tmp)!r}: "
                f"{unwrap(e)}. The previous contents of {str(path)!r} (if any) are unchanged "
                "and still load. Fix the cause above and save again."
            ) from e
        raise
    if _distributed():
        dist.barrier()  # every rank's files are written (DCP's finish already synced)
    if main:
        old = path.with_name(f"{path.name}.old-{tmp.name.rsplit('-', 1)[1]}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if _distributed():
        dist.barrier()  # nobody reads `path` before it is renamed


def unwrap(e: BaseException) -> BaseException:
    """The first underlying error of a DCP ``CheckpointException`` (one per failing rank)."""
    if isinstance(e, CheckpointException):
        for inner, _trace in e.failures.values():
            return unwrap(inner)
    return e


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path`` (a pickle, read as DCP reads it)."""
    if not (path / ".metadata").is_file():
        found = [p.name for p in leftovers(path)]
        raise CheckpointError(
            f"checkpoint.load: {str(path)!r} is not a checkpoint (no {str(path / '.metadata')!r}"
            f"{'; the directory does not exist' if not path.exists() else ''}). "
            f"{f'Left-over incomplete saves beside it: {found}. ' if found else ''}"
            "Pass the path a completed checkpoint.save wrote."
        )
    stale = leftovers(path)
    if stale:
        warnings.warn(
            f"checkpoint.load from {str(path)!r}: {[p.name for p in stale]} beside it are "
            "left by saves to this path that did not finish (killed processes); they are not "
            "read, the checkpoint at the path is the last completed save. The next "
            "checkpoint.save to this path deletes them (or delete them yourself).",
            PartitaWarning,
            stacklevel=3,
        )
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint.load: {str(path / '.metadata')!r} cannot be read ({type(e).__name__}: "
            f"{e}); the file is damaged. Load an earlier checkpoint."
        ) from e


def _describe(value: Any) -> tuple[torch.Size, torch.dtype] | None:
    if isinstance(value, Tiles):
        return value.size, value.dtype
    if isinstance(value, torch.Tensor):
        return value.size(), value.dtype
    return None


def check_request(
    path: Path,
    metadata: Metadata,
    request: Mapping[str, Any],
    *,
    optional: tuple[str, ...] = (),
    ignored: tuple[str, ...] = (),
) -> None:
    """Check a flat ``{fqn: target}`` load request against the checkpoint, files included.

    Keys starting with a prefix in ``optional`` may be absent from the checkpoint (the caller
    skips them); checkpoint tensors that nobody asked for are an error (a different model)
    unless they start with a prefix in ``ignored``.
    """
    saved = metadata.state_dict_metadata
    missing = [k for k in request if k not in saved and not k.startswith(optional)]
    unexpected = [
        k
        for k, md in saved.items()
        if isinstance(md, TensorStorageMetadata) and k not in request and not k.startswith(ignored)
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint.load from {str(path)!r}: the checkpoint does not hold the same "
            f"tensors as this model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), not in this model {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}). It was saved from a "
            "different model (or configuration). Nothing was loaded. Load it into the model it "
            "was saved from, or load a subset with partita.checkpoint.load_tensors."
        )
    for key, target in request.items():
        md = saved.get(key)
        want = _describe(target)
        if md is None or want is None:
            continue
        if not isinstance(md, TensorStorageMetadata) or isinstance(md, BytesStorageMetadata):
            raise CheckpointError(
                f"checkpoint.load: {key!r} is saved as a Python object, but this model holds a "
                f"tensor of shape {tuple(want[0])} ({want[1]}) under that name. Nothing was "
                "loaded. The checkpoint is of a different model."
            )
        if md.size != want[0] or md.properties.dtype != want[1]:
            raise CheckpointError(
                f"checkpoint.load: {key!r} is saved with shape {tuple(md.size)} and dtype "
                f"{md.properties.dtype}, but this model holds shape {tuple(want[0])} and dtype "
                f"{want[1]}. Nothing was loaded. The checkpoint is of a different model "
                "configuration (or precision); load it into a model built like the one saved."
            )
    _check_files(path, metadata, request)


def _check_files(path: Path, metadata: Metadata, request: Mapping[str, Any]) -> None:
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in request:
            continue
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else -1
        end = info.offset + info.length
        if sizes[name] < end:
            state = "is missing" if sizes[name] < 0 else f"has {sizes[name]} bytes"
            raise CheckpointError(
                f"checkpoint.load: tensor {index.fqn!r} (chunk at offsets "
                f"{tuple(index.offset or ())}) is stored in {str(path / name)!r} at bytes "
                f"{info.offset}..{end}, but the file {state}: the checkpoint is incomplete or "
                "truncated (copied while being written?). Nothing was loaded. Load an earlier "
                "checkpoint, or copy this one again."
            )


class NamingReader(FileSystemReader):
    """DCP's FileSystemReader that remembers which tensor it is reading, for error messages."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        super().set_up_storage_reader(metadata, is_coordinator)
        self._names = {id(info): index.fqn for index, info in self.storage_data.items()}
        self.reading = ""

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self.reading = self._names.get(id(sinfo), "")
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint.load: reading tensor {self.reading!r} from {str(self.path)!r} "
                f"failed ({type(e).__name__}: {str(e)[:200]}): the file is damaged. Nothing was "
                "loaded. Load an earlier checkpoint."
            ) from e
